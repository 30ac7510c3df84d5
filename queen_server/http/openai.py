"""The OpenAI-compatible HTTP API: chat and text completions, responses, embeddings, models
(with the caller's own fine-tuned models, which only their owner lists, retrieves and deletes).

Routes take the raw ``Request`` and validate bodies themselves (one pydantic pass, no FastAPI
body machinery on the hot path); the request schemas are still published in the OpenAPI spec.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel

from queen_server import __version__
from queen_server.billing.service import Principal
from queen_server.errors import InvalidRequest, ModelNotFound
from queen_server.http.deps import json_response, queen
from queen_server.http.fastpath import HotRoutes
from queen_server.http.files import owner_of
from queen_server.http.generation import Generation, admit_and_hold, fine_tuned, serve
from queen_server.http.io import ClientGone, DisconnectGuard, parse, read_body
from queen_server.shaping.chat import ChatShaper
from queen_server.shaping.completions import (
    CompletionShaper,
    echo_problem,
    prompt_texts,
    worker_request,
)
from queen_server.shaping.requests import chat_job
from queen_server.shaping.responses import ResponsesShaper, chat_request
from queen_server.shaping.view import ChatView
from queen_server.swarm.jobs import EMBEDDINGS_JOB
from queen_server.swarm.metering import Meter, content_text
from queen_server.swarm.relay import collect
from shared_schema import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    EmbeddingResponse,
    ErrorResponse,
    ModelAvailability,
    ModelCard,
    ModelList,
    capabilities,
)
from shared_schema.answers import AnswerStamp, embeddings_answer
from shared_schema.openai_fields import CHAT, COMPLETIONS, EMBEDDINGS, RESPONSES, FieldRule
from shared_schema.responses import ResponsesRequest

if TYPE_CHECKING:
    from queen_server.finetune.models import FineTunedModel
    from queen_server.runtime import QueenState

M = TypeVar("M", bound=BaseModel)


class ModelDeleted(BaseModel):
    """OpenAI's answer to deleting a (fine-tuned) model."""

    id: str
    object: Literal["model"] = "model"
    deleted: bool = True


router = APIRouter()
hot = HotRoutes()  # the billed routes, served by the fast path

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


async def read_request(request: Request, model: type[M], fields: Mapping[str, FieldRule]
                       ) -> tuple[QueenState, Principal, M]:
    """What every OpenAI route starts with: the queen, the caller (a 401 before the body is
    read) and the body, parsed against its endpoint's field list (``openai_fields``)."""
    state = queen(request)
    principal = await state.billing.authenticate(request.headers.get("authorization"))
    return state, principal, parse(model, await read_body(request, state.settings.max_body_bytes),
                                   fields)


def body_schema(name: str) -> dict[str, Any]:
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}},
        }
    }


def _streamed(answer: type[Any], chunk: str) -> dict[int | str, dict[str, Any]]:
    return {
        200: {"model": answer,
              "content": {"text/event-stream": {"schema": {"$ref": "#/components/schemas/"
                                                                  f"{chunk}"}}}},
        **ERRORS,
    }


@hot.post(
    "/v1/chat/completions",
    summary="Create a chat completion (plain, or streamed as server-sent events)",
    openapi_extra=body_schema("ChatCompletionRequest"),
    responses=_streamed(ChatCompletion, "ChatCompletionChunk"),
)
async def chat_completions(request: Request) -> Response:
    state, principal, req = await read_request(request, ChatCompletionRequest, CHAT)
    completion_id = "chatcmpl-" + secrets.token_hex(12)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    stamp = AnswerStamp(completion_id, req.model, int(time.time()))
    return await serve(state, request, principal, chat_generation(
        state, req, completion_id, ChatView(stamp, ChatShaper(include_usage, stamp))))


def chat_generation(state: QueenState, req: ChatCompletionRequest, job_id: str,
                    view: ChatView) -> Generation:
    """A chat request's generation (the Responses API's too): its worker job, with tools
    planned into the view."""
    job, tool_plan = chat_job(req)
    view.tools = tool_plan
    return Generation(
        job_id, req.model, "/v1/chat/completions", job, req.stream,
        Meter.for_chat(job, state.settings.template_allowance_tokens),
        [content_text(message.get("content")) for message in job["messages"]], view)


@hot.post(
    "/v1/completions",
    summary="Create a text completion: the raw prompt, continued (plain or streamed)",
    openapi_extra=body_schema("CompletionRequest"),
    responses=_streamed(dict, "CompletionRequest"),
)
async def completions(request: Request) -> Response:
    state, principal, req = await read_request(request, CompletionRequest, COMPLETIONS)
    problem = echo_problem(req)
    if problem is not None:
        raise InvalidRequest(problem, param="echo", code="unsupported_parameter")
    completion_id = "cmpl-" + secrets.token_hex(12)
    created = int(time.time())
    job = worker_request(req)
    view = ChatView(AnswerStamp(completion_id, req.model, created),
                    CompletionShaper(req, completion_id, created, req.model))
    return await serve(state, request, principal, Generation(
        completion_id, req.model, "/v1/completions", job, req.stream,
        Meter.for_completions(job, state.settings.template_allowance_tokens),
        prompt_texts(req), view))


@hot.post(
    "/v1/responses",
    summary="Create a model response (the Responses API: text or messages in, plain or as "
            "response.* events)",
    openapi_extra=body_schema("ResponsesRequest"),
    responses={200: {"description": "A response object, or its events"}, **ERRORS},
)
async def responses(request: Request) -> Response:
    state, principal, req = await read_request(request, ResponsesRequest, RESPONSES)
    response_id = "resp_" + secrets.token_hex(12)
    created = int(time.time())
    stamp = AnswerStamp("chatcmpl-" + secrets.token_hex(12), req.model, created)
    view = ChatView(stamp, ResponsesShaper(req, response_id, created))
    return await serve(state, request, principal,
                       chat_generation(state, chat_request(req), response_id, view))


@hot.post(
    "/v1/embeddings",
    summary="Create embeddings: one mean-pooled vector per input",
    openapi_extra=body_schema("EmbeddingRequest"),
    responses={200: {"model": EmbeddingResponse}, **ERRORS},
)
async def embeddings(request: Request) -> Response:
    state, principal, req = await read_request(request, EmbeddingRequest, EMBEDDINGS)
    openai_req = req.model_dump(mode="json", exclude_unset=True)
    openai_req.pop("user", None)
    openai_req["encoding_format"] = "float"  # workers send floats; the queen encodes base64
    job_id = EMBEDDINGS_JOB + secrets.token_hex(12)
    billing = state.billing
    needs = capabilities.needs("/v1/embeddings", openai_req)
    state.dispatcher.require_servable(req.model, needs)
    if req.token_ids:
        ids = req.input if isinstance(req.input[0], list) else [req.input]  # type: ignore[index]
        texts = [" " * len(item) for item in ids]  # type: ignore[arg-type]
    else:
        texts = [req.input] if isinstance(req.input, str) else list(req.input)  # type: ignore[arg-type]
    admission, hold = await admit_and_hold(
        state, request, principal, job_id, req.model, texts, openai_req, completion_limit=None)
    try:
        async with DisconnectGuard(request):
            run = await state.dispatcher.start(
                job_id, req.model, "/v1/embeddings", openai_req, stream=False,
                billed=principal.billed, admission=admission, needs=needs,
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


@router.get("/v1/models", response_model=ModelList,
            summary="Models the connected workers hold, and the caller's fine-tuned models")
async def list_models(request: Request) -> Response:
    state = queen(request)
    principal = await state.billing.authenticate(request.headers.get("authorization"))
    names = state.registry.model_names()
    cards = [model_card(state, name) for name in names]
    listed = set(names)
    for row in state.placement.placements():  # a row per worker fetching: one card per model
        if row["model"] not in listed:
            listed.add(str(row["model"]))
            cards.append(loading_card(state, row))
    if state.fine_tuning is not None:  # the caller's own, and no one else's
        cards.extend(fine_tuned_card(state, model)
                     for model in state.fine_tuning.models.owned(owner_of(principal)))
    return json_response(ModelList(data=cards).model_dump(mode="json"))


@router.get("/v1/models/{model_id:path}", response_model=ModelCard,
            summary="One model the connected workers hold, or a fine-tuned model of the caller's",
            responses={404: {"model": ErrorResponse, "description": "No worker holds it"}})
async def retrieve_model(request: Request, model_id: str) -> Response:
    state = queen(request)
    principal = await state.billing.authenticate(request.headers.get("authorization"))
    tuned = await fine_tuned(state, principal, model_id)  # another's: 404, as none
    if tuned is not None:
        return json_response(fine_tuned_card(state, tuned).model_dump(mode="json"))
    if not state.registry.holders(model_id):
        for row in state.placement.placements():
            if row["model"] == model_id:
                return json_response(loading_card(state, row).model_dump(mode="json"))
        raise ModelNotFound(f"The model '{model_id}' is not served by any connected worker.",
                            param="model")
    return json_response(model_card(state, model_id).model_dump(mode="json"))


@router.delete("/v1/models/{model_id:path}", response_model=ModelDeleted,
               summary="Delete a fine-tuned model of the caller's (no longer served or listed)",
               responses={404: {"model": ErrorResponse,
                                "description": "No fine-tuned model of the caller's"}})
async def delete_model(request: Request, model_id: str) -> Response:
    state = queen(request)
    principal = await state.billing.authenticate(request.headers.get("authorization"))
    deleted = None
    if state.fine_tuning is not None and model_id.startswith("ft:"):
        deleted = await state.fine_tuning.models.delete(owner_of(principal), model_id)
    if deleted is None:  # another's, a base model, none: the same answer
        raise ModelNotFound(f"The model '{model_id}' does not exist or you do not have access "
                            "to it.", param="model")
    return json_response(ModelDeleted(id=deleted.name).model_dump(mode="json"))


def fine_tuned_card(state: QueenState, model: FineTunedModel) -> ModelCard:
    """A fine-tuned model's card: its owner, and its base's availability to it (holders with
    the ``lora`` capability) and price (it is billed as its base). Its answers are audited
    with base plus adapter when its base's are (``audited``: the base is pinned and audits
    are on)."""
    card = model_card(state, model.base)
    assert card.apiary is not None
    holders = [session for session in state.registry.holders(model.base)
               if capabilities.LORA in session.capabilities]
    card.apiary.workers = len(holders)
    card.apiary.loaded_on = sum(1 for session in holders if model.base in session.loaded)
    return ModelCard(id=model.name, created=model.created, owned_by=model.owner,
                     apiary=card.apiary)


def loading_card(state: QueenState, row: dict[str, Any]) -> ModelCard:
    """A model being placed on a worker: its card says so, with the download's progress."""
    name = str(row["model"])
    card = model_card(state, name)
    assert card.apiary is not None
    card.apiary.status = "loading"
    progress = row.get("progress")
    card.apiary.progress = float(progress) if isinstance(progress, int | float) else None
    estimate = row.get("estimated_time")
    card.apiary.estimated_time = float(estimate) if isinstance(estimate, int | float) else None
    return card


def model_card(state: QueenState, name: str) -> ModelCard:
    """A model's card: who holds it now, its size as the queen read it, and its price."""
    holders = state.registry.holders(name)
    price = state.model_price(name)
    catalog = state.catalog
    facts = catalog.facts(name)  # the pin: the one reading routing, price and audits use
    verified = catalog.verified(name)
    return ModelCard(
        id=name,
        created=int(min((session.connected_at for session in holders), default=time.time())),
        apiary=ModelAvailability(
            workers=len(holders),
            loaded_on=sum(1 for session in holders if name in session.loaded),
            parameter_count=facts.parameter_count if facts is not None else None,
            size_bytes=facts.size_bytes if facts is not None else None,
            sha256=facts.sha256 if facts is not None else None,
            verified=verified,
            audited=verified and state.audits.enabled,
            price=price,
            kind="image" if state.registry.image_holders(name) else "text",
        ),
    )


@router.get("/health", summary="Liveness and a one-line view of the swarm")
async def health(request: Request) -> dict[str, Any]:
    state = queen(request)
    registry = state.registry
    answer: dict[str, Any] = {
        "status": "ok",
        "version": __version__,
        "workers": len(registry),
        "job_slots": sum(session.max_jobs for session in registry),
        "jobs_running": sum(len(session.jobs) for session in registry),
        "jobs_queued": registry.waiting,
        "models": registry.model_names(),
    }
    if state.replicas is not None:  # this replica's figures above; the whole swarm's here
        answer["replica"] = state.replicas.replica_id
        try:
            answer["swarm"] = state.replicas.swarm()
        except Exception as exc:  # the shared Redis is down: this replica still answers
            answer["swarm"] = {"error": f"the replicas' directory is unreachable: {exc}"}
    return answer


SCHEMAS = (ChatCompletionRequest, ChatCompletionChunk, CompletionRequest, EmbeddingRequest,
           ResponsesRequest)
