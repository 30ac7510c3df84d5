"""``GET /worker/earnings``: a worker reads its own earnings, proving who it is with its key.

The answer is built in ``queen_server.reports``; this route checks the worker's signature."""

from __future__ import annotations

import time
from datetime import UTC, datetime

from fastapi import APIRouter, Request
from fastapi.responses import Response

from queen_server import reports
from queen_server.errors import Unauthorized
from queen_server.http.deps import queen
from queen_server.identity import verify_signature
from shared_schema import WorkerEarnings, earnings_auth_payload
from shared_schema.protocol import EARNINGS_AUTH_MAX_SKEW_S, EARNINGS_AUTH_SCHEME

router = APIRouter()


def authenticated_worker(authorization: str | None, now: float) -> str:
    """The worker key that signed this request, or ``Unauthorized``."""
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
    if not verify_signature(pubkey, signature, earnings_auth_payload(pubkey, int(stamp))):
        raise Unauthorized("The worker signature does not verify.",
                           code="bad_worker_signature")
    return pubkey


@router.get("/worker/earnings", response_model=WorkerEarnings,
            summary="A worker's own earnings (signed with its Ed25519 key)")
async def worker_earnings(request: Request) -> Response:
    state = queen(request)
    pubkey = authenticated_worker(request.headers.get("authorization"), time.time())
    earnings = await reports.worker_earnings(state, pubkey, datetime.now(UTC))
    return Response(earnings.model_dump_json(), media_type="application/json")
