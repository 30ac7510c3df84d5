"""Stats over HTTP: ``/stats`` (public), ``/worker/stats`` (an owner's own worker), the admin
JSON behind the pages (``/admin/api/...``), and Prometheus ``/metrics``.

The answers are built in ``queen_server.reports``, which the pages call too; these routes check
who is asking and serialise them. A worker's key is never returned: only its short public id.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from queen_server import reports
from queen_server.errors import InvalidRequest
from queen_server.http.deps import json_response, queen, require_admin
from queen_server.http.io import parse, read_body
from shared_schema.admin_types import ModelRepin

router = APIRouter()


def _is_worker_key(key: str) -> bool:
    return len(key) == 64 and all(c in "0123456789abcdef" for c in key)


@router.get("/stats", summary="Swarm totals: workers, GPUs, models, tokens/s, time to first token")
async def stats(request: Request) -> Response:
    return json_response(await reports.stats(queen(request)))


@router.get("/worker/stats", summary="One worker's stats, for its owner (by its public key)")
async def worker_stats(request: Request, key: str = "") -> Response:
    if not _is_worker_key(key):
        raise InvalidRequest("'key' must be the worker's public key (64 hex characters).",
                             param="key")
    return json_response(await reports.worker_stats(queen(request), key))


@router.get("/admin/api/overview", include_in_schema=False)
async def admin_overview(request: Request) -> Response:
    return json_response(await reports.overview(require_admin(request)))


@router.get("/admin/api/workers", include_in_schema=False)
async def admin_workers(request: Request) -> Response:
    return json_response(await reports.workers(require_admin(request)))


@router.get("/admin/api/workers/{worker_id}", include_in_schema=False)
async def admin_worker(worker_id: str, request: Request) -> Response:
    return json_response(await reports.worker(require_admin(request), worker_id))


@router.get("/admin/api/jobs", include_in_schema=False)
async def admin_jobs(request: Request) -> Response:
    return json_response(await reports.jobs(require_admin(request)))


@router.get("/admin/api/models", include_in_schema=False)
async def admin_models(request: Request) -> Response:
    return json_response(await reports.models(require_admin(request)))


@router.post("/admin/api/models/repin", include_in_schema=False)
async def admin_repin_model(request: Request) -> Response:
    """Re-pin a hub name to the file the hub holds now (issue 39): routing, price and audits
    move to it together."""
    state = require_admin(request)
    body = parse(ModelRepin, await read_body(request, state.settings.max_body_bytes))
    return json_response(await reports.repin(state, body.model))


@router.get("/admin/api/placements", include_in_schema=False)
async def admin_placements(request: Request) -> Response:
    return json_response(await reports.placements(require_admin(request)))


@router.get("/admin/api/groups", include_in_schema=False)
async def admin_groups(request: Request) -> Response:
    return json_response(await reports.groups(require_admin(request)))


@router.get("/admin/api/payouts", include_in_schema=False)
async def admin_payouts(request: Request) -> Response:
    return json_response(await reports.payouts(require_admin(request)))


@router.get("/admin/api/audits", include_in_schema=False)
async def admin_audits(request: Request) -> Response:
    return json_response(await reports.audits(require_admin(request)))


@router.post("/admin/api/audits/{worker_id}/clear", include_in_schema=False)
async def admin_clear_flag(worker_id: str, request: Request) -> Response:
    return json_response(await reports.clear_flag(require_admin(request), worker_id))


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    return Response(generate_latest(queen(request).metrics.registry),
                    media_type=CONTENT_TYPE_LATEST)
