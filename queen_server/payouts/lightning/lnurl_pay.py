"""Getting an invoice for a worker's payout over LNURL-pay (LUD-06, LUD-16, LUD-12 comments).

1. ``GET address.url`` answers ``{"tag": "payRequest", "callback", "minSendable",
   "maxSendable", "metadata"}`` (amounts in msat) or ``{"status": "ERROR", "reason"}``.
2. ``GET callback?amount=<msat>`` answers ``{"pr": "<bolt11>", "routes": []}`` or an ERROR.
3. The invoice must be for exactly that amount, carry ``description_hash =
   sha256(metadata)`` (the metadata string exactly as received), be unexpired, and be on an
   accepted network.

Redirects are not followed, bodies are capped and every request has a deadline, so a hostile
address cannot make the queen wander, read without bound or wait forever. Whatever a service
answers (``1e999``, ``NaN``, JSON nested a million deep, a URL that does not parse, an invoice
expiring in the year 36869) ends as ``LnurlError`` or ``InvoiceMismatch``, never as another
exception. Given a client from ``guarded_client``, a service whose host resolves to a private
address is refused (``code="private_address"``) without a byte sent to it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import time
from collections.abc import Collection
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlencode, urlsplit, urlunsplit

import httpx

from queen_server.payouts.lightning.addresses import PayoutAddress, check_service_url
from queen_server.payouts.lightning.errors import InvalidPayoutAddress, InvoiceMismatch, LnurlError
from queen_server.payouts.lightning.guarded_http import refusal_in
from queen_server.payouts.lightning.models import Invoice, decode_bolt11

__all__ = ["MAX_RESPONSE_BYTES", "fetch_invoice"]

logger = logging.getLogger(__name__)

MAX_RESPONSE_BYTES = 256 * 1024
MAX_COMMENT_CHARS = 640
MAX_MSAT = 21_000_000 * 100_000_000 * 1000  # every bitcoin there will ever be
MAX_EXPIRY_S = 31 * 24 * 3600  # longer-lived invoices are refused as absurd
MAX_CLOCK_SKEW_S = 3600  # an invoice dated further in the future is refused


async def fetch_invoice(
    address: PayoutAddress,
    amount_msat: int,
    client: httpx.AsyncClient,
    *,
    comment: str | None = None,
    currencies: Collection[str] = frozenset({"bc"}),
    min_expiry_s: float = 10.0,
    deadline_s: float = 30.0,
) -> Invoice:
    """Ask ``address``'s LNURL-pay service for an invoice of ``amount_msat`` and check it.

    ``comment`` is sent (LUD-12) only if the service allows comments, cut to its limit.
    ``currencies`` are the accepted BOLT11 networks (``bc`` mainnet, ``tb`` testnet, ``tbs``
    signet, ``bcrt`` regtest). An invoice expiring within ``min_expiry_s`` counts as expired.
    Each of the two requests must be over within ``deadline_s`` (a service trickling its answer
    a byte at a time never trips the client's per-read timeout). Raises ``LnurlError`` or
    ``InvoiceMismatch``.
    """
    if amount_msat <= 0:
        raise ValueError(f"amount_msat must be positive, not {amount_msat}")
    params = await _get_json(client, address.url, what="the LNURL-pay service",
                             deadline_s=deadline_s)
    callback, metadata, min_sendable, max_sendable, comment_allowed = _pay_request(params)
    _check_callback(callback, address)
    if not min_sendable <= amount_msat <= max_sendable:
        raise LnurlError(
            f"{amount_msat} msat is outside what the service accepts "
            f"({min_sendable}..{max_sendable} msat)",
            code="amount_out_of_range",
            min_sendable=min_sendable,
            max_sendable=max_sendable,
        )
    query: dict[str, str] = {"amount": str(amount_msat)}
    if comment and comment_allowed > 0:
        query["comment"] = comment[: min(comment_allowed, MAX_COMMENT_CHARS)]
    answer = await _get_json(client, _with_query(callback, query), what="the LNURL-pay callback",
                             deadline_s=deadline_s)
    pr = answer.get("pr")
    if not isinstance(pr, str) or not pr.strip():
        raise LnurlError("the LNURL-pay callback sent no invoice ('pr')", code="bad_response")
    invoice = _check_invoice(pr.strip(), amount_msat, metadata, currencies, min_expiry_s)
    logger.info(
        "invoice for %d msat from %s: payment hash %s",
        amount_msat,
        address.original,
        invoice.payment_hash,
    )
    return invoice


def _pay_request(params: dict[str, Any]) -> tuple[str, str, int, int, int]:
    """``(callback, metadata, minSendable, maxSendable, commentAllowed)`` of a payRequest."""
    if params.get("tag") != "payRequest":
        raise LnurlError(
            f"the service is not an LNURL-pay service (tag {params.get('tag')!r})",
            code="bad_response",
        )
    callback = params.get("callback")
    metadata = params.get("metadata")
    if not isinstance(callback, str) or not callback:
        raise LnurlError("the payRequest has no callback URL", code="bad_response")
    if not isinstance(metadata, str):
        raise LnurlError("the payRequest has no metadata string", code="bad_response")
    try:
        entries = json.loads(metadata)
    except (ValueError, RecursionError) as exc:
        raise LnurlError("the payRequest metadata is not JSON", code="bad_response") from exc
    if not isinstance(entries, list):
        raise LnurlError("the payRequest metadata is not a JSON array", code="bad_response")
    min_sendable = _msat(params.get("minSendable"), "minSendable")
    max_sendable = _msat(params.get("maxSendable"), "maxSendable")
    if min_sendable < 1 or max_sendable < min_sendable:
        raise LnurlError(
            f"the payRequest limits make no sense ({min_sendable}..{max_sendable} msat)",
            code="bad_response",
        )
    allowed = params.get("commentAllowed", 0)
    comment_allowed = allowed if isinstance(allowed, int) and not isinstance(allowed, bool) else 0
    return callback, metadata, min_sendable, max_sendable, comment_allowed


def _msat(value: Any, name: str) -> int:
    """A JSON amount in msat as an int: whole, finite, and no more than all bitcoin."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise LnurlError(f"the payRequest {name} is not a whole number", code="bad_response")
    if isinstance(value, float) and (not math.isfinite(value) or not value.is_integer()):
        raise LnurlError(f"the payRequest {name} is not a whole number", code="bad_response")
    if not 0 <= value <= MAX_MSAT:
        raise LnurlError(f"the payRequest {name} is out of range", code="bad_response")
    return int(value)


def _check_callback(callback: str, address: PayoutAddress) -> None:
    """The callback must be https (http only for onion, or on the same plain-http host as the
    address, which only a test's ``insecure_hosts`` or an onion address can produce)."""
    base = urlsplit(address.url)
    try:
        same_insecure_host = (
            base.scheme == "http" and urlsplit(callback).netloc.lower() == base.netloc.lower()
        )
    except ValueError as exc:
        raise LnurlError("the payRequest callback is not a valid URL", code="bad_response") from exc
    try:
        check_service_url(
            callback,
            insecure_hosts={base.hostname or ""} if same_insecure_host else (),
            what="the payRequest callback",
        )
    except InvalidPayoutAddress as exc:
        raise LnurlError(exc.message, code="bad_response") from exc


def _with_query(url: str, params: dict[str, str]) -> str:
    """``url`` with ``params`` appended to whatever query it already has (fragment dropped)."""
    parts = urlsplit(url)
    extra = urlencode(params)
    query = f"{parts.query}&{extra}" if parts.query else extra
    return urlunsplit((parts.scheme, parts.netloc, parts.path, query, ""))


async def _get_json(
    client: httpx.AsyncClient, url: str, *, what: str, deadline_s: float
) -> dict[str, Any]:
    """GET ``url`` and return its JSON object, or raise ``LnurlError``. An LNURL
    ``{"status": "ERROR"}`` answer raises ``service_error`` whatever the HTTP status.

    The messages name the worker's own URL and nothing the queen learnt on the way (no socket
    error text): they end up on the worker's earnings page."""
    try:
        async with asyncio.timeout(deadline_s):
            async with client.stream(
                "GET", url, headers={"Accept": "application/json"}, follow_redirects=False
            ) as response:
                body = await _read_capped(response)
                status_code = response.status_code
    except (TimeoutError, httpx.TimeoutException) as exc:
        raise LnurlError(f"{what} did not answer in time ({url})", code="unreachable") from exc
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        refusal = refusal_in(exc)
        if refusal is not None:
            raise LnurlError(
                f"{what} is on a host that resolves to a {refusal.kind} address, so it was "
                "refused (payout services must be on the public internet)",
                code="private_address",
            ) from exc
        logger.info("%s at %s is unreachable: %r", what, url, exc)
        raise LnurlError(f"{what} is unreachable ({url})", code="unreachable") from exc
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        data = None
    if isinstance(data, dict) and str(data.get("status", "")).upper() == "ERROR":
        reason = str(data.get("reason") or "no reason given")[:500]
        raise LnurlError(f"{what} refused: {reason}", code="service_error")
    if status_code != 200:
        raise LnurlError(f"{what} answered HTTP {status_code} ({url})", code="bad_response")
    if not isinstance(data, dict):
        raise LnurlError(f"{what} did not answer a JSON object ({url})", code="bad_response")
    return data


async def _read_capped(response: httpx.Response) -> bytes:
    body = bytearray()
    async for piece in response.aiter_bytes():
        body += piece
        if len(body) > MAX_RESPONSE_BYTES:
            raise LnurlError(
                f"the answer from {response.request.url} is over {MAX_RESPONSE_BYTES} bytes",
                code="bad_response",
            )
    return bytes(body)


def _check_invoice(
    pr: str,
    amount_msat: int,
    metadata: str,
    currencies: Collection[str],
    min_expiry_s: float,
) -> Invoice:
    decoded = decode_bolt11(pr)
    if decoded.currency not in currencies:
        raise InvoiceMismatch(
            f"the invoice is for network {decoded.currency!r}, not one of {sorted(currencies)}",
            code="network",
        )
    if decoded.amount_msat is None or int(decoded.amount_msat) != amount_msat:
        raise InvoiceMismatch(
            f"the invoice asks for {decoded.amount_msat} msat, not {amount_msat} msat",
            code="amount",
        )
    expected_hash = hashlib.sha256(metadata.encode("utf-8")).hexdigest()
    if (decoded.description_hash or "").lower() != expected_hash:
        raise InvoiceMismatch(
            "the invoice's description hash is not sha256 of the service's metadata",
            code="description_hash",
        )
    now = time.time()
    if decoded.date > now + MAX_CLOCK_SKEW_S or decoded.expiry > MAX_EXPIRY_S:
        raise InvoiceMismatch(
            "the invoice's date or expiry is absurd (dated in the future, or valid for over "
            f"{MAX_EXPIRY_S // 86400} days)",
            code="expiry",
        )
    expires_at = decoded.date + decoded.expiry
    if expires_at - min_expiry_s <= now:
        raise InvoiceMismatch("the invoice has expired (or is about to)", code="expired")
    return Invoice(
        bolt11=pr,
        payment_hash=decoded.payment_hash,
        amount_msat=amount_msat,
        description_hash=expected_hash,
        expires_at=datetime.fromtimestamp(expires_at, UTC),
    )
