"""The Lightning side of payouts: where to pay a worker, getting an invoice, paying it.

* ``parse_payout_address``: a worker's Lightning address or LNURL (or "don't pay me").
* ``fetch_invoice``: an invoice for an exact amount over LNURL-pay, checked (amount,
  description hash, expiry, network).
* ``guarded_client``: the HTTP client for worker-supplied URLs (no private addresses, DNS
  answers pinned), ``Resolver`` its injectable name resolution.
* ``LightningBackend``: pays it at most once and answers for it later (``LnbitsBackend``,
  ``NoneBackend``).
"""

from queen_server.payouts.lightning.addresses import PayoutAddress, parse_payout_address
from queen_server.payouts.lightning.backends import LightningBackend, LnbitsBackend, NoneBackend
from queen_server.payouts.lightning.errors import (
    InvalidPayoutAddress,
    InvoiceMismatch,
    LightningError,
    LnurlError,
)
from queen_server.payouts.lightning.guarded_http import Resolver, guarded_client, system_resolver
from queen_server.payouts.lightning.lnurl_pay import fetch_invoice
from queen_server.payouts.lightning.models import Invoice, PaymentResult, PaymentStatus

__all__ = [
    "InvalidPayoutAddress",
    "Invoice",
    "InvoiceMismatch",
    "LightningBackend",
    "LightningError",
    "LnbitsBackend",
    "LnurlError",
    "NoneBackend",
    "PaymentResult",
    "PaymentStatus",
    "PayoutAddress",
    "Resolver",
    "fetch_invoice",
    "guarded_client",
    "parse_payout_address",
    "system_resolver",
]
