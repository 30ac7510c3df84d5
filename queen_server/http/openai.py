"""The OpenAI-compatible HTTP API: chat completions, embeddings, models, and health.

Routes take the raw ``Request`` and validate bodies themselves (one pydantic pass, no FastAPI
body machinery on the hot path); the request schemas are still published in the OpenAPI spec.
"""

from __future__ import annotations

import functools
import secrets
import time
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from queen_server import __version__
from queen_server.billing.service import Billing, Hold, Principal
from queen_server.http.deps import json_response, queen
from queen_server.http.fastpath import HotRoutes
from queen_server.http.io import ClientGone, DisconnectGuard, parse, read_body
from queen_server.http.sse import stream_chat
from queen_server.swarm.admission import Admission
from queen_server.swarm.jobs import EMBEDDINGS_JOB
from queen_server.swarm.metering import Meter, content_text
from queen_server.swarm.relay import CompletionContext, Delivered, assemble_chat, collect
from shared_schema import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    EmbeddingRequest,
    EmbeddingResponse,
    ErrorResponse,
    ModelAvailability,
    ModelCard,
    ModelList,
    ModelPrice,
)
from shared_schema.answers import embeddings_answer

if TYPE_CHECKING:
    from queen_server.runtime import QueenState

router = APIRouter()
hot = HotRoutes()  # the billed routes, served by the fast path

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": text}
    for status, text in {
        400: "Invalid request",
        401: "Missing or wrong API key",
        404: "No connected worker serves the model",
        413: "Request body too large",
        429: "Too many requests of this caller in flight or queued; retry after Retry-After",
        502: "The worker failed",
        503: "No capacity; retry after the Retry-After header",
        504: "The worker timed out",
    }.items()
}


def caller_of(request: Request, principal: Principal) -> str:
    """Whom the per-caller limits count a request against: a key by its id, a development key
    by its hash (each its own caller), anyone else (open access) by the client's address."""
    if principal.key is not None:
        return f"key:{principal.key.id}"
    if principal.digest is not None:  # hashed once, when the key was checked
        return "dev:" + principal.digest
    return "addr:" + (request.client.host if request.client is not None else "unknown")


async def settle(billing: Billing, hold: Hold | None, admission: Admission,
                 **kwargs: Any) -> None:
    """``Billing.finish`` for a streamed answer, which also gives back the caller's place:
    the stream calls it at the answer's end and again (a no-op) when it closes."""
    try:
        await billing.finish(hold, **kwargs)
    finally:
        admission.leave()


async def admit_and_hold(state: QueenState, request: Request, principal: Principal, job_id: str,
                         model: str, *hold_args: Any, **hold_kwargs: Any,
                         ) -> tuple[Admission, Hold | None]:
    """Count the request against its caller (429 past the limits) before reserving anything,
    then price the model and reserve its money; a refused hold gives the place back."""
    admission = state.dispatcher.admit(caller_of(request, principal))
    try:
        if principal.billed:  # priced by the queen's own reading of the model, once it has one
            await state.catalog.settle(model)
        price = state.price_of(model)
        return admission, await state.billing.hold(principal, job_id, price, *hold_args,
                                                   **hold_kwargs)
    except BaseException:
        admission.leave()
        raise


def body_schema(name: str) -> dict[str, Any]:
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}},
        }
    }


@hot.post(
    "/v1/chat/completions",
    summary="Create a chat completion (plain, or streamed as server-sent events)",
    openapi_extra=body_schema("ChatCompletionRequest"),
    responses={
        200: {
            "model": ChatCompletion,
            "content": {"text/event-stream": {"schema": {"$ref": "#/components/schemas/"
                                                                "ChatCompletionChunk"}}},
        },
        **ERRORS,
    },
)
async def chat_completions(request: Request) -> Response:
    state = queen(request)
    principal = await state.billing.authenticate(request.headers.get("authorization"))
    req = parse(ChatCompletionRequest, await read_body(request, state.settings.max_body_bytes))
    openai_req = req.model_dump(mode="json", exclude_unset=True)
    completion_id = "chatcmpl-" + secrets.token_hex(12)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    ctx = CompletionContext(completion_id, req.model, int(time.time()), include_usage)
    dispatcher, billing = state.dispatcher, state.billing
    dispatcher.require_servable(req.model)
    meter = Meter.for_chat(openai_req, state.settings.template_allowance_tokens)
    answer = Delivered(meter)
    admission, hold = await admit_and_hold(
        state, request, principal, completion_id, req.model,
        [content_text(m.content) for m in req.messages], openai_req)
    if "max_tokens" not in openai_req and "max_completion_tokens" not in openai_req:
        # Unbilled (billed ones got theirs from the hold): the worker stops where the queen's
        # budget for the answer ends, rather than running on into a failed job.
        openai_req["max_tokens"] = state.settings.default_max_tokens
    streaming = False
    try:
        async with DisconnectGuard(request):
            run = await dispatcher.start(
                completion_id, req.model, "/v1/chat/completions", openai_req, stream=req.stream,
                billed=principal.billed, admission=admission, sent=answer.sent,
            )
            if req.stream:  # the stream now owns the hold and the caller's place
                body = stream_chat(run, ctx, dispatcher,
                                   functools.partial(settle, billing, hold, admission), meter)
                hold, streaming = None, True
                return StreamingResponse(body, media_type="text/event-stream",
                                         headers=SSE_HEADERS)
            collected = await collect(run, dispatcher, meter, answer)
    except ClientGone:
        # A client that leaves pays for what the swarm did for it: the prompt a worker read
        # and the tokens it made (nothing if no worker had started).
        left = answer.broken(answer.serving, client_left=True) if answer.started else None
        await billing.finish(hold, parts=left)
        return Response(status_code=499)
    except BaseException:
        await billing.finish(hold)  # a failed job is charged nothing
        raise
    finally:
        if not streaming:
            admission.leave()
    await billing.finish(hold, parts=collected.parts)
    return json_response(assemble_chat(ctx, collected))


@hot.post(
    "/v1/embeddings",
    summary="Create embeddings: one mean-pooled vector per input",
    openapi_extra=body_schema("EmbeddingRequest"),
    responses={200: {"model": EmbeddingResponse}, **ERRORS},
)
async def embeddings(request: Request) -> Response:
    state = queen(request)
    principal = await state.billing.authenticate(request.headers.get("authorization"))
    req = parse(EmbeddingRequest, await read_body(request, state.settings.max_body_bytes))
    openai_req = req.model_dump(mode="json", exclude_unset=True)
    openai_req["encoding_format"] = "float"  # workers send floats; the queen encodes base64
    job_id = EMBEDDINGS_JOB + secrets.token_hex(12)
    billing = state.billing
    state.dispatcher.require_servable(req.model)
    inputs = [req.input] if isinstance(req.input, str) else req.input
    admission, hold = await admit_and_hold(
        state, request, principal, job_id, req.model,
        [item if isinstance(item, str) else " " * len(str(item)) for item in inputs], openai_req,
        completion_limit=None)
    try:
        async with DisconnectGuard(request):
            run = await state.dispatcher.start(
                job_id, req.model, "/v1/embeddings", openai_req, stream=False,
                billed=principal.billed, admission=admission,
            )
            collected = await collect(run, state.dispatcher, Meter.for_embeddings(openai_req))
    except ClientGone:
        await billing.finish(hold)
        return Response(status_code=499)
    except BaseException:
        await billing.finish(hold)
        raise
    finally:
        admission.leave()
    await billing.finish(hold, parts=collected.parts)
    return json_response(embeddings_answer(collected.result, req.model, req.encoding_format,
                                           collected.usage))


@router.get("/v1/models", response_model=ModelList, summary="Models the connected workers hold")
async def list_models(request: Request) -> Response:
    state = queen(request)
    await state.billing.authenticate(request.headers.get("authorization"))
    registry = state.registry
    cards = []
    for name in registry.model_names():
        holders = registry.holders(name)
        price = state.price_of(name)
        facts = state.catalog.facts(name)
        cards.append(
            ModelCard(
                id=name,
                created=int(min(session.connected_at for session in holders)),
                apiary=ModelAvailability(
                    workers=len(holders),
                    loaded_on=sum(1 for session in holders if name in session.loaded),
                    parameter_count=facts.parameter_count if facts is not None else None,
                    size_bytes=facts.size_bytes if facts is not None else None,
                    sha256=facts.sha256 if facts is not None else None,
                    verified=facts is not None,
                    price=ModelPrice(
                        size_class=price.size_class,
                        prompt_msat_per_1k=price.prompt_msat_per_1k,
                        completion_msat_per_1k=price.completion_msat_per_1k,
                    ),
                ),
            )
        )
    return json_response(ModelList(data=cards).model_dump(mode="json"))


@router.get("/health", summary="Liveness and a one-line view of the swarm")
async def health(request: Request) -> dict[str, Any]:
    state = queen(request)
    registry = state.registry
    return {
        "status": "ok",
        "version": __version__,
        "workers": len(registry),
        "job_slots": sum(session.max_jobs for session in registry),
        "jobs_running": sum(len(session.jobs) for session in registry),
        "jobs_queued": registry.waiting,
        "models": registry.model_names(),
    }


SCHEMAS = (ChatCompletionRequest, ChatCompletionChunk, EmbeddingRequest)
