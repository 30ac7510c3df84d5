"""Turning a job's frames into what the client asked for: an SSE stream or one JSON answer.

The queen stamps its own completion id, model name and creation time on every chunk, converts
a whole answer into chunks when the worker did not stream (legacy workers), and assembles
chunks into a whole answer when the client did not ask for a stream.
"""

from __future__ import annotations

import base64
import sys
from array import array
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import orjson

from queen_server.dispatch import Dispatcher, JobRun
from queen_server.errors import ApiError, WorkerFailed
from queen_server.jobs import JobEvent, WorkerLost
from shared_schema import Chunk, JobError, Result, Usage

DONE = b"data: [DONE]\n\n"


class CompletionContext:
    """What every chunk and answer of one completion carries."""

    __slots__ = ("created", "id", "include_usage", "model")

    def __init__(self, completion_id: str, model: str, created: int, include_usage: bool) -> None:
        self.id = completion_id
        self.model = model
        self.created = created
        self.include_usage = include_usage

    def stamp(self, data: dict[str, Any], kind: str) -> dict[str, Any]:
        data["id"] = self.id
        data["object"] = kind
        data["created"] = self.created
        data["model"] = self.model
        return data

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
        data: dict[str, Any] = {"choices": choices}
        if usage is not None:
            data["usage"] = usage
        return sse(self.stamp(data, "chat.completion.chunk"))


def sse(data: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


def error_event(error: ApiError) -> bytes:
    return sse(error.body().model_dump())


def failure(event: JobError | WorkerLost) -> WorkerFailed:
    if isinstance(event, WorkerLost):
        return WorkerFailed(f"the worker was lost mid-answer: {event.reason}", code="worker_lost")
    return WorkerFailed(f"the worker failed: {event.message}", code=event.code or "worker_error")


def chunks_from_answer(ctx: CompletionContext, answer: dict[str, Any]) -> list[bytes]:
    """A whole chat answer, as the chunks a streaming worker would have sent."""
    out = []
    for choice in answer.get("choices") or []:
        index = choice.get("index", 0)
        message = choice.get("message") or {}
        delta = {"role": message.get("role", "assistant"), "content": message.get("content", "")}
        out.append(ctx.chunk([{"index": index, "delta": delta, "finish_reason": None}]))
        out.append(ctx.chunk([{"index": index, "delta": {},
                               "finish_reason": choice.get("finish_reason") or "stop"}]))
    return out


async def stream_chat(
    run: JobRun,
    ctx: CompletionContext,
    dispatcher: Dispatcher,
    finish: Callable[..., Awaitable[None]],
) -> AsyncIterator[bytes]:
    """The SSE body of a streamed chat completion. Always ends the job's lease, and calls
    ``finish`` once: with the true usage when the job ends, or with only the tokens delivered
    when the stream breaks (worker lost, timeout, client gone)."""
    saw_chunk = False
    delivered = 0
    event: JobEvent = run.first
    try:
        while True:
            out: list[bytes] = []
            finished = False
            for item in (event, *run.take_ready()):
                if isinstance(item, Chunk):
                    saw_chunk = True
                    for choice in item.data.get("choices") or ():
                        if (choice.get("delta") or {}).get("content"):
                            delivered += 1
                    out.append(sse(ctx.stamp(item.data, "chat.completion.chunk")))
                    continue
                finished = True
                if isinstance(item, Result):
                    dispatcher.record_result(run.handle, item, streamed=True)
                    await finish(prompt_tokens=item.usage.prompt_tokens,
                                 completion_tokens=item.usage.completion_tokens)
                    if not saw_chunk:
                        out.extend(chunks_from_answer(ctx, item.data))
                    if ctx.include_usage:
                        out.append(ctx.chunk([], item.usage.model_dump()))
                    out.append(DONE)
                else:
                    error = failure(item)
                    dispatcher.record_failure(run.handle, error.code or "worker_error")
                    out.append(error_event(error))
                break
            yield b"".join(out)
            if finished:
                return
            try:
                event = await run.next()
            except ApiError as exc:  # the total timeout (recorded by run.next)
                yield error_event(exc)
                return
    finally:
        with anyio.CancelScope(shield=True):
            # A no-op once the usage was charged; else the delivered tokens, as incomplete.
            await finish(completion_tokens=delivered, completed=False)
            await run.finish()


def assemble_chat(ctx: CompletionContext, events: list[Chunk], result: Result) -> dict[str, Any]:
    """The whole answer of a chat completion, from the worker's answer or its chunks."""
    if result.data.get("choices"):
        answer = ctx.stamp(dict(result.data), "chat.completion")
    else:
        text: list[str] = []
        finish_reason = "stop"
        for chunk in events:
            for choice in chunk.data.get("choices") or []:
                delta = choice.get("delta") or {}
                if delta.get("content"):
                    text.append(delta["content"])
                if choice.get("finish_reason"):
                    finish_reason = choice["finish_reason"]
        answer = ctx.stamp({}, "chat.completion")
        answer["choices"] = [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "".join(text)},
                "finish_reason": finish_reason,
            }
        ]
    answer["usage"] = result.usage.model_dump()
    return answer


async def collect(run: JobRun) -> tuple[list[Chunk], Result]:
    """Every chunk of a job and its result; raises the job's failure as an ``ApiError``."""
    chunks: list[Chunk] = []
    event = run.first
    while True:
        if isinstance(event, Result):
            return chunks, event
        if isinstance(event, Chunk):
            chunks.append(event)
        else:
            error = failure(event)
            run.record_failure(error.code or "worker_error")
            raise error
        event = await run.next()


def embeddings_answer(
    result: Result, model: str, encoding_format: str
) -> dict[str, Any]:
    """The worker's float embeddings, in the encoding the client asked for."""
    data = dict(result.data)
    data["object"] = "list"
    data["model"] = model
    if encoding_format == "base64":
        data["data"] = [
            {**item, "embedding": floats_to_base64(item.get("embedding") or [])}
            for item in data.get("data") or []
        ]
    usage: Usage = result.usage
    data["usage"] = {"prompt_tokens": usage.prompt_tokens, "total_tokens": usage.total_tokens}
    return data


def floats_to_base64(values: list[float]) -> str:
    """OpenAI's base64 embedding encoding: little-endian float32."""
    packed = array("f", values)
    if sys.byteorder != "little":
        packed.byteswap()
    return base64.b64encode(packed.tobytes()).decode("ascii")
