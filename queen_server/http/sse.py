"""Server-sent events: a streamed answer as the bytes its client reads.

Each relayed chunk goes through the request's ``ChatView`` (the queen's stamp, tool calls, the
shaper of the API the client called) and out as ``data: <json>`` events (``event: <name>`` too,
for the Responses API); a chat or text completion stream ends with ``data: [DONE]``, and every
stream with the shaper's error events when the answer breaks. The books of
the answer (what was delivered, by which worker, the failover to a twin) are the swarm's
(``queen_server.swarm.relay``), and the chunk shapes are ``shared_schema.answers``'; this module
frames them and owns the stream's life as an HTTP response body, which Starlette cancels (with
anyio) when the client goes away.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import orjson

from queen_server.errors import ApiError
from queen_server.shaping.base import Event
from queen_server.shaping.view import ChatView
from queen_server.swarm.dispatch import Dispatcher
from queen_server.swarm.jobs import JobEvent, WorkerLost
from queen_server.swarm.metering import Meter
from queen_server.swarm.relay import Delivered, failure, hand_over, message_text
from queen_server.swarm.runs import JobRun, can_fail_over
from shared_schema import Chunk, JobError, Result
from shared_schema.answers import chunks_from_answer

DONE = b"data: [DONE]\n\n"
# While an answer waits mid-stream (a model group re-forming after losing a member can take a
# minute or more), a comment line this often keeps proxies and clients from timing the stream
# out; SSE readers, the OpenAI SDKs' among them, skip comments.
KEEPALIVE = b": keepalive\n\n"
KEEPALIVE_S = 10.0


def sse(data: dict[str, Any]) -> bytes:
    """One event of the stream."""
    return b"data: " + orjson.dumps(data) + b"\n\n"


def frame(events: list[Event]) -> list[bytes]:
    """Shaped events as the bytes of the stream (a named event has an ``event:`` line)."""
    return [sse(data) if name is None
            else b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"
            for name, data in events]


def error_event(view: ChatView, error: ApiError) -> bytes:
    """The events that end a broken stream: the error body a plain answer would have had."""
    return b"".join(frame(view.failed(error.payload())))


def answer_events(view: ChatView, answer: dict[str, Any]) -> list[bytes]:
    """A whole chat answer (a worker that did not stream), as the events of its chunks."""
    out: list[bytes] = []
    for chunk in chunks_from_answer(answer):
        out.extend(frame(view.chunk(chunk)))
    return out


async def stream_answer(
    run: JobRun,
    view: ChatView,
    dispatcher: Dispatcher,
    finish: Callable[..., Awaitable[None]],
    meter: Meter,
    done: Callable[[JobRun, Delivered, Result], None] | None = None,
) -> AsyncIterator[bytes]:
    """The SSE body of a streamed answer, shaped by ``view`` for the API the client called
    (chat, text completions, Responses). If the worker is lost mid-answer, the
    answer goes on on a twin worker (``Dispatcher.fail_over``) with no break in the stream.
    Always ends the job's lease, and calls ``finish`` once with every worker's ``parts``: the
    true usage when the answer ends, or only the tokens delivered when it breaks (no twin,
    timeout, client gone).

    ``done(run, answer, result)`` is told of an answer that ended well, after ``finish`` (the
    audits' sampling).

    Every frame that arrived while the last batch was written goes out in one write. Per relayed
    chunk this does no more than note it, stamp it and encode it: it runs for every token.
    """
    answer = Delivered(meter)
    client_left = True  # until the stream ends by itself: a stream the client left pays its prompt
    chunk_events = view.chunk
    current: JobRun | None = run
    event: JobEvent = run.first
    opening = frame(view.opening())
    try:
        while True:
            out: list[bytes] = opening
            opening = []
            ended = False
            failed: JobError | WorkerLost | None = None
            for item in (event, *run.take_ready()):
                if isinstance(item, Chunk):
                    data = answer.take(item.data, item.tokens)
                    if data is not None:
                        events = chunk_events(data)
                        if events:
                            out.extend(frame(events))
                    continue
                if isinstance(item, Result):
                    parts, usage = answer.done(
                        run.credit, item.usage,
                        None if answer.saw_chunk else message_text(item.data))
                    dispatcher.record_result(
                        run.handle, answer.last_worker_usage(item.usage, parts, usage),
                        streamed=True)
                    await finish(parts=parts)
                    if done is not None:
                        done(run, answer, item)
                    if not answer.saw_chunk:
                        out.extend(answer_events(view, item.data))
                    out.extend(frame(view.closing(usage.model_dump())))
                    if view.sse_done:
                        out.append(DONE)
                    ended = True
                else:
                    failed = item
                break
            if failed is not None:
                error = failure(failed)
                dispatcher.record_failure(run.handle, error.code or "worker_error")
                if can_fail_over(failed) and answer.single:
                    if out:
                        yield b"".join(out)
                        out = []
                    current = None
                    handing = asyncio.ensure_future(hand_over(run, answer, dispatcher))
                    try:
                        while not (await asyncio.wait({handing}, timeout=KEEPALIVE_S))[0]:
                            yield KEEPALIVE
                        run = handing.result()
                    except ApiError as exc:
                        client_left = False
                        yield b"".join(out) + error_event(view, exc)
                        return
                    finally:
                        if not handing.done():  # the client left while it waited
                            handing.cancel()
                        elif not handing.cancelled() and handing.exception() is None:
                            current = handing.result()  # whatever happens, its lease ends
                    current = run
                    event = run.first
                    continue
                out.append(error_event(view, error))
                ended = True
            if ended:
                client_left = False
            yield b"".join(out)
            if ended:
                return
            try:
                event = await run.next()
            except ApiError as exc:  # the total timeout (recorded by run.next)
                client_left = False
                yield error_event(view, exc)
                return
    finally:
        # Starlette cancels the body with anyio when the client goes away; anyio re-delivers a
        # cancellation every loop turn, and this shield holds it off until the books are closed.
        with anyio.CancelScope(shield=True):
            # A no-op once the usage was charged; else the delivered tokens, as incomplete.
            await finish(parts=answer.broken(run.credit, client_left=client_left))
            if current is not None:
                await current.finish()
