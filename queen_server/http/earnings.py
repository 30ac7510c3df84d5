"""``GET /worker/earnings``: a worker reads its own earnings, proving who it is with its key."""

from __future__ import annotations

import time
from datetime import UTC, date, datetime, timedelta
from typing import TYPE_CHECKING

from fastapi import APIRouter, Request
from fastapi.responses import Response
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from queen_server.billing import ledger
from queen_server.errors import NotFound, Unauthorized
from queen_server.identity import public_id, verify_signature
from queen_server.storage.tables import LedgerEntry, LedgerTxn, Payout
from shared_schema import PayoutView, WorkerEarnings, earnings_auth_payload
from shared_schema.openai_types import DailyEarning, JobEarning
from shared_schema.protocol import EARNINGS_AUTH_MAX_SKEW_S, EARNINGS_AUTH_SCHEME

if TYPE_CHECKING:
    from queen_server.runtime import QueenState

router = APIRouter()

HISTORY_DAYS = 30
RECENT_JOBS = 50


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
    state: QueenState = request.app.state.queen
    pubkey = authenticated_worker(request.headers.get("authorization"), time.time())
    store = state.billing.ledger
    if store is None:
        raise NotFound("This queen keeps no ledger.", code="no_ledger")
    balances = await store.balances(f"worker:{pubkey}:")
    midnight = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    total, today = await store.worker_credits(pubkey, midnight)
    jobs = await store.worker_jobs(pubkey)
    async with store.engine.connect() as conn:
        payouts = (await conn.execute(
            select(Payout).where(Payout.worker_key == pubkey).order_by(Payout.id.desc())
            .limit(10))).all()
    daily, recent = await earnings_history(store.engine, pubkey, midnight.date())
    earnings = WorkerEarnings(
        worker_id=public_id(pubkey),
        jobs_settled=jobs,
        escrow_jobs_left=max(0, state.settings.escrow_jobs + 1 - jobs),
        pending_msat=balances.get(ledger.worker_pending(pubkey), 0),
        available_msat=balances.get(ledger.worker_available(pubkey), 0),
        paid_msat=balances.get(f"worker:{pubkey}:paid", 0),
        today_msat=today,
        total_msat=total,
        recent_payouts=[PayoutView(id=p.id, amount_msat=p.amount_msat, state=p.state,
                                   updated_at=p.updated_at, detail=p.detail) for p in payouts],
        week_msat=sum(d.earned_msat for d in daily[-7:]),
        daily=daily,
        recent_jobs=recent,
    )
    return Response(earnings.model_dump_json(), media_type="application/json")


async def earnings_history(
    engine: AsyncEngine, pubkey: str, today: date
) -> tuple[list[DailyEarning], list[JobEarning]]:
    """The worker's credits per UTC day for the last ``HISTORY_DAYS`` days (oldest first, empty
    days included) and per job for its latest ``RECENT_JOBS`` settled jobs (newest first)."""
    first = today - timedelta(days=HISTORY_DAYS - 1)
    since = datetime(first.year, first.month, first.day, tzinfo=UTC)
    accounts = [ledger.worker_pending(pubkey), ledger.worker_available(pubkey)]
    query = (
        select(LedgerTxn.id, LedgerTxn.created_at, LedgerEntry.amount_msat)
        .join(LedgerEntry, LedgerEntry.txn_id == LedgerTxn.id)
        .where(LedgerEntry.account.in_(accounts), LedgerTxn.kind == "charge",
               LedgerTxn.created_at >= since)
        .order_by(LedgerTxn.seq.desc())
    )
    async with engine.connect() as conn:
        rows = (await conn.execute(query)).all()
    per_day = {first + timedelta(days=i): 0 for i in range(HISTORY_DAYS)}
    per_job: dict[str, JobEarning] = {}  # newest first; a txn may credit both accounts
    for txn_id, created_at, amount in rows:
        stamp = created_at if created_at.tzinfo else created_at.replace(tzinfo=UTC)
        day = stamp.astimezone(UTC).date()
        if day in per_day:
            per_day[day] += amount
        if not txn_id.startswith("settle:"):
            continue
        job_id = txn_id.removeprefix("settle:")
        if job_id in per_job:
            earned = per_job[job_id].earned_msat + amount
            per_job[job_id] = per_job[job_id].model_copy(update={"earned_msat": earned})
        elif len(per_job) < RECENT_JOBS:
            per_job[job_id] = JobEarning(job_id=job_id, earned_msat=amount, settled_at=stamp)
    recent = list(per_job.values())
    daily = [DailyEarning(day=day, earned_msat=msat) for day, msat in sorted(per_day.items())]
    return daily, recent
