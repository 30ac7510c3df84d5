"""A job under way and its dispatcher, as the relay and the SSE body use them, fed by a test.

``FakeRun`` stands in for ``queen_server.swarm.runs.JobRun`` with the members the relay
reads (``first``, ``take_ready``, ``next``, ``finish``, ``handle``, ``worker.earnings_key``),
and ``FakeDispatcher`` for the ``Dispatcher`` calls it makes; so the answer's books, its bytes
and its cleanup can be tested without sockets, workers or a database.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from queen_server.errors import NoCapacity
from queen_server.swarm.jobs import Credit
from shared_schema import Chunk, JobError, Result, Usage


def chunk(content: str | None = None, *, role: str | None = None,
          finish_reason: str | None = None) -> Chunk:
    """A worker's chunk frame, as llama.cpp writes it (its own id, model and created)."""
    delta: dict[str, Any] = {}
    if role is not None:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    return Chunk(id="job", seq=0, data={
        "id": "chatcmpl-worker", "object": "chat.completion.chunk", "created": 1, "model": "w",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]})


def result(prompt: int = 5, completion: int = 2, data: dict[str, Any] | None = None) -> Result:
    return Result(id="job", data=data or {}, usage=Usage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion))


class FakeRun:
    """A job on one worker: ``first`` is its first frame; ``feed`` gives it more (an exception
    fed is raised by ``next``, as ``JobRun.next`` raises its timeout). ``finish`` records the
    lease's end, after ``finish_gate`` opens if one is set."""

    def __init__(self, first: Chunk | Result | JobError | Any, *, worker: str = "worker-a",
                 ready: list[Any] | None = None) -> None:
        self.first = first
        self.handle = SimpleNamespace(id="job")
        self.worker = SimpleNamespace(earnings_key=worker)
        self.credit = Credit(worker)
        self._ready = list(ready or ())
        self._frames: asyncio.Queue[Any] = asyncio.Queue()
        self.waiting = asyncio.Event()  # set when ``next`` waits for a frame
        self.finish_started = asyncio.Event()
        self.finish_gate: asyncio.Event | None = None
        self.finished: list[str] = []
        self.failures: list[str] = []

    def feed(self, *frames: Any) -> None:
        for frame in frames:
            self._frames.put_nowait(frame)

    def take_ready(self) -> list[Any]:
        ready, self._ready = self._ready, []
        return ready

    async def next(self) -> Any:
        self.waiting.set()
        frame = await self._frames.get()
        self.waiting.clear()
        if isinstance(frame, BaseException):
            raise frame
        return frame

    def record_failure(self, outcome: str) -> None:
        self.failures.append(outcome)

    async def finish(self, reason: str = "client went away") -> None:
        self.finish_started.set()
        if self.finish_gate is not None:
            await self.finish_gate.wait()
        self.finished.append(reason)


class FakeDispatcher:
    """Records what the relay reports, and fails over to the ``twins`` given, in order."""

    def __init__(self, *twins: FakeRun) -> None:
        self.twins = list(twins)
        self.results: list[bool] = []  # ``streamed`` of each result recorded
        self.failures: list[str] = []
        self.continued: list[tuple[str, int]] = []  # (text, tokens) each twin was handed

    def record_result(self, handle: Any, usage: Usage, *, streamed: bool) -> None:
        self.results.append(streamed)

    def record_failure(self, handle: Any, outcome: str) -> None:
        self.failures.append(outcome)

    async def fail_over(self, run: Any, delivered_text: str, delivered_tokens: int) -> Any:
        self.continued.append((delivered_text, delivered_tokens))
        if not self.twins:
            raise NoCapacity("no twin holds the model")
        return self.twins.pop(0)


class Charges:
    """The ``finish`` callback of a stream: every call's ``parts``."""

    def __init__(self) -> None:
        self.calls: list[Any] = []

    async def __call__(self, parts: Any = None) -> None:
        self.calls.append(parts)
