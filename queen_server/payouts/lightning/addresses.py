"""The queen's boundary to the payout address parser in ``shared_schema.payout_address``.

The rules live there, shared with the desktop app's settings field. Here the shared
``InvalidPayoutAddress`` (a ``ValueError``) becomes the queen's own ``InvalidPayoutAddress``
(a ``LightningError`` with ``code == "invalid_address"``), so the hello handler, the payout
runner and LNURL-pay handle only the queen's errors.
"""

from __future__ import annotations

from collections.abc import Collection

from queen_server.payouts.lightning.errors import InvalidPayoutAddress
from shared_schema import payout_address as _shared
from shared_schema.payout_address import MAX_ADDRESS_CHARS, PayoutAddress

__all__ = ["MAX_ADDRESS_CHARS", "PayoutAddress", "check_service_url", "parse_payout_address"]


def parse_payout_address(
    text: str | None, *, insecure_hosts: Collection[str] = ()
) -> PayoutAddress | None:
    """The payout address in ``text``, None for "don't pay me", or ``InvalidPayoutAddress``."""
    try:
        return _shared.parse_payout_address(text, insecure_hosts=insecure_hosts)
    except _shared.InvalidPayoutAddress as exc:
        raise InvalidPayoutAddress(exc.message) from exc


def check_service_url(url: str, *, insecure_hosts: Collection[str] = (), what: str) -> None:
    """Refuse a URL that is not ``https://<DNS name>``, ``http://<...>.onion`` or ``http(s)``
    on one of ``insecure_hosts``. Raises the queen's ``InvalidPayoutAddress`` naming ``what``."""
    try:
        _shared.check_service_url(url, insecure_hosts=insecure_hosts, what=what)
    except _shared.InvalidPayoutAddress as exc:
        raise InvalidPayoutAddress(exc.message) from exc
