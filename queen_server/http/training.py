"""A training attempt's transfers, the worker's side of HTTP (issue 37): ``GET`` its training
data and the checkpoint it resumes from, ``PUT`` its checkpoints and adapter, each at the path
its ``TrainOrder`` names (``finetune.orders``) and only with that attempt's ``Authorization:
Bearer <token>``; and a fine-tuned model's adapter, to a worker given a job for it
(``finetune.models``). Errors are OpenAI's shape. The work is in
``queen_server.finetune.transfers``.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from queen_server.finetune.models import ADAPTER_ROUTE
from queen_server.finetune.orders import ROUTE
from queen_server.finetune.transfers import Outgoing, Transfers
from queen_server.http.deps import json_response, queen
from queen_server.http.fine_tuning import FineTuningUnavailable
from shared_schema import ErrorResponse

router = APIRouter()


def _error(description: str) -> dict[str, Any]:
    return {"model": ErrorResponse, "description": description}


REFUSED = {401: _error("Not this running attempt's token")}


def transfers(request: Request) -> Transfers:
    service = queen(request).fine_tuning
    if service is None:
        raise FineTuningUnavailable("This queen runs without a database and runs no "
                                    "fine-tuning jobs.")
    return service.transfers


def _send(out: Outgoing) -> Response:
    return StreamingResponse(out.body, media_type="application/octet-stream",
                             headers={"Content-Length": str(out.size_bytes),
                                      "X-Apiary-Sha256": out.sha256})


@router.get(f"{ROUTE}/{{wire_id}}/data", include_in_schema=False, responses=REFUSED)
async def training_data(request: Request, wire_id: str) -> Response:
    return _send(await transfers(request).data(wire_id, request.headers.get("authorization")))


@router.get(f"{ROUTE}/{{wire_id}}/resume", include_in_schema=False, responses=REFUSED)
async def resume_checkpoint(request: Request, wire_id: str) -> Response:
    return _send(await transfers(request).resume(wire_id,
                                                 request.headers.get("authorization")))


@router.put(f"{ROUTE}/{{wire_id}}/upload/{{name}}", include_in_schema=False,
            responses={**REFUSED, 400: _error("Not an upload name a training job makes"),
                       413: _error("Over the attempt's upload limit; nothing was kept")})
async def upload(request: Request, wire_id: str, name: str) -> Response:
    declared = request.headers.get("content-length")
    received = await transfers(request).upload(
        wire_id, request.headers.get("authorization"), name, request.stream(),
        int(declared) if declared is not None and declared.isdigit() else None)
    return json_response({"name": received.name, "sha256": received.sha256,
                          "size_bytes": received.size_bytes})


@router.get(f"{ADAPTER_ROUTE}/{{job_id}}/{{worker_key}}", include_in_schema=False,
            responses={401: _error("Not the token a job for this model gave this worker, or "
                                   "the model was deleted")})
async def adapter(request: Request, job_id: str, worker_key: str) -> Response:
    """A fine-tuned model's LoRA adapter, for a worker serving it (``finetune.models``)."""
    return _send(await transfers(request).adapter(job_id, worker_key,
                                                  request.headers.get("authorization")))
