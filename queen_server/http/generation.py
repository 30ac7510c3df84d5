"""Serving one generation request, whichever API it came by: chat, text completions, Responses.

Every route turns its request into a ``Generation``: the job a worker gets (chat-shaped, see
``shaping.requests``), the bounds of its bill (``Meter``), and the ``ChatView`` that shapes the
answer for the client. ``serve`` then does what every billed answer needs: refuse early what no
connected worker can honour, count the caller and hold the money, place a model no worker holds
(only then: the hub is read and a volunteer downloads for callers that may and can pay), price
the hold by the model's reading, dispatch to a capable worker, relay (streamed or whole, with
failover), and settle the books exactly once.

Every job carries its caller's prompt-cache scope (``swarm.prefix``), and a chat's next turn is
offered first to the worker that served its last one (it holds the conversation's prefix).

A fine-tuned model (``ft:``, issue 37) is the caller's own or a 404 like a name nobody made
(``finetune.models``): it is routed, priced, placed and counted in the stats as its base, only to
this replica's workers with the ``lora`` capability, and its job keeps the ``ft:`` name and
carries the adapter (``Job.adapter``). Its answers are audited with base plus adapter
(``audits``: a ``lora`` holder of the base re-scores them).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from queen_server.billing.pricing import Price
from queen_server.billing.service import Billing, Hold, Principal
from queen_server.errors import ModelNotFound
from queen_server.http.auditing import consider_audit
from queen_server.http.deps import json_response
from queen_server.http.files import owner_of
from queen_server.http.io import ClientGone, DisconnectGuard
from queen_server.http.sse import stream_answer
from queen_server.shaping.view import ChatView
from queen_server.swarm.admission import Admission
from queen_server.swarm.jobs import choices_in
from queen_server.swarm.metering import Meter
from queen_server.swarm.relay import Delivered, assemble_chat, collect, message_text
from queen_server.swarm.runs import JobRun
from shared_schema import Result, capabilities
from shared_schema.capabilities import LORA

if TYPE_CHECKING:
    from collections.abc import Mapping

    from queen_server.finetune.models import FineTunedModel
    from queen_server.runtime import QueenState

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass(slots=True)
class Generation:
    """One request's job, bounds and shaping, ready to serve."""

    job_id: str
    model: str  # the model the client named
    worker_url: str  # the job's kind as the worker reads it (chat or text completion)
    worker_req: dict[str, Any]  # what the worker gets
    stream: bool
    meter: Meter  # built from ``worker_req``: what the worker reads is what is bounded
    prompt_texts: list[str]  # the hold's estimate of the prompt
    view: ChatView


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


async def hold_price(state: QueenState, model: str) -> Price:
    """The price a billed hold reserves at, with no hub request made for it (the hold comes
    before any): a model the queen has read (well or not; a reading already under way is
    waited for), a name on no hub, and one the price file names have their own price. A hub
    model never read (one about to be placed, say) is held at the dearest rates of every
    class, since its reading may put it in any of them: the hold is never too small, and
    ``price_hold`` settles it at the model's own price once it is read."""
    prices, catalog = state.billing.prices, state.catalog
    await catalog.awaited(model)
    if catalog.known(model) or model in prices.models:
        return state.pricer.price(model)
    dearest = max(prices.prices, key=lambda p: (p.completion_msat_per_1k, p.prompt_msat_per_1k))
    return Price(dearest.size_class, None,
                 max(p.prompt_msat_per_1k for p in prices.prices),
                 max(p.completion_msat_per_1k for p in prices.prices))


async def price_hold(state: QueenState, principal: Principal, hold: Hold | None,
                     model: str) -> None:
    """Price ``hold`` by the queen's own reading of ``model``: a billed request waits a bounded
    time for the reading (``catalog.settle``), which it starts if there is none. The charge is
    this price, never more than the hold reserved."""
    if principal.billed:
        await state.catalog.settle(model)
    price = state.price_of(model)
    if hold is not None:
        hold.price = price


async def admit_and_hold(state: QueenState, request: Request, principal: Principal, job_id: str,
                         model: str, *hold_args: Any, read: bool = True, **hold_kwargs: Any,
                         ) -> tuple[Admission, Hold | None]:
    """Count the request against its caller (429 past the limits) and reserve its money (402)
    before anything is read or sent for it; a refused hold gives the place back. ``read``:
    then price the hold by the model's reading (``price_hold``); a request whose model is
    still to be placed does that once the placement has read it."""
    admission = state.dispatcher.admit(caller_of(request, principal))
    hold: Hold | None = None
    try:
        prices = state.billing.prices
        price = await hold_price(state, model) if principal.billed else prices.unverified
        hold = await state.billing.hold(principal, job_id, price, *hold_args, **hold_kwargs)
        if hold is not None:
            hold.model = model
        if read:
            await price_hold(state, principal, hold, model)
        return admission, hold
    except BaseException:
        await state.billing.finish(hold)  # charged nothing
        admission.leave()
        raise


def remember_turn(state: QueenState, gen: Generation, scope: str, worker_key: str | None,
                  answer: Delivered, text: str | None) -> None:
    """A chat answer ended well: when one worker gave its one choice whole (no failover), its
    conversation's next turn goes back to that worker when it can (``PrefixAffinity``)."""
    if (worker_key is None or text is None or answer.parts
            or choices_in(gen.worker_req) != 1):
        return
    state.affinity.served(scope, gen.model, gen.worker_req, text, worker_key)


def delivered_text(gen: Generation, answer: Delivered, result: Result) -> str:
    """The answer's text as the client got it: a stream's relayed text, a plain answer's whole
    message (its checkpoints, kept for failover, hold only the text up to the last one)."""
    whole = message_text(result.data) if result.data.get("choices") else None
    return answer.text if gen.stream or whole is None else whole


async def fine_tuned(state: QueenState, principal: Principal,
                     model: str) -> FineTunedModel | None:
    """The caller's fine-tuned model ``model`` names (None for any other name); a 404
    ``model_not_found`` for an ``ft:`` name that is not the caller's (another's, a deleted one,
    none): the same answer as for a model nobody serves, so no caller learns another's model
    exists."""
    if not model.startswith("ft:"):
        return None
    found = None
    if state.fine_tuning is not None:
        found = await state.fine_tuning.models.find(owner_of(principal), model)
    if found is None:
        raise ModelNotFound(f"The model '{model}' does not exist or you do not have access "
                            "to it.", param="model")
    return found


def require_servable(state: QueenState, model: str, needs: Mapping[str, str],
                     tuned: FineTunedModel | None) -> None:
    """``Dispatcher.require_servable``, and for a fine-tuned model a 404 naming it when no
    worker here holds its base with the ``lora`` capability."""
    if tuned is not None and not any(LORA in profile[1] for profile
                                     in state.dispatcher.eligibility.servable(model)):
        raise ModelNotFound(
            f"The fine-tuned model '{tuned.name}' is not served by any connected worker now: "
            f"it needs a worker that holds its base model '{model}' and serves LoRA adapters "
            "(the 'lora' capability). Try again later.", param="model")
    state.dispatcher.require_servable(model, needs)


async def serve(state: QueenState, request: Request, principal: Principal,
                gen: Generation) -> Response:
    """Answer ``gen``: a stream of shaped events, or one shaped JSON answer."""
    dispatcher, billing = state.dispatcher, state.billing
    worker_req = gen.worker_req
    needs = capabilities.needs(gen.worker_url, worker_req)
    # A fine-tuned model of the caller's is routed, priced and placed as its base, to workers
    # with ``lora``; its job keeps the ``ft:`` name and carries the adapter.
    tuned = await fine_tuned(state, principal, gen.model)
    model = gen.model if tuned is None else tuned.base
    if tuned is not None:
        needs = {**needs, LORA: "model"}
    arrived = time.monotonic()
    placing = False
    try:
        require_servable(state, model, needs, tuned)
    except ModelNotFound:  # nobody here holds it: another replica's worker, or place it
        if tuned is not None and state.dispatcher.eligibility.servable(model):
            raise  # holders of the base, none with ``lora``: placing it again would not help
        if tuned is not None or not await dispatcher.served_elsewhere(model):
            state.groups.prepare(model)  # a model only a group serves: its group's state
            if not state.placement.placeable(model):
                raise
            placing = True
    answer = Delivered(gen.meter)
    # The caller is counted and its money held before the queen reads the hub or sends a
    # fetch for it: a caller that may not (429) or cannot pay (402) costs the swarm nothing.
    admission, hold = await admit_and_hold(
        state, request, principal, gen.job_id, model, gen.prompt_texts, worker_req,
        choices=choices_in(worker_req), read=not placing)
    # Whose prompt cache the job may use, and the worker that holds this conversation's prefix.
    scope = state.scopes.of(admission.caller)
    prefer = state.affinity.next_turn(scope, gen.model, worker_req)
    if placing:
        try:
            await state.placement.prepare(model, admission.caller)
            state.groups.prepare(model)  # fetched for a group's head: the group forms now
            require_servable(state, model, needs, tuned)
            await price_hold(state, principal, hold, model)
        except BaseException:  # not placed (or not yet: model_loading): nothing is charged
            await billing.finish(hold)
            admission.leave()
            raise
    if "max_tokens" not in worker_req and "max_completion_tokens" not in worker_req:
        # Unbilled (billed ones got theirs from the hold): the worker stops where the queen's
        # budget for the answer ends, rather than running on into a failed job.
        worker_req["max_tokens"] = state.settings.default_max_tokens
    streaming = False
    try:
        async with DisconnectGuard(request):
            run = await dispatcher.start(
                gen.job_id, model, gen.worker_url, worker_req, stream=gen.stream,
                billed=principal.billed, admission=admission, sent=answer.sent, needs=needs,
                cache_scope=scope, prefer=prefer,
                adapter=state.fine_tuning.models.ref(tuned)
                if tuned is not None and state.fine_tuning is not None else None,
            )
            state.placement.started(model, time.monotonic() - arrived)
            if gen.stream:  # the stream now owns the hold and the caller's place
                held = hold

                def done(run: JobRun, answer: Delivered, result: Result) -> None:
                    consider_audit(state, gen, held, run.worker.earnings_key, answer, result,
                                   run.handle.shares)
                    remember_turn(state, gen, scope, run.worker.earnings_key, answer,
                                  delivered_text(gen, answer, result))

                body = stream_answer(run, gen.view, dispatcher,
                                     functools.partial(settle, billing, hold, admission),
                                     gen.meter, done)
                hold, streaming = None, True
                return StreamingResponse(body, media_type="text/event-stream",
                                         headers=SSE_HEADERS)
            collected = await collect(run, dispatcher, gen.meter, answer)
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
    last = collected.parts[-1].worker_key if collected.parts else None
    consider_audit(state, gen, hold, last, collected.answer, collected.result,
                   collected.parts[-1].shares if collected.parts else ())
    if len(collected.parts) == 1:
        remember_turn(state, gen, scope, last, collected.answer,
                      delivered_text(gen, collected.answer, collected.result))
    return json_response(gen.view.whole(assemble_chat(gen.view.stamp, collected)))
