"""Fuzzing the queen's ``/worker`` websocket: a harness that sends the frames of ``frames`` to a
real queen over real sockets and checks every answer.

The harness runs a real queen (``running_queen``) with two honest ``ScriptedWorker``s: one
holding a streamed job in flight (gated), one idle. Each example connects a fresh fuzzing
worker, sends its frames one at a time, and checks the answer to each against ``SessionOracle``:
an ``error`` message with the expected code (and the job id the frame named), a ``pong``, nothing,
or a close with the expected code and a reason. A ``ping`` probe after every frame makes
"nothing" observable: the probe's ``pong`` must come next, so a hang fails within
``ANSWER_TIMEOUT_S``. After each example the fuzzing worker must be gone from the registry, the
honest workers' entries unchanged, and ``/health`` 200.

Shared by ``test_worker_ws_fuzz.py`` (bounded, for CI) and ``bench/fuzz.py`` (bigger runs).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from shared_schema import (
    SUBPROTOCOL,
    Challenge,
    ChatCompletion,
    ChatCompletionChunk,
    EmbeddingResponse,
    ErrorResponse,
    ModelDescriptor,
    Ping,
    Welcome,
    decode,
    encode,
    queen_origin,
)
from tests.queen_server.fuzz.frames import (
    MAX_BAD_FRAMES,
    MAX_FRAME_BYTES,
    MAX_HELLO_BYTES,
    Expect,
    Frame,
    SessionOracle,
    dumps,
    expect_first,
)
from tests.support.queen import QueenHarness, running_queen
from tests.support.workers import (
    ScriptedWorker,
    echo_words,
    new_key,
    pubkey_hex,
    signed_hello,
)

# The queen under fuzz: the limits ``frames`` assumes, and job timeouts long enough for the
# honest job to stay in flight all run.
QUEEN_SETTINGS: dict[str, Any] = {
    "max_frame_bytes": MAX_FRAME_BYTES,
    "max_hello_bytes": MAX_HELLO_BYTES,
    "max_bad_frames": MAX_BAD_FRAMES,
    "heartbeat_interval_s": 1.0,
    "hello_timeout_s": 5.0,
    "first_token_timeout_s": 600.0,
    "total_timeout_s": 600.0,
}
ANSWER_TIMEOUT_S = 10.0
HONEST_A_MODEL = "honest/alpha-GGUF:Q4_K_M"
HONEST_B_MODEL = "honest/beta-GGUF:Q8_0"
HONEST_PROMPT = "the honest stream must arrive whole"
FUZZ_MODEL = "fuzz/own-GGUF:Q4_0"  # served only by the fuzzing worker, for its own jobs

log = logging.getLogger(__name__)


# --- the fuzzing worker -----------------------------------------------------------------------


class ExampleFailed(AssertionError):
    pass


async def _next_message(ws: ClientConnection) -> dict[str, Any]:
    """The queen's next message, skipping its heartbeat pings."""
    while True:
        async with asyncio.timeout(ANSWER_TIMEOUT_S):
            frame = await ws.recv()
        body = orjson.loads(frame)
        if body.get("type") != "ping":
            return body


async def _closed(ws: ClientConnection) -> tuple[int | None, str]:
    """Wait for the queen to close the connection; its close code and reason."""
    with contextlib.suppress(ConnectionClosed):
        async with asyncio.timeout(ANSWER_TIMEOUT_S):
            while True:
                await ws.recv()
    return ws.close_code, ws.close_reason or ""


def _check(condition: bool, what: str) -> None:
    if not condition:
        raise ExampleFailed(what)


async def _connect(url: str, *, v1: bool) -> ClientConnection:
    return await connect(url, subprotocols=[SUBPROTOCOL] if v1 else None, proxy=None,
                         compression=None, max_size=None, ping_interval=None,
                         open_timeout=ANSWER_TIMEOUT_S, close_timeout=2)


# --- the harness ------------------------------------------------------------------------------


@dataclass
class Tally:
    frames: int = 0
    examples: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    answers: dict[str, int] = field(default_factory=dict)

    def count(self, frame: Frame, expect: Expect) -> None:
        self.frames += 1
        self.by_kind[frame.kind] = self.by_kind.get(frame.kind, 0) + 1
        key = f"{expect.kind} {expect.code}" if expect.code is not None else expect.kind
        self.answers[key] = self.answers.get(key, 0) + 1


class ErrorLog(logging.Handler):
    """Collects every ERROR record: the queen's own, and uvicorn's (its loggers do not
    propagate to the root), where an exception that escaped the app is logged."""

    LOGGERS = ("", "uvicorn")

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def new(self) -> list[str]:
        """The messages logged since the last call (so one failure is counted once)."""
        fresh, self.records = self.records, []
        return [record.getMessage() for record in fresh]

    def attach(self) -> None:
        for name in self.LOGGERS:
            logging.getLogger(name).addHandler(self)

    def detach(self) -> None:
        for name in self.LOGGERS:
            logging.getLogger(name).removeHandler(self)


class WsFuzzHarness:
    """A real queen with two honest workers, one holding a streamed job in flight."""

    def __init__(self, queen: QueenHarness) -> None:
        self.queen = queen
        self.tally = Tally()
        self.errors = ErrorLog()
        self.http = httpx.AsyncClient(base_url=queen.base_url, timeout=ANSWER_TIMEOUT_S,
                                      trust_env=False)
        self.honest_a = ScriptedWorker(queen.ws_url, models=[HONEST_A_MODEL],
                                       behaviour="gated", max_jobs=2)
        self.honest_b = ScriptedWorker(queen.ws_url, models=[HONEST_B_MODEL])
        self.other_jobs: list[str] = []
        self._stream: Any = None
        self._probes = itertools.count(1)

    async def start(self) -> None:
        self.errors.attach()
        await self.honest_a.start()
        await self.honest_b.start()
        await self.queen.wait_until(lambda: len(self.queen.state.registry) == 2)
        client = self.queen.client(timeout=600)
        self._stream = await client.chat.completions.create(
            model=HONEST_A_MODEL, stream=True,
            messages=[{"role": "user", "content": HONEST_PROMPT}])
        session = self.queen.state.registry.get(self.honest_a.pubkey)
        self.other_jobs = list(session.jobs)
        assert len(self.other_jobs) == 1, session.jobs
        self.baseline = self.snapshot()

    async def stop(self) -> None:
        self.errors.detach()
        await self.http.aclose()
        await self.honest_a.stop()
        await self.honest_b.stop()

    def snapshot(self) -> dict[str, Any]:
        """The honest workers' registry entries, and the registry's model index."""
        registry = self.queen.state.registry
        entries = {}
        for worker in (self.honest_a, self.honest_b):
            s = registry.get(worker.pubkey)
            link = registry.connection(worker.pubkey).link  # the websocket edge's WorkerSocket
            entries[worker.pubkey] = (
                id(s), s.session_id, s.max_jobs, s.models, s.loaded, s.cached, s.capabilities,
                sorted((job_id, h.finished, h.cancelling) for job_id, h in s.jobs.items()),
                link.bad_frames, s.closed, s.ln_url, s.worker_version, s.gpus, s.vram_mb,
            )
        return {"entries": entries, "keys": sorted(s.key for s in registry),
                "models": {name: sorted(s.key for s in registry.holders(name))
                           for name in registry.model_names()}}

    async def check_swarm(self, fuzz_key: str | None) -> None:
        """After an example: the fuzzing worker gone, the honest ones as they were, health 200."""
        registry = self.queen.state.registry
        if fuzz_key is not None:
            await self.queen.wait_until(lambda: registry.get(fuzz_key) is None,
                                        timeout_s=ANSWER_TIMEOUT_S, what="fuzz worker gone")
        await self.queen.wait_until(lambda: len(registry) == 2, timeout_s=ANSWER_TIMEOUT_S,
                                    what="only the honest workers left")
        _check(self.snapshot() == self.baseline, "the honest workers' registry entries changed")
        response = await self.http.get("/health")
        _check(response.status_code == 200, f"/health answered {response.status_code}")
        logged = self.errors.new()
        _check(not logged, f"the queen logged errors: {logged}")

    async def session_example(self, frames: list[Frame]) -> None:
        """A welcomed fuzzing worker sends ``frames``; each answer must be what the oracle says."""
        ws = await _connect(self.queen.ws_url, v1=True)
        key = new_key()
        try:
            challenge = decode(await ws.recv())
            _check(isinstance(challenge, Challenge), f"expected a challenge, got {challenge}")
            await ws.send(encode(signed_hello(key, challenge.nonce, models=[],
                                              origin=queen_origin(self.queen.ws_url))))
            welcome = decode(await _next_message_raw(ws))
            _check(isinstance(welcome, Welcome), f"expected a welcome, got {welcome}")
            self.tally.examples += 1
            oracle = SessionOracle()
            for frame in frames:
                expect = oracle.expect(frame.data)
                self.tally.count(frame, expect)
                await ws.send(frame.data)
                if expect.kind == "close":
                    code, reason = await _closed(ws)
                    _check(code == expect.code and bool(reason),
                           f"{frame!r}: expected close {expect.code}, got {code} {reason!r}")
                    break
                await self._answer(ws, frame, expect)
        finally:
            await ws.close()
        await self.check_swarm(pubkey_hex(key))

    async def _answer(self, ws: ClientConnection, frame: Frame, expect: Expect) -> None:
        probe = float(next(self._probes))
        await ws.send(encode(Ping(ts=probe)))
        got = []
        try:
            while (body := await _next_message(ws)) != {"type": "pong", "ts": probe}:
                got.append(body)
        except TimeoutError:
            raise ExampleFailed(f"{frame!r}: no answer in {ANSWER_TIMEOUT_S} s "
                                f"(got {got})") from None
        except ConnectionClosed as exc:
            raise ExampleFailed(f"{frame!r}: closed unexpectedly ({exc}); got {got}") from None
        if expect.kind == "nothing":
            _check(got == [], f"{frame!r}: expected no answer, got {got}")
        elif expect.kind == "pong":
            _check(got == [{"type": "pong", "ts": expect.ts}],
                   f"{frame!r}: expected a pong {expect.ts}, got {got}")
        else:
            _check(len(got) == 1, f"{frame!r}: expected one error, got {got}")
            error = got[0]
            _check(error.get("type") == "error" and error.get("code") == expect.code
                   and error.get("id") == expect.job_id and bool(error.get("message"))
                   and error.get("retryable") is False,
                   f"{frame!r}: expected error {expect.code} for {expect.job_id!r}, got {got}")

    async def own_job_example(self, frames: list[dict[str, Any]], *, stream: bool,
                              embeddings: bool) -> None:
        """A worker answers a real request for its own model with ``frames``, then leaves.

        The client must get a typed answer: a 200 in the right shape, or a 502 in OpenAI's
        error shape (a plain answer, or the error event of a stream), never a 500 or a hang.
        """
        ws = await _connect(self.queen.ws_url, v1=True)
        key = new_key()
        model = ModelDescriptor(name=FUZZ_MODEL, loaded=True, parameter_count=135_000_000)
        try:
            challenge = decode(await _next_message_raw(ws))
            await ws.send(encode(signed_hello(key, challenge.nonce, models=[model],
                                              origin=queen_origin(self.queen.ws_url))))
            _check(isinstance(decode(await _next_message_raw(ws)), Welcome), "no welcome")
            self.tally.examples += 1
            path = "/v1/embeddings" if embeddings else "/v1/chat/completions"
            body: dict[str, Any] = {"model": FUZZ_MODEL}
            body.update({"input": "hi"} if embeddings else {
                "messages": [{"role": "user", "content": "hi"}], "stream": stream})
            request = asyncio.create_task(self.http.post(path, json=body))
            job = await _next_message(ws)
            _check(job.get("type") == "job", f"expected the job, got {job}")
            for frame in frames:
                self.tally.count(Frame(dumps(frame), "own_job"), Expect("nothing"))
                await ws.send(dumps({**frame, "id": job["id"]}))
        finally:
            await ws.close()
        response = await request
        self.tally.answers[f"http {response.status_code}"] = (
            self.tally.answers.get(f"http {response.status_code}", 0) + 1)
        _check(response.status_code in (200, 502),
               f"{frames}: the client got {response.status_code}: {response.text[:300]}")
        if response.status_code == 502:
            ErrorResponse.model_validate_json(response.content)
        elif stream and not embeddings:
            events = [line[6:] for line in response.text.split("\n\n") if line]
            _check(bool(events), f"{frames}: an empty stream")
            for event in events[:-1]:
                ChatCompletionChunk.model_validate_json(event)
            last = events[-1]
            _check(last == "[DONE]" or "error" in orjson.loads(last),
                   f"{frames}: the stream ended with {last[:200]}")
        else:
            (EmbeddingResponse if embeddings else ChatCompletion).model_validate_json(
                response.content)
        await self.check_swarm(pubkey_hex(key))

    async def handshake_example(self, frame: Frame, *, v1: bool) -> None:
        """A first frame, with or without the v1 subprotocol; the answer the oracle says."""
        expect = expect_first(frame.data, v1=v1)
        self.tally.count(frame, expect)
        self.tally.examples += 1
        before = {s.key for s in self.queen.state.registry}
        ws = await _connect(self.queen.ws_url, v1=v1)
        try:
            if v1:
                challenge = decode(await ws.recv())
                _check(isinstance(challenge, Challenge), f"expected a challenge: {challenge}")
            await ws.send(frame.data)
            if expect.kind == "nothing":  # a legacy worker registered; it is sent nothing
                await self.queen.wait_until(lambda: len(self.queen.state.registry) == 3,
                                            timeout_s=ANSWER_TIMEOUT_S, what="legacy joined")
                (legacy,) = {s.key for s in self.queen.state.registry} - before
                _check(legacy.startswith("legacy-"), f"{frame!r}: registered as {legacy}")
            elif expect.kind == "close":
                code, reason = await _closed(ws)
                _check(code == expect.code and bool(reason),
                       f"{frame!r}: expected close {expect.code}, got {code} {reason!r}")
            else:
                refused = decode(await _next_message_raw(ws))
                _check(refused.type == "refused" and refused.code == expect.code
                       and bool(refused.reason),
                       f"{frame!r}: expected refused {expect.code}, got {refused}")
                code, reason = await _closed(ws)
                _check(code == expect.close and bool(reason),
                       f"{frame!r}: expected close {expect.close}, got {code} {reason!r}")
        except (TimeoutError, ConnectionClosed) as exc:
            raise ExampleFailed(f"{frame!r}: no typed answer ({exc!r})") from None
        finally:
            await ws.close()
        await self.check_swarm(None)

    async def finish(self) -> None:
        """The honest job ends with exactly its own answer; the idle worker still serves."""
        self.honest_a.release.set()
        text = ""
        async with asyncio.timeout(ANSWER_TIMEOUT_S):
            async for chunk in self._stream:
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
        expected = "".join(echo_words({"messages": [{"role": "user",
                                                     "content": HONEST_PROMPT}]}))
        _check(text == expected, f"the honest stream was {text!r}, not {expected!r}")
        answer = await self.queen.client().chat.completions.create(
            model=HONEST_B_MODEL, messages=[{"role": "user", "content": "still here"}])
        _check(answer.choices[0].message.content == "echo: still here",
               f"the idle honest worker answered {answer}")
        _check(self.honest_a.close_code is None and self.honest_b.close_code is None,
               "an honest worker was disconnected")


async def _next_message_raw(ws: ClientConnection) -> str | bytes:
    async with asyncio.timeout(ANSWER_TIMEOUT_S):
        return await ws.recv()


@contextlib.asynccontextmanager
async def ws_fuzz_harness(tmp_path: Path, **overrides: Any) -> AsyncIterator[WsFuzzHarness]:
    async with running_queen(tmp_path, **{**QUEEN_SETTINGS, **overrides}) as queen:
        harness = WsFuzzHarness(queen)
        await harness.start()
        try:
            yield harness
        finally:
            await harness.stop()
