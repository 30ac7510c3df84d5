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

from queen_server.errors import ApiError, WorkerFailed
from queen_server.swarm.dispatch import Dispatcher, JobRun, can_fail_over
from queen_server.swarm.jobs import JobEvent, Part, WorkerLost
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


class Delivered:
    """What one answer has given the client so far, across the workers that served it.

    When a worker is lost mid-answer its part is closed (the tokens it delivered) and the text so
    far becomes the continuation for the next worker, whose chunks then carry only new text.
    """

    __slots__ = ("_text", "carried", "continuing", "finish_reason", "parts", "saw_chunk", "single",
                 "tokens")

    def __init__(self) -> None:
        self._text: list[str] = []
        self.carried = ""  # the text handed to the worker serving now, as its continuation
        self.tokens = 0  # content chunks of the current worker's part
        self.parts: list[Part] = []  # closed parts of workers that were lost
        self.continuing = False
        self.saw_chunk = False
        self.single = True  # only choice 0 seen: a continuation is well defined
        self.finish_reason: str | None = None

    @property
    def text(self) -> str:
        return "".join(self._text)

    @property
    def delivered_tokens(self) -> int:
        return sum(part.completion_tokens for part in self.parts) + self.tokens

    def take(self, data: dict[str, Any]) -> dict[str, Any] | None:
        """Note one chunk; returns it to forward (without a repeated role), or None to drop."""
        self.saw_chunk = True
        keep = not self.continuing
        for choice in data.get("choices") or ():
            if choice.get("index", 0):
                self.single = False
            delta = choice.get("delta") or {}
            content = delta.get("content")
            if content:
                self._text.append(content)
                self.tokens += _tokens_in(data)
                keep = True
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
                keep = True
            if self.continuing and "role" in delta:
                choice["delta"] = {k: v for k, v in delta.items() if k != "role"}
        return data if keep or data.get("usage") is not None else None

    def lost(self, worker_key: str | None) -> None:
        """The current worker failed: close its part and continue from the text so far."""
        self.parts.append(Part(worker_key, 0, self.tokens, completed=False))
        self.tokens = 0
        self.continuing = True
        self.carried = self.text

    def done(self, worker_key: str | None, usage: Usage) -> tuple[list[Part], Usage]:
        """The answer ended on ``worker_key``: every worker's part, and the answer's usage.

        The last worker read the continuation as prompt; the developer pays for the original
        prompt once (credited to the first worker), which is the last worker's prompt less the
        tokens delivered before it."""
        if not self.parts:
            parts = [Part(worker_key, usage.prompt_tokens, usage.completion_tokens)]
            return parts, usage
        before = sum(part.completion_tokens for part in self.parts)
        first = self.parts[0]
        parts = [
            Part(first.worker_key, max(0, usage.prompt_tokens - before), first.completion_tokens,
                 completed=False),
            *self.parts[1:],
            Part(worker_key, 0, usage.completion_tokens),
        ]
        prompt = parts[0].prompt_tokens
        completion = sum(part.completion_tokens for part in parts)
        return parts, Usage(prompt_tokens=prompt, completion_tokens=completion,
                            total_tokens=prompt + completion)

    def broken(self, worker_key: str | None) -> list[Part]:
        """The parts of an answer that ended early (client gone, no twin, timeout)."""
        parts = [*self.parts, Part(worker_key, 0, self.tokens, completed=False)]
        return [part for part in parts if part.completion_tokens or part.prompt_tokens]


def _tokens_in(data: dict[str, Any]) -> int:
    """Tokens in one chunk's content: one, or what a plain answer's checkpoint counts."""
    usage = data.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        return max(1, usage["completion_tokens"])
    return 1


async def hand_over(run: JobRun, answer: Delivered, dispatcher: Dispatcher) -> JobRun:
    """The worker of ``run`` failed mid-answer: close its part, end its lease, and go on with
    the answer on a twin (``Dispatcher.fail_over``, which raises when there is none)."""
    answer.lost(run.worker.earnings_key)
    await run.finish("continuing on another worker")
    return await dispatcher.fail_over(run, answer.text, answer.delivered_tokens)


async def stream_chat(
    run: JobRun,
    ctx: CompletionContext,
    dispatcher: Dispatcher,
    finish: Callable[..., Awaitable[None]],
) -> AsyncIterator[bytes]:
    """The SSE body of a streamed chat completion. If the worker is lost mid-answer, the
    answer goes on on a twin worker (``Dispatcher.fail_over``) with no break in the stream.
    Always ends the job's lease, and calls ``finish`` once with every worker's ``parts``: the
    true usage when the answer ends, or only the tokens delivered when it breaks (no twin,
    timeout, client gone)."""
    answer = Delivered()
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
                        out.append(sse(ctx.stamp(data, "chat.completion.chunk")))
                    continue
                if isinstance(item, Result):
                    dispatcher.record_result(run.handle, item, streamed=True)
                    parts, usage = answer.done(run.worker.earnings_key, item.usage)
                    await finish(parts=parts)
                    if not answer.saw_chunk:
                        out.extend(chunks_from_answer(ctx, item.data))
                    if ctx.include_usage:
                        out.append(ctx.chunk([], usage.model_dump()))
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
                        yield error_event(exc)
                        return
                    current = run
                    event = run.first
                    continue
                out.append(error_event(error))
                ended = True
            yield b"".join(out)
            if ended:
                return
            try:
                event = await run.next()
            except ApiError as exc:  # the total timeout (recorded by run.next)
                yield error_event(exc)
                return
    finally:
        with anyio.CancelScope(shield=True):
            # A no-op once the usage was charged; else the delivered tokens, as incomplete.
            await finish(parts=answer.broken(run.worker.earnings_key))
            if current is not None:
                await current.finish()


class Collected:
    """A whole answer gathered from its frames (possibly from more than one worker)."""

    __slots__ = ("answer", "parts", "result", "usage")

    def __init__(self, result: Result, answer: Delivered, parts: list[Part], usage: Usage) -> None:
        self.result = result
        self.answer = answer
        self.parts = parts
        self.usage = usage


def assemble_chat(ctx: CompletionContext, collected: Collected) -> dict[str, Any]:
    """The whole answer of a chat completion, from the worker's answer or the chunks."""
    result = collected.result
    if result.data.get("choices") and not collected.answer.continuing:
        answer = ctx.stamp(dict(result.data), "chat.completion")
    else:
        text = collected.answer.text
        finish_reason = collected.answer.finish_reason
        if result.data.get("choices"):  # the last worker's whole part, after a failover
            text = collected.answer.carried
            for choice in result.data["choices"]:
                text += (choice.get("message") or {}).get("content") or ""
                finish_reason = choice.get("finish_reason") or finish_reason
        answer = ctx.stamp({}, "chat.completion")
        answer["choices"] = [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": finish_reason or "stop",
            }
        ]
    answer["usage"] = collected.usage.model_dump()
    return answer


async def collect(run: JobRun, dispatcher: Dispatcher) -> Collected:
    """Every chunk of a job and its result, continuing on a twin worker if the worker is lost
    mid-answer. Ends every lease it holds. Raises the job's failure as an ``ApiError``."""
    answer = Delivered()
    current: JobRun | None = run
    event = run.first
    try:
        while True:
            if isinstance(event, Result):
                dispatcher.record_result(run.handle, event, streamed=False)
                parts, usage = answer.done(run.worker.earnings_key, event.usage)
                return Collected(event, answer, parts, usage)
            if isinstance(event, Chunk):
                answer.take(event.data)
            else:
                error = failure(event)
                run.record_failure(error.code or "worker_error")
                if not (can_fail_over(event) and answer.single):
                    raise error
                current = None
                run = await hand_over(run, answer, dispatcher)
                current = run
                event = run.first
                continue
            event = await run.next()
    finally:
        if current is not None:
            with anyio.CancelScope(shield=True):
                await current.finish()


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
