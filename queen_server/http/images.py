"""Image generation over HTTP (issue 38): ``POST /v1/images/generations`` as OpenAI answers it,
and ``GET /v1/images/files/{name}``, the images of ``url`` answers while they are kept.

A request is checked whole before anything runs (``ImageGenerationRequest``: a field the queen
does not honour is a 400 naming it), resolved into the order a worker renders
(``images.orders``), held at its price (402 when the key cannot pay), and sent to a worker with
the ``image`` capability that holds the model as a diffusion model. A hub name no worker holds is
placed on an image worker first (``PlacementService.prepare(kind="image")``), with the same
waits, ``model_loading`` answers and limits as a text model's. What the worker sends back is
checked image by image (``images.delivery``) before the client sees it: a worker whose images are
not what the order asked for is passed over and the order goes to another. The client pays the
queen's own count (``image_tokens``), and the worker that delivered is credited for it.
"""

from __future__ import annotations

import base64
import logging
import secrets
import time
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from queen_server.billing.service import Principal
from queen_server.errors import ApiError, InvalidRequest, ModelNotFound, WorkerFailed
from queen_server.http.deps import json_response, queen
from queen_server.http.generation import admit_and_hold, price_hold
from queen_server.http.io import ClientGone, DisconnectGuard, parse, read_body
from queen_server.images.delivery import BadDelivery, check_delivery
from queen_server.images.links import LINK_PREFIX
from queen_server.images.orders import ImageMeter, image_tokens, images_answer, order_of
from queen_server.swarm.admission import Admission
from queen_server.swarm.jobs import IMAGES_JOB, Part
from queen_server.swarm.relay import Collected, collect
from shared_schema import ErrorResponse
from shared_schema.capabilities import IMAGE
from shared_schema.images import IMAGES_URL, ImageGenerationRequest, ImageOrder
from shared_schema.openai_fields import IMAGES

if TYPE_CHECKING:
    from queen_server.runtime import QueenState

log = logging.getLogger(__name__)

# Workers whose images were not what the order asked for, passed over before the request fails.
MAX_BAD_DELIVERIES = 2

router = APIRouter()


class ImageNotFound(ApiError):
    status_code = 404
    error_type = "invalid_request_error"
    code = "image_not_found"


@router.post(
    "/v1/images/generations",
    summary="Create images from a prompt (stable-diffusion.cpp workers)",
    openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": "#/components/schemas/ImageGenerationRequest"}}}}},
    responses={400: {"model": ErrorResponse}, 402: {"model": ErrorResponse},
               404: {"model": ErrorResponse}},
)
async def generate_images(request: Request) -> Response:
    state = queen(request)
    principal = await state.billing.authenticate(request.headers.get("authorization"))
    req = parse(ImageGenerationRequest,
                await read_body(request, state.settings.max_body_bytes), IMAGES)
    if req.response_format == "url" and state.image_links is None:
        raise InvalidRequest("This queen keeps no images (it runs without a database): ask for "
                             "response_format b64_json.", param="response_format")
    order = order_of(req, lambda upper: secrets.randbelow(upper + 1))
    tokens = image_tokens(order, state.settings.image_tokens_per_megapixel_step)
    needs = {IMAGE: "model"}
    arrived = time.monotonic()
    placing = await to_place(state, req.model, needs)
    job_id = IMAGES_JOB + secrets.token_hex(12)
    billing = state.billing
    # As for text: the caller is counted and its money held before the hub is read for it.
    admission, hold = await admit_and_hold(state, request, principal, job_id, req.model, [],
                                           {"max_tokens": tokens}, completion_limit="max_tokens",
                                           read=not placing)
    if placing:
        try:
            await state.placement.prepare(req.model, admission.caller, kind="image")
            state.dispatcher.require_servable(req.model, needs)
            await price_hold(state, principal, hold, req.model)
        except BaseException:  # not placed (or not yet: model_loading): nothing is charged
            await billing.finish(hold)
            admission.leave()
            raise
    try:
        async with DisconnectGuard(request):
            images, collected = await render(state, job_id, order, principal, admission, tokens,
                                             arrived)
            data = await answer_data(state, order, images, req.response_format,
                                     link_base(state, request))
    except ClientGone:
        await billing.finish(hold)
        return Response(status_code=499)
    except BaseException:
        await billing.finish(hold)  # nothing delivered: nothing charged
        raise
    finally:
        admission.leave()
    credit = collected.answer.serving
    await billing.finish(hold, parts=[Part(credit.key, 0, tokens, shares=credit.shares)])
    if state.image_audits is not None and credit.key is not None:
        # a drawn job is rendered again by another worker (its earnings key is its own key)
        state.image_audits.consider(job_id, order, credit.key, images,
                                    hold.key_id if hold is not None else None,
                                    hold.charged_msat if hold is not None else 0)
    return json_response(images_answer(int(time.time()), order, req.quality, data, tokens))


async def to_place(state: QueenState, model: str, needs: dict[str, str]) -> bool:
    """Whether ``model`` is to be placed on an image worker first: no connected worker holds
    it (nor another replica's), and the queen places models on demand. A 404 when it is
    neither served nor placeable; a 400 when its holders hold it as a text model."""
    try:
        state.dispatcher.require_servable(model, needs)
    except ModelNotFound:
        if await state.dispatcher.served_elsewhere(model) or not state.placement.placeable(model):
            raise
        return True
    return False


async def render(state: QueenState, job_id: str, order: ImageOrder, principal: Principal,
                 admission: Admission, tokens: int, arrived: float
                 ) -> tuple[list[bytes], Collected]:
    """The order's images from the first worker whose delivery holds up, with what
    ``collect`` gathered of it; a worker that fails is retried elsewhere by the dispatcher, and
    one whose images are not what the order asked for is passed over here. How long the
    request waited for its first worker is the model's demand (``PlacementService.started``:
    one that keeps finding every holder busy gets another copy placed)."""
    passed_over: set[str] = set()
    body = order.model_dump(mode="json")
    for _ in range(MAX_BAD_DELIVERIES + 1):
        try:
            run = await state.dispatcher.start(
                job_id, order.model, IMAGES_URL, body, stream=False, billed=principal.billed,
                admission=admission, needs={IMAGE: "model"}, exclude=passed_over)
        except ApiError as exc:
            if not passed_over:
                raise
            raise bad_images() from exc
        if not passed_over:
            state.placement.started(order.model, time.monotonic() - arrived)
        worker = run.worker
        collected = await collect(run, state.dispatcher, ImageMeter(0, 0, 0, tokens))
        try:
            return check_delivery(order, collected.result.data), collected
        except BadDelivery as exc:
            log.warning("images of job %s from %s refused: %s", job_id, worker.public_id, exc)
            passed_over.add(worker.key)
    raise bad_images()


def bad_images() -> WorkerFailed:
    return WorkerFailed("The workers serving this model delivered images that were not what "
                        "the request asked for; try again later.", code="invalid_images")


async def answer_data(state: QueenState, order: ImageOrder, images: list[bytes],
                      response_format: str, base: str) -> list[dict[str, Any]]:
    """Each image as the client asked for it: base64, or a link the queen serves while it
    keeps the image."""
    if response_format == "b64_json":
        return [{"b64_json": base64.b64encode(image).decode("ascii")} for image in images]
    links = state.image_links
    assert links is not None
    return [{"url": base + await links.keep(image, order.output_format)} for image in images]


def link_base(state: QueenState, request: Request) -> str:
    """Where clients reach this queen, for the links of ``url`` answers: its first
    ``public_url``, else the origin the request came to."""
    public = state.settings.public_url
    return (public[0] if public else str(request.base_url)).rstrip("/")


@router.get(
    LINK_PREFIX + "{name}",
    summary="An image of a url answer, while the queen keeps it",
    responses={200: {"content": {"image/png": {}, "image/jpeg": {}, "image/webp": {}}},
               404: {"model": ErrorResponse}},
)
async def image_file(request: Request, name: str) -> Response:
    links = queen(request).image_links
    kept = await links.open(name) if links is not None else None
    if kept is None:
        raise ImageNotFound("This image does not exist or is no longer kept (images of url "
                            "answers are kept for a limited time).", param=None)
    return Response(kept.data, media_type=kept.media_type,
                    headers={"Cache-Control": "private, max-age=3600"})
