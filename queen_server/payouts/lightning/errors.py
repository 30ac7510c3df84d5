"""Errors of the Lightning payout side: bad payout addresses, LNURL failures, bad invoices.

Each carries a short machine-readable ``code`` next to its human message, so the payout engine
can decide whether to retry later (``unreachable``), wait for more earnings
(``amount_out_of_range``) or give up on an address (``invalid_address``).
"""

from __future__ import annotations

from queen_server.errors import QueenError

__all__ = ["InvalidPayoutAddress", "InvoiceMismatch", "LightningError", "LnurlError"]


class LightningError(QueenError):
    """Base class for everything that can go wrong on the way to paying a worker."""

    code = "lightning_error"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code


class InvalidPayoutAddress(LightningError):
    """The text is neither a Lightning address (``name@domain``) nor an LNURL (``lnurl1...``)."""

    code = "invalid_address"


class LnurlError(LightningError):
    """The LNURL-pay service could not give us an invoice.

    ``code`` is one of ``unreachable`` (network error or timeout), ``private_address`` (the
    service's or its callback's host resolves to a loopback/private/... address: refused before
    connecting), ``bad_response`` (not HTTP 200, not JSON, not a ``payRequest``, numbers that are
    not finite whole msat amounts, bad callback), ``service_error`` (the service answered
    ``{"status": "ERROR", "reason": ...}``) or ``amount_out_of_range`` (then ``min_sendable`` and
    ``max_sendable`` say the range, in msat).
    """

    code = "bad_response"

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        min_sendable: int | None = None,
        max_sendable: int | None = None,
    ) -> None:
        super().__init__(message, code=code)
        self.min_sendable = min_sendable
        self.max_sendable = max_sendable


class InvoiceMismatch(LightningError):
    """The service sent an invoice we must not pay.

    ``code`` is one of ``invalid`` (not a decodable BOLT11), ``amount``, ``description_hash``,
    ``expired``, ``expiry`` (dated in the future or valid absurdly long) or ``network``.
    """

    code = "invalid"
