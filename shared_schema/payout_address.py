"""The payout address a worker gives: a Lightning address or an LNURL, or nothing.

Pure parsing, shared by both sides: the queen checks the ``ln_url`` of every hello with it
(``queen_server/payouts/lightning/addresses.py`` translates the error into its own), and the desktop
app checks its settings field live with ``check_payout_address``, by the same rules.

* A Lightning address (LUD-16), ``name@domain.tld``: paid through
  ``https://domain.tld/.well-known/lnurlp/name``. The name is lowercased and limited to
  ``a-z 0-9 - _ . +``; the domain must be a DNS name (no IP address, no port).
* An LNURL (LUD-01), ``lnurl1...`` (bech32, either case, optionally ``lightning:``-prefixed):
  decoded to its URL, which must be ``https`` (or ``http`` for a ``.onion`` host).
* ``None``, ``""`` or whitespace: the worker does not want to be paid.

What owners paste instead gets a reason that says what it is (``_what_it_is``): an on-chain
Bitcoin address (``bc1...``, ``1...``, ``3...``, or a ``bitcoin:`` link; Apiary pays over
Lightning) or a Lightning invoice (``lnbc...``; it can be paid only once).

``insecure_hosts`` lets tests point addresses at a local fake: a Lightning address on such a host
may carry a port (``alice@127.0.0.1:8080``) and resolves to ``http://``; an LNURL may decode to
an ``http://`` URL on such a host. Nothing here touches the network.
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import re
from collections.abc import Collection
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

from bech32 import bech32_decode, convertbits

from shared_schema.errors import SchemaError

__all__ = [
    "INVOICE",
    "MAX_ADDRESS_CHARS",
    "ON_CHAIN",
    "InvalidPayoutAddress",
    "PayoutAddress",
    "check_payout_address",
    "check_service_url",
    "parse_payout_address",
]

logger = logging.getLogger(__name__)

MAX_ADDRESS_CHARS = 2000
_NOT_AN_ADDRESS = "not a Lightning address (name@domain) or an LNURL (lnurl1...)"
_USE_INSTEAD = "use a Lightning address like you@wallet.com or an LNURL (lnurl1...)"
ON_CHAIN = f"that is an on-chain Bitcoin address; Apiary pays over Lightning: {_USE_INSTEAD}"
INVOICE = f"{_NOT_AN_ADDRESS}: that is a Lightning invoice, which can be paid only once"

_NAME = re.compile(r"[a-z0-9\-_.+]+")
_LABEL = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")
_TLD = re.compile(r"[a-z]{2,63}|xn--[a-z0-9-]{1,59}")
_PORT = re.compile(r"[0-9]{1,5}")
# On-chain Bitcoin addresses: segwit (bech32, mainnet, testnet, regtest) and legacy base58.
_SEGWIT = re.compile(r"(?:bc|tb|bcrt)1[ac-hj-np-z02-9]{6,87}", re.IGNORECASE)
_LEGACY = re.compile(r"[13mn2][1-9A-HJ-NP-Za-km-z]{25,34}")
_BASE58_ALPHABET = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
# BOLT 11 invoices: ln + a network (bc, tb, tbs, bcrt, sb) + an amount or the separator.
_INVOICE = re.compile(r"ln(?:bc|tbs|tb|bcrt|sb)[0-9a-z]*1[ac-hj-np-z02-9]{20,}", re.IGNORECASE)


class InvalidPayoutAddress(SchemaError, ValueError):
    """The text is neither a Lightning address (``name@domain``) nor an LNURL (``lnurl1...``),
    or a URL is not one we may call. ``str(error)`` is the reason, fit to show the owner."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


@dataclass(frozen=True, slots=True)
class PayoutAddress:
    """Where to ask for an invoice: ``url`` is the LNURL-pay endpoint (the first GET)."""

    kind: Literal["lightning_address", "lnurl"]
    original: str
    url: str


def parse_payout_address(
    text: str | None, *, insecure_hosts: Collection[str] = ()
) -> PayoutAddress | None:
    """The payout address in ``text``, None for "don't pay me", or ``InvalidPayoutAddress``."""
    if text is None or not text.strip():
        return None
    original = text.strip()
    if len(original) > MAX_ADDRESS_CHARS:
        raise InvalidPayoutAddress(f"{_NOT_AN_ADDRESS}: it is over {MAX_ADDRESS_CHARS} characters")
    insecure = {host.lower() for host in insecure_hosts}
    body = original
    if body[:10].lower() == "lightning:":
        body = body[10:].strip()
    if body.lower().startswith("lnurl1"):
        url = _lnurl_to_url(body, insecure)
        return PayoutAddress(kind="lnurl", original=original, url=url)
    if "@" in body:
        url = _lightning_address_url(body, insecure)
        return PayoutAddress(kind="lightning_address", original=original, url=url)
    raise InvalidPayoutAddress(_what_it_is(body))


def check_payout_address(text: str | None) -> str | None:
    """None when ``text`` is a usable payout address or empty ("don't pay me"); otherwise the
    reason it is not, for a settings field to show as the owner types."""
    try:
        parse_payout_address(text)
    except InvalidPayoutAddress as exc:
        return exc.message
    return None


def _what_it_is(text: str) -> str:
    """Why ``text`` (neither an address nor an LNURL) is refused: what it looks like when it is
    something a wallet shows (an on-chain address, an invoice), else the plain refusal."""
    if text[:8].lower() == "bitcoin:":  # a BIP 21 link: the address, then ?amount=...
        return ON_CHAIN
    if _INVOICE.fullmatch(text):
        return INVOICE
    if _SEGWIT.fullmatch(text) or (_LEGACY.fullmatch(text) and _base58check(text)):
        return ON_CHAIN
    return _NOT_AN_ADDRESS


def _base58check(text: str) -> bool:
    """Whether ``text`` is base58 whose last 4 bytes are the double-SHA256 checksum of the rest
    (a legacy address, not just any string of those letters)."""
    number = 0
    for char in text:
        number = number * 58 + _BASE58_ALPHABET.index(char)
    raw = number.to_bytes(25, "big") if number < 1 << 200 else b""
    if len(raw) != 25:
        return False
    body, checksum = raw[:-4], raw[-4:]
    return hashlib.sha256(hashlib.sha256(body).digest()).digest()[:4] == checksum


def _lightning_address_url(text: str, insecure: set[str]) -> str:
    name, sep, domain = text.rpartition("@")
    if not sep or not name or not domain:
        raise InvalidPayoutAddress(_NOT_AN_ADDRESS)
    name = name.lower()
    if not _NAME.fullmatch(name):
        raise InvalidPayoutAddress(
            f"{_NOT_AN_ADDRESS}: the name {name!r} may only use a-z, 0-9, '-', '_', '.' and '+'"
        )
    domain = domain.lower()
    host, _, port = domain.partition(":")
    if host in insecure:
        if port and not (_PORT.fullmatch(port) and 0 < int(port) < 65536):
            raise InvalidPayoutAddress(f"{_NOT_AN_ADDRESS}: bad port {port!r}")
        return f"http://{domain}/.well-known/lnurlp/{name}"
    if not _is_dns_name(domain):
        raise InvalidPayoutAddress(
            f"{_NOT_AN_ADDRESS}: {domain!r} is not a domain name like example.com"
        )
    scheme = "http" if domain.endswith(".onion") else "https"
    return f"{scheme}://{domain}/.well-known/lnurlp/{name}"


def _is_dns_name(domain: str) -> bool:
    if len(domain) > 253:
        return False
    labels = domain.split(".")
    if len(labels) < 2 or not _TLD.fullmatch(labels[-1]):
        return False
    return all(_LABEL.fullmatch(label) for label in labels)


def _lnurl_to_url(text: str, insecure: set[str]) -> str:
    hrp, data = bech32_decode(text)
    if hrp != "lnurl" or data is None:
        raise InvalidPayoutAddress(f"{_NOT_AN_ADDRESS}: the LNURL is not valid bech32")
    raw = convertbits(data, 5, 8, False)
    if raw is None:
        raise InvalidPayoutAddress(f"{_NOT_AN_ADDRESS}: the LNURL does not decode to bytes")
    try:
        url = bytes(raw).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidPayoutAddress(f"{_NOT_AN_ADDRESS}: the LNURL is not a URL") from exc
    check_service_url(url, insecure_hosts=insecure, what="the LNURL")
    logger.debug("LNURL decoded to %s", url)
    return url


def check_service_url(url: str, *, insecure_hosts: Collection[str] = (), what: str) -> None:
    """Refuse a URL that is not ``https://<DNS name>``, ``http://<...>.onion`` or ``http(s)``
    on one of ``insecure_hosts``. Raises ``InvalidPayoutAddress`` naming ``what``."""
    if any(ch.isspace() for ch in url) or any(ord(ch) < 32 for ch in url):
        raise InvalidPayoutAddress(f"{what} is not a valid URL")
    try:
        parts = urlsplit(url)
        host = (parts.hostname or "").lower()
        parts.port  # noqa: B018  (raises ValueError for a bad port)
    except ValueError as exc:
        raise InvalidPayoutAddress(f"{what} is not a valid URL: {url!r}") from exc
    if parts.scheme not in ("http", "https") or not host or parts.username or parts.password:
        raise InvalidPayoutAddress(f"{what} must be an https:// URL, not {url!r}")
    if host in {h.lower() for h in insecure_hosts}:
        return
    if _is_ip(host) or not _is_dns_name(host):
        raise InvalidPayoutAddress(f"{what} must be on a public domain name, not {host!r}")
    if parts.scheme == "http" and not host.endswith(".onion"):
        raise InvalidPayoutAddress(f"{what} must use https://, not {url!r}")


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True
