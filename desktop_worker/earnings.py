"""Reading this worker's earnings from its queen, signed with the worker's own key."""

from __future__ import annotations

import json
import time
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
from pydantic import ValidationError

from desktop_worker.errors import LinkError
from desktop_worker.identity import WorkerIdentity
from shared_schema import InvalidQueenUrl, WorkerEarnings, earnings_auth_payload, queen_origin
from shared_schema.protocol import EARNINGS_AUTH_SCHEME


def queen_http_url(queen_url: str) -> str:
    """``ws://host:port/worker`` -> ``http://host:port`` (``wss`` -> ``https``)."""
    parts = urlsplit(queen_url)
    scheme = {"ws": "http", "wss": "https"}.get(parts.scheme, parts.scheme)
    return urlunsplit((scheme, parts.netloc, "", "", ""))


def earnings_authorization(identity: WorkerIdentity, origin: str,
                           now: float | None = None) -> str:
    """The ``Authorization`` header for ``/worker/earnings`` at the queen of ``origin``
    (``queen_origin`` of the URL the request goes to): a header stolen from one queen's logs
    or by a hostile queen cannot be replayed at another."""
    stamp = int(now if now is not None else time.time())
    signature = identity.sign(earnings_auth_payload(identity.pubkey, stamp, origin))
    return f"{EARNINGS_AUTH_SCHEME} {identity.pubkey}.{stamp}.{signature}"


async def fetch_earnings(
    queen_url: str, identity: WorkerIdentity, client: httpx.AsyncClient | None = None
) -> WorkerEarnings:
    return read_earnings(await fetch_earnings_json(queen_url, identity, client))


def read_earnings(body: dict[str, Any]) -> WorkerEarnings:
    """The earnings answer's figures (fields this worker does not know are ignored)."""
    try:
        return WorkerEarnings.model_validate(body, extra="ignore")
    except ValidationError as exc:
        raise LinkError(f"the queen sent unreadable earnings: {exc}") from exc


async def fetch_earnings_json(
    queen_url: str, identity: WorkerIdentity, client: httpx.AsyncClient | None = None
) -> dict[str, Any]:
    """The queen's earnings answer as a JSON object, not yet validated: the desktop app reads
    its optional parts (the audit standing) leniently, apart from the figures."""
    try:
        origin = queen_origin(queen_url)
    except InvalidQueenUrl as exc:
        raise LinkError(str(exc)) from exc
    url = queen_http_url(queen_url) + "/worker/earnings"
    # Signed for the origin of the URL requested; redirects are not followed (httpx's default),
    # so the request goes to the queen the signature names.
    headers = {"Authorization": earnings_authorization(identity, origin)}
    try:
        if client is None:
            async with httpx.AsyncClient(timeout=10) as own:
                response = await own.get(url, headers=headers)
        else:
            response = await client.get(url, headers=headers)
    except httpx.HTTPError as exc:
        raise LinkError(f"cannot reach the queen at {url}: {exc}") from exc
    if response.status_code != 200:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text[:200]
        raise LinkError(f"the queen refused the earnings request ({response.status_code}): "
                        f"{message}")
    try:
        body = json.loads(response.content)
    except (ValueError, RecursionError) as exc:  # RecursionError: nesting past the C stack
        raise LinkError(f"the queen sent unreadable earnings: {exc}") from exc
    if not isinstance(body, dict):
        raise LinkError("the queen sent unreadable earnings: not a JSON object")
    return body
