"""Value types shared by the LNURL client and the payment backends."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

import bolt11

from queen_server.payouts.lightning.errors import InvoiceMismatch

__all__ = ["Invoice", "PaymentResult", "PaymentStatus"]

logger = logging.getLogger(__name__)

PaymentStatus = Literal["paid", "pending", "failed", "unknown"]


@dataclass(frozen=True, slots=True)
class Invoice:
    """A BOLT11 invoice we have checked and may pay.

    ``description_hash`` is hex (empty when the invoice has none); ``expires_at`` is UTC.
    """

    bolt11: str
    payment_hash: str
    amount_msat: int
    description_hash: str
    expires_at: datetime

    @classmethod
    def from_bolt11(cls, text: str) -> Invoice:
        """Decode a stored BOLT11 string (for reconciliation); raises ``InvoiceMismatch``
        (``code="invalid"``) if it does not decode or has no amount. Nothing else is checked."""
        decoded = decode_bolt11(text)
        if not decoded.amount_msat:
            raise InvoiceMismatch("the invoice has no amount", code="amount")
        try:
            expires_at = datetime.fromtimestamp(decoded.date + decoded.expiry, UTC)
        except (OverflowError, ValueError, OSError) as exc:  # an expiry past the year 9999
            raise InvoiceMismatch("the invoice's expiry is absurd", code="expiry") from exc
        return cls(
            bolt11=text.strip(),
            payment_hash=decoded.payment_hash,
            amount_msat=int(decoded.amount_msat),
            description_hash=decoded.description_hash or "",
            expires_at=expires_at,
        )


def decode_bolt11(text: str) -> bolt11.Bolt11:
    """``bolt11.decode`` with every failure turned into ``InvoiceMismatch(code="invalid")``."""
    try:
        return bolt11.decode(text.strip())
    except Exception as exc:  # bolt11 raises its own errors, ValueError and bitstring errors
        logger.debug("undecodable invoice %r", text[:80], exc_info=True)
        raise InvoiceMismatch(f"the invoice is not a valid BOLT11 invoice ({exc!r})") from exc


@dataclass(frozen=True, slots=True)
class PaymentResult:
    """What a backend knows about one outgoing payment.

    ``status``:

    * ``paid``: the backend confirms it was paid (``preimage`` when it tells us, the proof).
    * ``pending``: in flight; ask ``status()`` later.
    * ``failed``: certainly not paid; it is safe to pay the worker again with a NEW invoice.
    * ``unknown``: we could not tell (the backend was unreachable, or answered ambiguously).
      Do not pay again: ask ``status()`` later.

    ``fee_msat`` is the routing fee, when known.
    """

    status: PaymentStatus
    payment_hash: str
    preimage: str | None = None
    fee_msat: int | None = None
    detail: str = ""
