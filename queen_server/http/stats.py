"""Stats over HTTP: ``/stats`` (public), ``/worker/stats`` (an owner's own worker), the admin
JSON behind the pages (``/admin/api/...``), and Prometheus ``/metrics``.

A worker's key is never returned: pages and endpoints use its short public id.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import select

from queen_server.errors import InvalidRequest, NotFound
from queen_server.http.deps import json_response, queen, require_admin
from queen_server.identity import public_id
from queen_server.stats.swarm import WorkerStats
from queen_server.storage.tables import Payout

if TYPE_CHECKING:
    from queen_server.runtime import QueenState

router = APIRouter()

def _iso(when: float | None) -> str | None:
    return datetime.fromtimestamp(when, UTC).isoformat() if when is not None else None


def swarm_totals(state: QueenState) -> dict[str, Any]:
    registry, stats = state.registry, state.stats
    sessions = list(registry)
    p50, p95 = stats.ttft_percentiles()
    models = []
    for name in registry.model_names():
        price = state.billing.prices.for_parameters(registry.parameter_count(name))
        models.append({"id": name, "workers": len(registry.holders(name)), "price": {
            "size_class": price.size_class, "prompt_msat_per_1k": price.prompt_msat_per_1k,
            "completion_msat_per_1k": price.completion_msat_per_1k}})
    return {
        "workers_online": len(sessions),
        "gpus": sum(len(session.gpus) for session in sessions),
        "vram_total_mb": sum(session.vram_mb for session in sessions),
        "models": models,
        "tokens_per_s": round(stats.tokens_per_s(), 3),
        "jobs_per_min": round(stats.jobs_per_min(), 3),
        "ttft_p50_s": p50,
        "ttft_p95_s": p95,
    }


async def _earnings(state: QueenState) -> dict[str, int]:
    """Each worker's earnings (pending, available and paid) by key."""
    if state.billing.ledger is None:
        return {}
    totals: dict[str, int] = {}
    for account, amount in (await state.billing.ledger.balances("worker:")).items():
        key = account.split(":")[1]
        totals[key] = totals.get(key, 0) + amount
    return totals


def worker_row(state: QueenState, stats: WorkerStats, earnings: dict[str, int]) -> dict[str, Any]:
    session = state.registry.get(stats.key)
    return {
        "public_id": stats.public_id,
        "version": stats.version,
        "gpus": session.gpus if session else [],
        "vram_mb": session.vram_mb if session else 0,
        "models": sorted(session.cached) if session else [],
        "sec_per_token": stats.sec_per_token(),
        "jobs": stats.jobs,
        "failures": stats.failures,
        "timeouts": stats.timeouts,
        "failure_rate": round(stats.failure_rate, 4),
        "earnings_msat": earnings.get(stats.key, 0),
        "uptime_s": round(stats.uptime_s(state.stats.clock()), 1),
        "connected_since": _iso(stats.connected_at),
        "last_seen": _iso(stats.last_seen),
        "online": session is not None,
    }


def job_row(job: Any) -> dict[str, Any]:
    return {"id": job.id, "worker": job.worker, "model": job.model,
            "prompt_tokens": job.prompt_tokens, "completion_tokens": job.completion_tokens,
            "seconds": round(job.seconds, 4),
            "ttft_s": round(job.ttft_s, 4) if job.ttft_s is not None else None,
            "outcome": job.outcome, "at": _iso(job.at)}


@router.get("/stats", summary="Swarm totals: workers, GPUs, models, tokens/s, time to first token")
async def stats(request: Request) -> Response:
    return json_response(swarm_totals(queen(request)))


@router.get("/worker/stats", summary="One worker's stats, for its owner (by its public key)")
async def worker_stats(request: Request, key: str = "") -> Response:
    state = queen(request)
    if len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
        raise InvalidRequest("'key' must be the worker's public key (64 hex characters).",
                             param="key")
    found = state.stats.workers.get(key)
    if found is None:
        raise NotFound(f"No worker {public_id(key)} has connected to this queen.",
                       code="worker_not_found")
    return json_response(worker_row(state, found, await _earnings(state)))


@router.get("/admin/api/overview", include_in_schema=False)
async def admin_overview(request: Request) -> Response:
    state = require_admin(request)
    return json_response({"stats": swarm_totals(state), "series": state.stats.series()})


@router.get("/admin/api/workers", include_in_schema=False)
async def admin_workers(request: Request) -> Response:
    state = require_admin(request)
    earnings = await _earnings(state)
    rows = [worker_row(state, stats, earnings) for stats in state.stats.workers.values()]
    rows.sort(key=lambda row: (not row["online"], row["public_id"]))
    return json_response(rows)


@router.get("/admin/api/workers/{worker_id}", include_in_schema=False)
async def admin_worker(worker_id: str, request: Request) -> Response:
    state = require_admin(request)
    found = next((s for s in state.stats.workers.values() if s.public_id == worker_id), None)
    if found is None:
        raise NotFound(f"No worker {worker_id}.", code="worker_not_found")
    jobs = [job for job in state.stats.recent if job.worker_key == found.key]
    buckets: dict[int, dict[str, int]] = {}
    for job in jobs:
        point = buckets.setdefault(int(job.at // 60) * 60, {"jobs": 0, "tokens": 0})
        point["jobs"] += 1
        point["tokens"] += job.completion_tokens
    series = [{"t": t, **point} for t, point in sorted(buckets.items())]
    return json_response({"worker": worker_row(state, found, await _earnings(state)),
                          "series": series, "recent_jobs": [job_row(j) for j in jobs[:50]]})


@router.get("/admin/api/jobs", include_in_schema=False)
async def admin_jobs(request: Request) -> Response:
    state = require_admin(request)
    return json_response([job_row(job) for job in state.stats.recent])


@router.get("/admin/api/models", include_in_schema=False)
async def admin_models(request: Request) -> Response:
    state = require_admin(request)
    registry = state.registry
    rows = []
    for model in swarm_totals(state)["models"]:
        holders = registry.holders(model["id"])
        rows.append({**model, "loaded_on": sum(model["id"] in s.loaded for s in holders),
                     "parameter_count": registry.parameter_count(model["id"])})
    return json_response(rows)


@router.get("/admin/api/payouts", include_in_schema=False)
async def admin_payouts(request: Request) -> Response:
    state = require_admin(request)
    if state.db is None:
        return json_response([])
    async with state.db.engine.connect() as conn:
        rows = (await conn.execute(select(Payout).order_by(Payout.id.desc()).limit(200))).all()
    return json_response([{"id": r.id, "worker": public_id(r.worker_key),
                           "amount_msat": r.amount_msat, "state": r.state,
                           "updated_at": r.updated_at.isoformat(), "detail": r.detail}
                          for r in rows])


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    return Response(generate_latest(queen(request).metrics.registry),
                    media_type=CONTENT_TYPE_LATEST)
