"""The cheating workers of ``tests/support/cheats.py`` (issue 16) over the real SmolLM2 GGUF:
each bend really bends (and would fail here if it broke), the requantized model is a smaller,
different file that the cheat announces as the original, and the ``python -m`` runner joins a
real queen as a real worker."""

from __future__ import annotations

import asyncio
import random
import sys
from pathlib import Path
from typing import Any

import pytest

from desktop_worker.engine.llama_model import llama_context
from desktop_worker.engine.pool import ModelPool
from desktop_worker.jobs import JobRunner
from desktop_worker.settings import WorkerSettings
from desktop_worker.store import ModelStore
from desktop_worker.store.gguf_info import read_gguf_info
from desktop_worker.store.hub import sha256_file
from shared_schema import Job
from tests.support.cheats import (
    GARBAGE_MIN_TOKENS,
    SMOLLM2,
    Answer,
    CheatPool,
    ReplayCache,
    Vocab,
    byte_bound,
    chat_text,
    cheat_process,
    cheat_service,
    inflated,
    requantized_model,
    usage_of,
)
from tests.support.hardware_fixtures import fixture_path, recorded_machine
from tests.support.job_sink import RecordingSink
from tests.support.queen import QueenHarness

FRUITS = {"model": "smol", "messages": [{"role": "user", "content": "Name three fruits."}],
          "temperature": 0, "max_tokens": 64}
FRANCE = {"model": "smol", "messages": [{"role": "user", "content": "What is the capital of "
                                         "France? Answer in one sentence."}],
          "temperature": 0, "max_tokens": 40}


@pytest.fixture(scope="module")
def requant(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return requantized_model(tmp_path_factory.mktemp("requant"))


@pytest.fixture
async def pool(tmp_path: Path):
    store = ModelStore(tmp_path / "models")
    store.import_file(SMOLLM2, "smol")
    pool = ModelPool(store.get, max_jobs=1, n_ctx=1024, n_threads=2, budget_mb=4096,
                     contexts=llama_context)
    yield pool
    await pool.close()


async def chat(pool: ModelPool | CheatPool, request: dict[str, Any]
               ) -> tuple[str, str, dict[str, int]]:
    return await chat_text(pool, "smol", request)


# --- requant ---------------------------------------------------------------------------------


def test_the_requantized_model_is_a_smaller_other_file_made_once(requant: Path) -> None:
    assert requant.name == SMOLLM2.name  # imported, it takes the original's name
    assert requant.stat().st_size < SMOLLM2.stat().st_size * 0.95
    assert sha256_file(requant) != sha256_file(SMOLLM2)
    assert read_gguf_info(requant).quant != read_gguf_info(SMOLLM2).quant
    made = requant.stat().st_mtime_ns
    assert requantized_model(requant.parents[1]) == requant
    assert requant.stat().st_mtime_ns == made  # cached, not made again


async def test_the_requantized_model_answers_differently(tmp_path: Path, requant: Path,
                                                         pool: ModelPool) -> None:
    store = ModelStore(tmp_path / "requant-models")
    store.import_file(requant, "smol")
    smaller = ModelPool(store.get, max_jobs=1, n_ctx=1024, n_threads=2, budget_mb=4096,
                        contexts=llama_context)
    try:
        theirs, _, _ = await chat(smaller, FRANCE)
    finally:
        await smaller.close()
    ours, _, _ = await chat(pool, FRANCE)
    assert theirs
    assert ours
    assert theirs != ours


async def test_a_requant_cheat_announces_the_original_and_loads_the_copy(tmp_path: Path) -> None:
    settings = WorkerSettings(models_dir=tmp_path / "models", key_path=tmp_path / "key.pem",
                              key_store="file", gpu_layers=0, n_ctx=1024, threads=2,
                              models=[str(SMOLLM2)])
    service = cheat_service(settings, "requant", requant_dir=tmp_path / "requant",
                            detector=lambda d: recorded_machine(fixture_path("gaming_rtx3060"), d))
    try:
        [model] = await service.prepare(settings.models)
        [announced] = service.store.descriptors(service.pool.loaded())
        loaded = service.pool.resolve(model.name)
    finally:
        await service.pool.close()
    assert announced.name == SMOLLM2.stem
    assert announced.loaded
    assert announced.sha256 == sha256_file(SMOLLM2)
    assert announced.size_bytes == SMOLLM2.stat().st_size
    assert loaded.path.parent.parent == tmp_path / "requant" / announced.sha256[:16]
    assert sha256_file(loaded.path) != announced.sha256
    assert loaded.size_bytes < announced.size_bytes


# --- garbage, through the real job runner ----------------------------------------------------


async def test_garbage_comes_instantly_with_an_honest_looking_length_and_usage(
        tmp_path: Path) -> None:
    settings = WorkerSettings(models_dir=tmp_path / "models", key_path=tmp_path / "key.pem",
                              key_store="file", gpu_layers=0, n_ctx=1024, threads=2)
    service = cheat_service(settings, "garbage", seed=3,
                            detector=lambda d: recorded_machine(fixture_path("gaming_rtx3060"), d))
    runner: JobRunner = service.runner
    try:
        [model] = await service.prepare([str(SMOLLM2)])
        request = {**FRUITS, "model": model.name}
        honest_text, _, honest = await chat_text(service.pool, model.name, request)
        lengths = []
        for job in range(5):
            sink = RecordingSink()
            runner.start(Job(id=f"j{job}", openai_url="/v1/chat/completions",
                             openai_req=request), sink)
            async with asyncio.timeout(30):
                await sink.done.wait()
            [(data, usage)] = sink.results
            choice = data["choices"][0]
            assert choice["finish_reason"] == "stop"
            assert choice["message"]["content"] != honest_text
            assert usage.prompt_tokens == honest["prompt_tokens"]
            assert GARBAGE_MIN_TOKENS <= usage.completion_tokens <= request["max_tokens"]
            lengths.append(usage.completion_tokens)
    finally:
        await service.pool.close()
    assert len(set(lengths)) > 1  # random lengths, not one fixed answer


# --- truncation, inflate, replay -------------------------------------------------------------


async def test_truncation_cuts_the_honest_answer_and_says_stop(pool: ModelPool) -> None:
    honest_text, _, honest = await chat(pool, FRUITS)
    cheat = CheatPool(pool, "truncation", seed=5)
    text, finish, usage = await chat(cheat, FRUITS)
    assert cheat.last is not None
    assert cheat.last.bent
    assert finish == "stop"
    assert text
    assert honest_text.startswith(text)
    assert len(text) < len(honest_text)
    kept = usage["completion_tokens"]
    assert 0.3 * honest["completion_tokens"] - 1 <= kept <= 0.7 * honest["completion_tokens"] + 1
    assert usage["prompt_tokens"] == honest["prompt_tokens"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + kept


async def test_inflate_claims_three_times_the_tokens_of_the_honest_answer(
        pool: ModelPool) -> None:
    honest_text, _, honest = await chat(pool, FRUITS)
    cheat = CheatPool(pool, "inflate")
    text, _finish, usage = await chat(cheat, FRUITS)
    assert text == honest_text
    # Three times the true count, or the queen's byte bound where that is less (the most the
    # queen would believe): either way more than the answer holds.
    claimed = min(3 * honest["completion_tokens"], byte_bound(text, FRUITS))
    assert usage["completion_tokens"] == claimed
    assert claimed > honest["completion_tokens"]
    assert usage["total_tokens"] == honest["prompt_tokens"] + usage["completion_tokens"]


def test_an_inflated_claim_stops_at_the_byte_bound() -> None:
    honest = Answer("1 2", "stop", usage_of(10, 3))
    assert byte_bound("1 2", {"stop": ["END", "\n"]}) == 3 + 3 + 1
    claimed = inflated(honest, {}).usage["completion_tokens"]
    assert claimed == 4  # 3 bytes + the end token, not 9
    assert inflated(honest, {"stop": "STOP"}).usage["completion_tokens"] == 8
    assert not inflated(Answer("a", "stop", usage_of(1, 1)), {}, factor=1).bent


async def test_replay_serves_another_prompts_answer(pool: ModelPool) -> None:
    cheat = CheatPool(pool, "replay", seed=1)
    first, _, _ = await chat(cheat, FRUITS)
    assert cheat.last is not None
    assert not cheat.last.bent
    again, _, _ = await chat(cheat, FRUITS)
    assert cheat.last is not None
    assert not cheat.last.bent
    _, _, honest = await chat(pool, FRANCE)
    text, finish, usage = await chat(cheat, FRANCE)
    assert cheat.last is not None
    assert cheat.last.bent
    assert text == first == again
    assert finish == "stop"
    assert usage["prompt_tokens"] == honest["prompt_tokens"]  # this prompt's count


def test_the_replay_cache_is_small_and_never_answers_a_prompt_with_its_own() -> None:
    cache, rng = ReplayCache(size=2), random.Random(0)
    assert cache.other_than("a", rng) is None
    for key in "abc":
        cache.remember(key, Answer(key, "stop", usage_of(1, 1)))
    assert len(cache) == 2
    picks = {cache.other_than("b", rng).text for _ in range(20)}  # type: ignore[union-attr]
    assert picks == {"c"}  # "a" was evicted, "b" is the prompt itself


async def test_answers_it_cannot_bend_are_served_honestly(pool: ModelPool) -> None:
    cheat = CheatPool(pool, "garbage")
    honest_text, _, _ = await chat(pool, FRUITS)
    text, _, _ = await chat(cheat, {**FRUITS, "logprobs": True})
    assert text == honest_text
    assert cheat.last is None
    with pytest.raises(ValueError, match="unknown cheat"):
        CheatPool(pool, "polite")


def test_the_vocabulary_counts_a_prompt_as_the_engine_does() -> None:
    vocab = Vocab(SMOLLM2)
    assert vocab.ordinary
    assert all(0 <= t < vocab.llama.n_vocab() for t in vocab.ordinary[:5])
    assert len(vocab.ordinary) < vocab.llama.n_vocab()  # control and end tokens left out
    assert vocab.detokenize(vocab.tokenize("Hello there, world")) == "Hello there, world"
    assert vocab.prompt_tokens("completions", {"prompt": [1, 2, 3]}) == 3


# --- the runner, against a real queen --------------------------------------------------------


@pytest.mark.timeout(120)
async def test_the_runner_joins_a_queen_announcing_the_original(tmp_path: Path,
                                                                queen: QueenHarness) -> None:
    proc = cheat_process(tmp_path, queen.port, "requant", [str(SMOLLM2)], "--threads", "1",
                         "--ctx", "1024")
    assert proc.args[:3] == [sys.executable, "-m", "tests.support.cheats"]
    proc.start()
    try:
        await queen.wait_until(lambda: any(SMOLLM2.stem in w.loaded for w in queen.state.registry),
                               timeout_s=90, what="the cheat to join")
        [worker] = list(queen.state.registry)
        assert worker.models[SMOLLM2.stem].sha256 == sha256_file(SMOLLM2)
    finally:
        proc.stop()
    assert "requant-Q2_K" in "".join(p.name for p in (tmp_path / "requant-cache").rglob("*"))
