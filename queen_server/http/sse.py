"""Server-sent events: a streamed chat completion as the bytes its client reads.

Each chunk goes out as one ``data: <json>`` event, stamped with the queen's completion id; the
stream ends with ``data: [DONE]``, or with an error event when the answer breaks. The books of
the answer (what was delivered, by which worker, the failover to a twin) are the swarm's
(``queen_server.swarm.relay``), and the chunk shapes are ``shared_schema.answers``'; this module
frames them and owns the stream's life as an HTTP response body, which Starlette cancels (with
anyio) when the client goes away.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import orjson

from queen_server.errors import ApiError
from queen_server.swarm.dispatch import Dispatcher, JobRun, can_fail_over
from queen_server.swarm.jobs import JobEvent, WorkerLost
from queen_server.swarm.metering import Meter
from queen_server.swarm.relay import (
    CompletionContext,
    Delivered,
    failure,
    hand_over,
    message_text,
)
from shared_schema import Chunk, JobError, Result
from shared_schema.answers import CHAT_CHUNK, chunks_from_answer, usage_chunk

DONE = b"data: [DONE]\n\n"


def sse(data: dict[str, Any]) -> bytes:
    """One event of the stream."""
    return b"data: " + orjson.dumps(data) + b"\n\n"


def error_event(error: ApiError) -> bytes:
    """The event that ends a broken stream: the error body a plain answer would have had."""
    return sse(error.body().model_dump())


def answer_events(ctx: CompletionContext, answer: dict[str, Any]) -> list[bytes]:
    """A whole chat answer (a worker that did not stream), as the events of its chunks."""
    return [sse(ctx.stamp(chunk, CHAT_CHUNK)) for chunk in chunks_from_answer(answer)]


async def stream_chat(
    run: JobRun,
    ctx: CompletionContext,
    dispatcher: Dispatcher,
    finish: Callable[..., Awaitable[None]],
    meter: Meter,
) -> AsyncIterator[bytes]:
    """The SSE body of a streamed chat completion. If the worker is lost mid-answer, the
    answer goes on on a twin worker (``Dispatcher.fail_over``) with no break in the stream.
    Always ends the job's lease, and calls ``finish`` once with every worker's ``parts``: the
    true usage when the answer ends, or only the tokens delivered when it breaks (no twin,
    timeout, client gone).

    Every frame that arrived while the last batch was written goes out in one write. Per relayed
    chunk this does no more than note it, stamp it and encode it: it runs for every token.
    """
    answer = Delivered(meter)
    client_left = True  # until the stream ends by itself: a stream the client left pays its prompt
    stamp = ctx.stamp
    current: JobRun | None = run
    event: JobEvent = run.first
    try:
        while True:
            out: list[bytes] = []
            ended = False
            failed: JobError | WorkerLost | None = None
            for item in (event, *run.take_ready()):
                if isinstance(item, Chunk):
                    data = answer.take(item.data)
                    if data is not None:
                        out.append(sse(stamp(data, CHAT_CHUNK)))
                    continue
                if isinstance(item, Result):
                    parts, usage = answer.done(
                        run.worker.earnings_key, item.usage,
                        None if answer.saw_chunk else message_text(item.data))
                    dispatcher.record_result(
                        run.handle, answer.last_worker_usage(item.usage, parts, usage),
                        streamed=True)
                    await finish(parts=parts)
                    if not answer.saw_chunk:
                        out.extend(answer_events(ctx, item.data))
                    if ctx.include_usage:
                        out.append(sse(stamp(usage_chunk(usage.model_dump()), CHAT_CHUNK)))
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
                    try:
                        run = await hand_over(run, answer, dispatcher)
                    except ApiError as exc:
                        client_left = False
                        yield error_event(exc)
                        return
                    current = run
                    event = run.first
                    continue
                out.append(error_event(error))
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
                yield error_event(exc)
                return
    finally:
        # Starlette cancels the body with anyio when the client goes away; anyio re-delivers a
        # cancellation every loop turn, and this shield holds it off until the books are closed.
        with anyio.CancelScope(shield=True):
            # A no-op once the usage was charged; else the delivered tokens, as incomplete.
            await finish(parts=answer.broken(run.worker.earnings_key, client_left=client_left))
            if current is not None:
                await current.finish()
