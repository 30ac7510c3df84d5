"""``ModelPool(max_contexts=)``: a model may be held to fewer contexts than ``max_jobs`` (a
model group's one head, issue 19) while other models still get one per job; jobs beyond the
limit wait for the context rather than making another. Counted on fake contexts (the real
model's contexts are the other pool tests')."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from desktop_worker.engine.pool import ModelPool
from shared_schema.fitting import LoadPlan


@dataclass(frozen=True)
class FakeShape:
    block_count: int = 2
    context_length: int | None = 512
    embedding_length: int | None = 64
    head_count: int | None = 2
    head_count_kv: int | None = 2
    layer_bytes: tuple[int, ...] = (1 << 19, 1 << 19)
    other_bytes: int = 0


@dataclass(frozen=True)
class FakeModel:
    name: str
    path: str = "/nowhere.gguf"
    size_bytes: int = 1 << 20
    info: FakeShape = FakeShape()


class GatedContext:
    """Streams one chunk once ``gate`` is set, so a test holds jobs mid-answer."""

    def __init__(self, gate: threading.Event) -> None:
        self.busy = threading.Lock()
        self.gate = gate

    def stream(self, kind: str, request: dict[str, Any], cancel: threading.Event,
               continuation: str | None = None) -> Iterator[dict[str, Any]]:
        self.gate.wait(30)
        yield {"choices": [{"delta": {"content": "x"}}]}

    def usage(self) -> dict[str, int]:
        return {"completion_tokens": 1}

    def close(self) -> None:
        pass


class Factory:
    """Counts the contexts it makes; ``enough`` is set (on the loop) once ``expect`` are."""

    def __init__(self, expect: int) -> None:
        self.gate = threading.Event()
        self.made: dict[str, int] = {}
        self.expect = expect
        self.enough = asyncio.Event()
        self.loop = asyncio.get_running_loop()

    def __call__(self, model: Any, plan: LoadPlan, n_threads: int | None,
                 embedding: bool) -> GatedContext:
        self.made[model.name] = self.made.get(model.name, 0) + 1
        if sum(self.made.values()) >= self.expect:
            self.loop.call_soon_threadsafe(self.enough.set)
        return GatedContext(self.gate)


async def test_a_limited_model_shares_one_context_while_others_get_one_per_job() -> None:
    factory = Factory(expect=4)  # 1 head + 3 alone, made by the pool
    pool = ModelPool(FakeModel, max_jobs=3, budget_mb=1 << 20, contexts=factory,
                     max_contexts=lambda name: 1 if name == "group" else None)
    assert pool.context_limit("group") == 1
    assert pool.context_limit("alone") == 3

    async def job(name: str) -> dict[str, int]:
        async def chunk(_: dict[str, Any]) -> None:
            pass

        return await pool.chat(name, {}, threading.Event(), chunk)

    try:
        jobs = [asyncio.create_task(job(name)) for name in ("group",) * 3 + ("alone",) * 3]
        async with asyncio.timeout(10):
            await factory.enough.wait()
        await asyncio.sleep(0)  # the group's other two jobs are waiting, not making a context
        factory.gate.set()
        async with asyncio.timeout(10):
            results = await asyncio.gather(*jobs)
    finally:
        await pool.close()
    assert all(result == {"completion_tokens": 1} for result in results)
    assert factory.made == {"group": 1, "alone": 3}


def test_the_limit_never_goes_below_one_or_above_max_jobs() -> None:
    pool = ModelPool(FakeModel, lambda *_: None, max_jobs=2,
                     max_contexts=lambda name: {"a": 0, "b": 9}.get(name))
    try:
        assert [pool.context_limit(n) for n in ("a", "b", "c")] == [1, 2, 2]
    finally:
        pool._executor.shutdown(wait=False)


async def test_unload_idle_frees_every_model_but_the_one_mid_answer() -> None:
    factory = Factory(expect=3)
    pool = ModelPool(FakeModel, max_jobs=2, budget_mb=1 << 20, contexts=factory)

    async def chunk(_: dict[str, Any]) -> None:
        pass

    try:
        await pool.load("idle-a")
        await pool.load("idle-b")
        busy = asyncio.create_task(pool.chat("busy", {}, threading.Event(), chunk))
        async with asyncio.timeout(10):
            await factory.enough.wait()  # the busy model's context is made and answering
        assert sorted(await pool.unload_idle()) == ["idle-a", "idle-b"]
        assert pool.loaded() == {"busy"}
        factory.gate.set()
        async with asyncio.timeout(10):
            await busy
        assert await pool.unload_idle() == ["busy"]
        assert pool.loaded() == set()
    finally:
        factory.gate.set()
        await pool.close()


async def test_memory_reserved_outside_llama_cpp_unloads_idle_models_and_counts_for_loads(
        caplog) -> None:
    """An image child's reservation (issue 38): idle models make room for it, a busy one
    stays; while it is held, loads count it as in use."""
    factory = Factory(expect=2)
    pool = ModelPool(FakeModel, max_jobs=2, budget_mb=1000, contexts=factory)

    async def chunk(_: dict[str, Any]) -> None:
        pass

    try:
        await pool.load("idle")
        one_mb = pool._loaded["idle"].cost_mb
        await pool.reserve("image:a", 1000 - one_mb)  # room for one model beside it
        assert pool.loaded() == {"idle"}  # it still fits
        await pool.reserve("image:a", 1000)  # again under the same key: replaced, not added
        assert pool.loaded() == set()  # the idle model made room
        assert pool.reserved_mb() == 1000
        busy = asyncio.create_task(pool.chat("busy", {}, threading.Event(), chunk))
        async with asyncio.timeout(10):
            await factory.enough.wait()
        assert "goes over the 1000 MB model budget" in caplog.text  # counted, and said
        await pool.reserve("image:b", 10)
        assert pool.loaded() == {"busy"}  # mid-answer: never unloaded for a reservation
        pool.release("image:a")
        pool.release("image:b")
        pool.release("image:unknown")  # harmless
        assert pool.reserved_mb() == 0
        factory.gate.set()
        async with asyncio.timeout(10):
            await busy
    finally:
        factory.gate.set()
        await pool.close()
