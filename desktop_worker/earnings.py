"""Reading this worker's earnings from its queen, signed with the worker's own key."""

from __future__ import annotations

import time
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
        return WorkerEarnings.model_validate_json(response.content, extra="ignore")
    except ValidationError as exc:
        raise LinkError(f"the queen sent unreadable earnings: {exc}") from exc
