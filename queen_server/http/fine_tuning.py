"""OpenAI's fine-tuning jobs API (issue 37): ``POST /v1/fine_tuning/jobs``, the caller's list,
one job, ``/cancel``, ``/events`` and ``/checkpoints``, as the official SDK calls them (its
``jobs.create``, ``list``, ``retrieve``, ``cancel``, ``list_events``, ``checkpoints.list``).

A job belongs to the caller that made it (``files.owner_of``: a key by its id): another's answers
404, as a missing one does. The work is in ``queen_server.finetune``.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from queen_server.billing.service import Principal
from queen_server.errors import ApiError
from queen_server.finetune.service import FineTuning
from queen_server.http.deps import json_response, queen
from queen_server.http.files import owner_of
from queen_server.http.io import parse as parse_body
from queen_server.http.io import read_body
from shared_schema import ErrorResponse
from shared_schema.finetune import FineTuningJob, FineTuningJobCreate, Page
from shared_schema.openai_fields import FINE_TUNING_JOBS

router = APIRouter()

MAX_PAGE = 100


class FineTuningUnavailable(ApiError):
    """The queen runs without a database, so it keeps no files and runs no fine-tuning."""

    status_code = 503
    error_type = "server_error"
    code = "fine_tuning_unavailable"


def _error(description: str) -> dict[str, Any]:
    return {"model": ErrorResponse, "description": description}


NOT_FOUND = {404: _error("No fine-tuning job with this id belongs to the caller")}


async def caller(request: Request) -> tuple[FineTuning, Principal, str]:
    """The queen's fine-tuning, the caller and its owner name (a 401 before anything else)."""
    state = queen(request)
    principal = await state.billing.authenticate(request.headers.get("authorization"))
    if state.fine_tuning is None:
        raise FineTuningUnavailable("This queen runs without a database and runs no "
                                    "fine-tuning jobs.")
    return state.fine_tuning, principal, owner_of(principal)


def _page(items: list[Any], has_more: bool) -> Response:
    return json_response(Page(data=[item.model_dump(mode="json") for item in items],
                              has_more=has_more).model_dump(mode="json"))


@router.post("/v1/fine_tuning/jobs", response_model=FineTuningJob,
             summary="Fine-tune a model on one of the caller's files (held up front)",
             responses={400: _error("A bad field, file or model, named by param"),
                        402: _error("The caller's balance cannot cover the job's bound")})
async def create_job(request: Request) -> Response:
    service, principal, owner = await caller(request)
    body = parse_body(FineTuningJobCreate,
                      await read_body(request, service.settings.max_body_bytes),
                      FINE_TUNING_JOBS)
    job = await service.create(principal, owner, body)
    return json_response(job.model_dump(mode="json"))


@router.get("/v1/fine_tuning/jobs", summary="The caller's fine-tuning jobs, newest first")
async def list_jobs(request: Request, after: str | None = None,
                    limit: int = Query(20, ge=1, le=MAX_PAGE)) -> Response:
    service, _, owner = await caller(request)
    jobs, has_more = await service.page(owner, after=after, limit=limit)
    return _page(jobs, has_more)


@router.get("/v1/fine_tuning/jobs/{job_id}", response_model=FineTuningJob,
            summary="One of the caller's fine-tuning jobs", responses=NOT_FOUND)
async def retrieve_job(request: Request, job_id: str) -> Response:
    service, _, owner = await caller(request)
    return json_response((await service.get(owner, job_id)).model_dump(mode="json"))


@router.post("/v1/fine_tuning/jobs/{job_id}/cancel", response_model=FineTuningJob,
             summary="Cancel a job (charged what was trained until then)",
             responses={**NOT_FOUND, 400: _error("The job has already finished")})
async def cancel_job(request: Request, job_id: str) -> Response:
    service, _, owner = await caller(request)
    return json_response((await service.cancel(owner, job_id)).model_dump(mode="json"))


@router.get("/v1/fine_tuning/jobs/{job_id}/events", summary="A job's events, newest first",
            responses=NOT_FOUND)
async def job_events(request: Request, job_id: str, after: str | None = None,
                     limit: int = Query(20, ge=1, le=MAX_PAGE)) -> Response:
    service, _, owner = await caller(request)
    events, has_more = await service.events(owner, job_id, after=after, limit=limit)
    return _page(events, has_more)


@router.get("/v1/fine_tuning/jobs/{job_id}/checkpoints",
            summary="A job's checkpoints, newest first", responses=NOT_FOUND)
async def job_checkpoints(request: Request, job_id: str, after: str | None = None,
                          limit: int = Query(10, ge=1, le=MAX_PAGE)) -> Response:
    service, _, owner = await caller(request)
    checkpoints, has_more = await service.checkpoints(owner, job_id, after=after, limit=limit)
    return _page(checkpoints, has_more)
