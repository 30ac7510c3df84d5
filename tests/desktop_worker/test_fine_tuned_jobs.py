"""Fine-tuned models served on the worker (issue 37): a job whose ``Job.adapter`` names an
``ft:`` model fetches the LoRA adapter from a queen's transfer route (a real Starlette server on
127.0.0.1) with the job's token, once however many jobs ask at once, registers it with the
pool, and runs on base plus adapter in real sandboxed children over the real SmolLM2: it
answers as llama-cpp-python does in this process with that ``lora_path``, and an audit's score
job scores the fine-tuned model. What a hostile or broken queen sends is refused: a file that
is not the one named (retryable, nothing registered), an adapter of another architecture (not
retryable, and never fetched again), a frame whose model is not the adapter's. The cache keeps
to its bounds and the disk quota, forgetting the names it evicts."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import pytest

from desktop_worker.adapter_cache import (
    AdapterCache,
    CachedAdapter,
    FineTunedModels,
    choose_adapter_evictions,
)
from desktop_worker.engine.pool import ModelPool
from desktop_worker.errors import AdapterFailed
from desktop_worker.jobs import JobRecord, JobRunner
from desktop_worker.service import worker_capabilities
from desktop_worker.settings import WorkerSettings
from shared_schema import Job
from shared_schema.audits import SCORE_URL
from shared_schema.training import AdapterRef
from tests.desktop_worker.engine.test_adapters import lora_tensors, write_adapter
from tests.desktop_worker.sandbox.test_lora_serving import ASK, in_process
from tests.desktop_worker.sandbox.test_lora_serving import pool as pool  # the fixture
from tests.desktop_worker.test_training_jobs import TOKEN, FakeQueen
from tests.desktop_worker.test_training_jobs import queen as queen  # the fixture
from tests.support.job_sink import RecordingSink

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="the engine children's sandbox is Linux's")

FT = "ft:smol:zorb:ftjob-abc123"
CHAT_URL = "/v1/chat/completions"


class OriginSink(RecordingSink):
    def __init__(self, origin: str) -> None:
        super().__init__()
        self.origin = origin


def fine_tuned(pool: ModelPool, folder: Path, **bounds: Any) -> FineTunedModels:
    limits = {"max_bytes": 64 << 20, "max_count": 8} | bounds
    return FineTunedModels(AdapterCache(folder, **limits), pool)


def make_runner(pool: ModelPool, models: FineTunedModels | None,
                records: list[JobRecord] | None = None, **options: Any) -> JobRunner:
    runner = JobRunner(pool, has_model=lambda name: name == "smol", checkpoint_s=3600,
                       fine_tuned=models, **options)
    if records is not None:
        runner.on_finished.append(records.append)
    return runner


def ref(queen: FakeQueen, file: str, name: str = FT, **changes: Any) -> AdapterRef:
    transfer = queen.transfer(file) | changes
    return AdapterRef(name=name, base="smol", file=transfer, token=TOKEN)


async def run(runner: JobRunner, origin: str, request: dict[str, Any],
              adapter: AdapterRef | None, *, job_id: str = "j1",
              url: str = CHAT_URL) -> OriginSink:
    sink = OriginSink(origin)
    runner.start(Job(id=job_id, openai_url=url, openai_req=request, adapter=adapter), sink)
    async with asyncio.timeout(120):
        await sink.done.wait()
    return sink


def answer(sink: OriginSink) -> str:
    assert not sink.errors, sink.errors
    [(data, _usage)] = sink.results
    return str(data["choices"][0]["message"]["content"])


def refusal(sink: OriginSink) -> tuple[str, str, bool]:
    assert not sink.results
    [error] = sink.errors
    return error


# --- over the real model ------------------------------------------------------------------------


@pytest.mark.timeout(240)
async def test_two_jobs_at_once_fetch_the_adapter_once_and_answer_as_llama_cpp(
        tmp_path, queen, pool) -> None:
    adapter = write_adapter(tmp_path / "made.gguf")
    queen.files["ft.gguf"] = adapter.read_bytes()
    records: list[JobRecord] = []
    models = fine_tuned(pool, tmp_path / "adapters")
    runner = make_runner(pool, models, records)
    fine = ref(queen, "ft.gguf")

    sinks = await asyncio.gather(*(run(runner, queen.origin, {**ASK, "model": FT}, fine,
                                       job_id=f"ft{i}") for i in range(2)))
    base = answer(await run(runner, queen.origin, {**ASK, "model": "smol"}, None,
                            job_id="base"))

    assert queen.gets == ["ft.gguf"]  # two jobs at once, one download
    first, second = (answer(sink) for sink in sinks)
    assert first == second == in_process(adapter)  # as llama.cpp applies that adapter
    assert first != base  # the fine-tuned model, not its base
    cached = tmp_path / "adapters" / f"{fine.file.sha256}.gguf"
    assert cached.read_bytes() == adapter.read_bytes()
    assert pool.adapted() == {FT: "smol"}
    assert models.registered() == {FT: fine.file.sha256}
    # the owner's job records name the fine-tuned model
    assert sorted((r.job_id, r.model, r.outcome) for r in records) == [
        ("base", "smol", "ok"), ("ft0", FT, "ok"), ("ft1", FT, "ok")]

    # a later job reuses the local file: no other request
    assert answer(await run(runner, queen.origin, {**ASK, "model": FT}, fine,
                            job_id="ft2")) == first
    assert queen.gets == ["ft.gguf"]


@pytest.mark.timeout(240)
async def test_a_score_job_with_an_adapter_scores_the_fine_tuned_model(
        tmp_path, queen, pool) -> None:
    queen.files["ft.gguf"] = write_adapter(tmp_path / "made.gguf").read_bytes()
    runner = make_runner(pool, fine_tuned(pool, tmp_path / "adapters"))
    fine = ref(queen, "ft.gguf")
    ask = {**ASK, "max_tokens": 24}
    text = answer(await run(runner, queen.origin, {**ask, "model": FT}, fine))

    async def score(model: str, adapter: AdapterRef | None) -> dict[str, Any]:
        sink = await run(runner, queen.origin, {"model": model, "kind": "chat",
                                                "request": {**ask, "model": model},
                                                "answer": text},
                         adapter, job_id=f"score-{model}", url=SCORE_URL)
        assert not sink.errors, sink.errors
        [(data, _usage)] = sink.results
        return data

    as_fine_tuned, as_base = await score(FT, fine), await score("smol", None)
    # the fine-tuned model's own greedy answer is its argmax nearly everywhere (teacher
    # forcing may flip a near-tie); the base disagrees with it far more often
    misses = as_fine_tuned["argmax"].count(False)
    assert misses <= max(1, as_fine_tuned["answer_tokens"] // 20)
    assert as_base["argmax"].count(False) > misses
    assert as_fine_tuned["logprobs"] != as_base["logprobs"]


# --- a hostile or broken queen ------------------------------------------------------------------


async def test_a_file_that_is_not_the_one_named_is_retryable_and_registers_nothing(
        tmp_path, queen, pool) -> None:
    queen.files["ft.gguf"] = write_adapter(tmp_path / "made.gguf").read_bytes()
    models = fine_tuned(pool, tmp_path / "adapters")
    runner = make_runner(pool, models)
    wrong = ref(queen, "ft.gguf", sha256="0" * 64)
    code, message, retryable = refusal(await run(runner, queen.origin, {**ASK, "model": FT},
                                                 wrong))
    assert (code, retryable) == ("transfer_failed", True)
    assert "not the file the order names" in message
    assert pool.adapted() == {}
    assert models.registered() == {}
    assert list((tmp_path / "adapters").iterdir()) == []  # nothing half-written kept


async def test_an_adapter_of_another_architecture_is_refused_for_good(
        tmp_path, queen, pool) -> None:
    queen.files["qwen.gguf"] = write_adapter(tmp_path / "qwen.gguf", arch="qwen2").read_bytes()
    models = fine_tuned(pool, tmp_path / "adapters")
    runner = make_runner(pool, models)
    hostile = ref(queen, "qwen.gguf")
    code, message, retryable = refusal(await run(runner, queen.origin, {**ASK, "model": FT},
                                                 hostile))
    assert (code, retryable) == ("invalid_adapter", False)
    assert FT in message
    assert "architecture 'qwen2'" in message
    assert pool.adapted() == {}
    assert pool.loaded() == set()
    assert list((tmp_path / "adapters").iterdir()) == []
    # the same file again: refused at once, not fetched again
    again = refusal(await run(runner, queen.origin, {**ASK, "model": FT}, hostile,
                              job_id="j2"))
    assert again[0] == "invalid_adapter"
    assert not again[2]
    assert queen.gets == ["qwen.gguf"]


async def test_a_frame_whose_model_is_not_the_adapters_is_refused_before_any_request(
        tmp_path, queen, pool) -> None:
    queen.files["ft.gguf"] = write_adapter(tmp_path / "made.gguf").read_bytes()
    runner = make_runner(pool, fine_tuned(pool, tmp_path / "adapters"))
    fine = ref(queen, "ft.gguf")
    for model in ("smol", "ft:smol:other:ftjob-zzz"):
        code, message, retryable = refusal(await run(runner, queen.origin,
                                                     {**ASK, "model": model}, fine))
        assert (code, retryable) == ("invalid_request", False)
        assert "disagree" in message
    # an embeddings job takes no adapter
    code, _, retryable = refusal(await run(runner, queen.origin, {"model": FT, "input": "hi"},
                                           fine, url="/v1/embeddings"))
    assert (code, retryable) == ("invalid_request", False)
    assert queen.gets == []


async def test_a_base_not_held_or_served_by_a_group_head_is_refused(
        tmp_path, queen, pool) -> None:
    queen.files["ft.gguf"] = write_adapter(tmp_path / "made.gguf").read_bytes()
    other = AdapterRef(name="ft:big:x:ftjob-1", base="big", file=queen.transfer("ft.gguf"),
                       token=TOKEN)
    runner = make_runner(pool, fine_tuned(pool, tmp_path / "adapters"))
    code, message, retryable = refusal(await run(runner, queen.origin,
                                                 {**ASK, "model": other.name}, other))
    assert (code, retryable) == ("model_not_available", True)
    assert "does not hold big" in message

    grouped = make_runner(pool, fine_tuned(pool, tmp_path / "adapters"),
                          grouped=lambda name: name == "smol")
    code, message, retryable = refusal(await run(grouped, queen.origin, {**ASK, "model": FT},
                                                 ref(queen, "ft.gguf")))
    assert (code, retryable) == ("unsupported", True)
    assert "group's head" in message

    without = make_runner(pool, None)  # a worker that serves no fine-tuned model
    code, _, _ = refusal(await run(without, queen.origin, {**ASK, "model": FT},
                                   ref(queen, "ft.gguf")))
    assert code == "unsupported"
    assert queen.gets == []


# --- the cache's bounds and the quota -----------------------------------------------------------


def adapters(tmp_path: Path, queen: FakeQueen, count: int) -> list[AdapterRef]:
    made = []
    for i in range(count):
        path = write_adapter(tmp_path / f"a{i}.gguf", lora_tensors(seed=i))
        queen.files[f"a{i}.gguf"] = path.read_bytes()
        made.append(ref(queen, f"a{i}.gguf", name=f"ft:smol:n{i}:ftjob-{i}"))
    return made


async def serve(models: FineTunedModels, fine: AdapterRef, origin: str) -> None:
    async with models.serve(fine, origin) as name:
        assert name == fine.name


async def test_past_its_bound_the_cache_evicts_the_least_recently_used_and_forgets_it(
        tmp_path, queen, pool) -> None:
    a0, a1, a2 = adapters(tmp_path, queen, 3)
    models = fine_tuned(pool, tmp_path / "adapters", max_count=2)
    for fine in (a0, a1, a0, a2):  # a0 used again: a1 is the least recently used
        await serve(models, fine, queen.origin)
    assert pool.adapted() == {a0.name: "smol", a2.name: "smol"}
    assert set(models.cache.cached()) == {a0.file.sha256, a2.file.sha256}
    assert sorted(p.name for p in (tmp_path / "adapters").iterdir()) == sorted(
        f"{f.file.sha256}.gguf" for f in (a0, a2))
    assert queen.gets == ["a0.gguf", "a1.gguf", "a2.gguf"]

    # an adapter in use is never evicted: with a1 held, a2 (older) goes for a0
    models = fine_tuned(pool, tmp_path / "fresh", max_count=2)
    await serve(models, a2, queen.origin)
    async with models.serve(a1, queen.origin):
        await serve(models, a0, queen.origin)
        assert set(models.cache.cached()) == {a1.file.sha256, a0.file.sha256}
    assert a2.name not in pool.adapted()


async def test_the_disk_quota_bounds_the_cache(tmp_path, queen, pool) -> None:
    a0, a1 = adapters(tmp_path, queen, 2)
    size = a0.file.size_bytes
    quota = size + size // 2  # room for one adapter, not two

    def room(held_bytes: int) -> int:
        return max(quota - held_bytes, 0)

    models = FineTunedModels(AdapterCache(tmp_path / "adapters", max_bytes=1 << 30,
                                          max_count=8, room_bytes=room), pool)
    await serve(models, a0, queen.origin)
    await serve(models, a1, queen.origin)  # a0 goes to make room under the quota
    assert set(models.cache.cached()) == {a1.file.sha256}
    assert pool.adapted() == {a1.name: "smol"}

    # with a1 in use nothing can go: the next is refused (retryable) and not fetched
    gets = len(queen.gets)
    async with models.serve(a1, queen.origin):
        with pytest.raises(AdapterFailed) as refused:
            await serve(models, a0, queen.origin)
    assert (refused.value.code, refused.value.retryable) == ("insufficient_disk", True)
    assert len(queen.gets) == gets


def test_choose_adapter_evictions_takes_the_oldest_idle_first() -> None:
    files = [CachedAdapter("a", 100, 3.0), CachedAdapter("b", 100, 1.0),
             CachedAdapter("c", 100, 2.0)]
    pick = choose_adapter_evictions
    assert pick(files, incoming_bytes=100, max_bytes=1000, max_count=4, room_bytes=None) == []
    assert pick(files, incoming_bytes=100, max_bytes=1000, max_count=3,
                room_bytes=None) == ["b"]
    assert pick(files, incoming_bytes=100, max_bytes=1000, max_count=3, room_bytes=None,
                in_use={"b"}) == ["c"]
    assert pick(files, incoming_bytes=250, max_bytes=1000, max_count=9,
                room_bytes=60) == ["b", "c"]
    assert pick(files, incoming_bytes=100, max_bytes=250, max_count=9,
                room_bytes=None) == ["b", "c"]


def test_the_hello_offers_lora_unless_every_model_goes_through_a_local_group(
        tmp_path) -> None:
    settings = WorkerSettings(models_dir=tmp_path, key_path=tmp_path / "key")
    assert "lora" in worker_capabilities(settings)
    assert "lora" not in worker_capabilities(settings.model_copy(update={"local_group": 2}))
