"""``GET /worker/earnings``: a worker reads its own earnings, proving who it is with its key;
``GET /worker/demand``: what developers ask this queen for (public, like ``/stats``).

The answer is built in ``queen_server.reports``; this route checks the worker's signature, which
names this queen's origin (``earnings_auth_payload``), so a header a worker sent to another
queen, or the same queen under another name, is refused here."""

from __future__ import annotations

import time
from datetime import UTC, datetime

from fastapi import APIRouter, Request
from fastapi.responses import Response

from queen_server import reports
from queen_server.errors import Unauthorized
from queen_server.http.deps import json_response, queen
from queen_server.identity import PROXY_HINT, RequestOrigins, origins_of, verify_signature
from shared_schema import Demand, WorkerEarnings, earnings_auth_payload
from shared_schema.protocol import EARNINGS_AUTH_MAX_SKEW_S, EARNINGS_AUTH_SCHEME

router = APIRouter()

# The form workers signed before signatures named the queen (protocol 1). Never accepted; a
# header that verifies under it only gets a refusal that says to upgrade.
_UNBOUND_CONTEXT = b"apiary-earnings/1"


def authenticated_worker(authorization: str | None, now: float, origins: RequestOrigins) -> str:
    """The worker key that signed this request for one of ``origins``, or ``Unauthorized``."""
    scheme, _, credentials = (authorization or "").partition(" ")
    pubkey, _, rest = credentials.strip().partition(".")
    stamp, _, signature = rest.partition(".")
    # A unix time is at most a dozen ASCII digits (int() of thousands would be an error).
    good_stamp = stamp.isascii() and stamp.isdigit() and len(stamp) <= 12
    if scheme != EARNINGS_AUTH_SCHEME or not (pubkey and good_stamp and signature):
        raise Unauthorized(f"Send 'Authorization: {EARNINGS_AUTH_SCHEME} "
                           "<pubkey>.<unix time>.<signature>', signed with the worker's key.",
                           code="missing_worker_signature")
    if abs(now - int(stamp)) > EARNINGS_AUTH_MAX_SKEW_S:
        raise Unauthorized("The signed time is too far from the queen's clock.",
                           code="stale_worker_signature")
    when = int(stamp)
    if any(verify_signature(pubkey, signature, earnings_auth_payload(pubkey, when, origin))
           for origin in origins.accepted):
        return pubkey
    elsewhere = next((origin for origin in origins.misdirected() if verify_signature(
        pubkey, signature, earnings_auth_payload(pubkey, when, origin))), None)
    if elsewhere is not None:
        raise Unauthorized(f"This request was signed for {elsewhere}; this queen is "
                           f"{origins.describe()}; {PROXY_HINT}.", code="wrong_origin")
    if verify_signature(pubkey, signature, b"\n".join([_UNBOUND_CONTEXT, pubkey.encode(),
                                                       stamp.encode()])):
        raise Unauthorized("The worker signed in the old form that names no queen: upgrade "
                           "your worker.", code="outdated_worker_signature")
    raise Unauthorized("The worker signature does not verify.", code="bad_worker_signature")


@router.get("/worker/earnings", response_model=WorkerEarnings,
            summary="A worker's own earnings (signed with its Ed25519 key)")
async def worker_earnings(request: Request) -> Response:
    state = queen(request)
    pubkey = authenticated_worker(request.headers.get("authorization"), time.time(),
                                  origins_of(request.app).for_scope(request.scope))
    earnings = await reports.worker_earnings(state, pubkey, datetime.now(UTC))
    return Response(earnings.model_dump_json(), media_type="application/json")


@router.get("/worker/demand", response_model=Demand,
            summary="What developers ask this queen for (issue 17): for a worker's app, before "
            "it connects (the first-run wizard) and for anyone deciding what to serve")
async def worker_demand(request: Request) -> Response:
    return json_response(queen(request).placement.demand.model_dump(mode="json"))
