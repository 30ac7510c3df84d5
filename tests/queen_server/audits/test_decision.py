"""The audits' decision rule, on simulated score streams: an honest worker is (almost) never
flagged, each cheat is flagged within a few jobs, and one unlucky job flags nobody."""

from __future__ import annotations

import random

import pytest

from queen_server.audits.decision import (
    HonestBands,
    JobScore,
    SprtParams,
    Standing,
    Verdict,
    audit_rate,
    judge,
)

PARAMS = SprtParams()


def honest(rng: random.Random, temperature: float, tokens: int = 40) -> JobScore:
    """A synthetic honest score: greedy answers are the top choice nearly everywhere; sampled
    ones have a mean log-probability around -1.2 (at temperature 1) or -0.6 (at 0.7)."""
    if temperature == 0:
        argmax = [rng.random() > 0.01 for _ in range(tokens)]
        logprobs = [rng.uniform(-0.5, 0.0) for _ in range(tokens)]
    else:
        centre = -1.2 if temperature >= 1 else -0.6
        logprobs = [min(0.0, rng.gauss(centre, 1.0)) for _ in range(tokens)]
        argmax = [rng.random() < 0.6 for _ in range(tokens)]
    return JobScore(temperature, tokens, logprobs, argmax, tokens)


def garbage(rng: random.Random, temperature: float, tokens: int = 40) -> JobScore:
    return JobScore(temperature, tokens, [rng.uniform(-12, -6) for _ in range(tokens)],
                    [rng.random() < 0.02 for _ in range(tokens)], tokens)


def inflated(rng: random.Random, temperature: float) -> JobScore:
    score = honest(rng, temperature)
    return JobScore(score.temperature, score.answer_tokens, score.logprobs, score.argmax,
                    3 * score.answer_tokens)


@pytest.fixture(scope="module")
def bands() -> HonestBands:
    rng = random.Random(1)
    return HonestBands.learn(honest(rng, t) for t in (0.0, 0.7, 1.0) for _ in range(2000))


def run(bands: HonestBands, make, jobs: int, seed: int) -> Standing:
    rng = random.Random(seed)
    standing = Standing()
    for _ in range(jobs):
        standing = standing.after(judge(make(rng, rng.choice((0.0, 0.7, 1.0))), bands), PARAMS)
        if standing.state == "flagged":
            break
    return standing


def test_honest_workers_are_not_flagged_over_a_thousand_jobs(bands):
    flagged = sum(run(bands, honest, 1000, seed).state == "flagged" for seed in range(200))
    assert flagged <= 1  # < 1 % of 200 honest workers, each audited 1,000 times


@pytest.mark.parametrize("cheat", [garbage, inflated])
def test_each_cheat_is_flagged_within_twenty_jobs(bands, cheat):
    runs = [run(bands, cheat, 20, seed) for seed in range(200)]
    assert all(standing.state == "flagged" for standing in runs)
    assert max(standing.audited for standing in runs) <= 20


def test_one_unlucky_job_flags_nobody():
    standing = Standing().after(Verdict(True, "unlucky"), PARAMS)
    assert standing.state == "unknown"
    assert standing.reasons == ("unlucky",)
    for _ in range(15):  # each pass takes back a fifth of what one failure added
        standing = standing.after(Verdict(False), PARAMS)
    assert standing.state == "good"
    assert standing.llr == PARAMS.lower  # held at the boundary


def test_a_good_worker_that_turns_is_flagged_and_an_admin_can_clear_it():
    standing = Standing()
    for _ in range(20):
        standing = standing.after(Verdict(False), PARAMS)
    assert standing.state == "good"
    while standing.state != "flagged":
        standing = standing.after(Verdict(True, "garbage"), PARAMS)
    assert standing.failed <= 6  # from the lower boundary: a handful of failures
    assert standing.after(Verdict(False), PARAMS).state == "flagged"  # stays until cleared
    assert standing.cleared().state == "unknown"


def test_usage_past_the_auditors_count_fails_even_a_perfect_answer(bands):
    perfect = JobScore(0.0, 30, [0.0] * 30, [True] * 30, 30)
    assert not judge(perfect, bands).failed
    assert judge(JobScore(0.0, 30, [0.0] * 30, [True] * 30, 90), bands).failed
    assert not judge(JobScore(0.0, 30, [0.0] * 30, [True] * 30, 31), bands).failed  # end token


def test_greedy_answers_that_are_not_the_top_choice_fail(bands):
    rng = random.Random(5)
    other_model = JobScore(0.0, 40, [rng.uniform(-3, 0) for _ in range(40)],
                           [rng.random() < 0.7 for _ in range(40)], 40)
    verdict = judge(other_model, bands)
    assert verdict.failed
    assert "top choice" in verdict.reason


def test_the_audit_rate_is_high_for_new_workers_and_rises_with_drift():
    new = Standing()
    assert audit_rate(new, in_escrow=True) == 0.8
    good = Standing(llr=PARAMS.lower, audited=50, state="good")
    assert audit_rate(good, in_escrow=False) == pytest.approx(0.03)
    drifting = Standing(llr=0.0, audited=60, state="good")
    assert 0.03 < audit_rate(drifting, in_escrow=False) < 0.8
    assert audit_rate(Standing(state="flagged"), in_escrow=False) == 0.0


def test_bad_parameters_are_refused():
    with pytest.raises(ValueError, match="p0"):
        SprtParams(p0=0.6, p1=0.5)
