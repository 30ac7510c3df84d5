"""The audits' decision rule, on simulated score streams: an honest worker is (almost) never
flagged, each cheat is flagged within a few jobs, and one unlucky job flags nobody. (Real
scores from real SmolLM2 runs drive ``bench/trust.py``; these tests pin the rule itself.)"""

from __future__ import annotations

import math
import random

import pytest

from queen_server.audits.decision import (
    CLIP,
    DEFAULT_BANDS,
    FOREIGN_MIN_TOKENS,
    MIN_ACCUSERS,
    PROMPT_SLACK_TOKENS,
    TOKEN_CLIP,
    USAGE_SLACK,
    Band,
    EndScore,
    HonestBands,
    JobScore,
    SprtParams,
    Standing,
    Verdict,
    audit_rate,
    censoring_point,
    enough_accusers,
    judge,
    not_the_models,
    prompt_allowance,
    score_job,
)

PARAMS = SprtParams()
TEMPERATURES = (0.0, 0.7, 1.0)


def sampled_job(rng: random.Random, temperature: float, z: float, tokens: int = 40,
                claimed: int | None = None) -> JobScore:
    """A sampled job whose standardised log-likelihood is ``z``."""
    variance = tokens * rng.uniform(0.5, 2.0)
    return JobScore(temperature, tokens, tokens if claimed is None else claimed, tokens, 0,
                    z * math.sqrt(variance), variance)


def greedy_job(mismatches: int, tokens: int = 40, claimed: int | None = None) -> JobScore:
    return JobScore(0.0, tokens, tokens if claimed is None else claimed, tokens, mismatches)


def honest(rng: random.Random, temperature: float) -> JobScore:
    if temperature == 0:  # a near-tie flipped now and then
        return greedy_job(sum(rng.random() < 0.005 for _ in range(40)))
    return sampled_job(rng, temperature, rng.gauss(0.0, 1.0))


def garbage(rng: random.Random, temperature: float) -> JobScore:
    if temperature == 0:
        return greedy_job(38)
    return sampled_job(rng, temperature, rng.gauss(-40.0, 5.0))


def other_model(rng: random.Random, temperature: float) -> JobScore:
    """A smaller model's answers: a few clear misses when greedy, a shifted z when sampled."""
    if temperature == 0:
        return greedy_job(sum(rng.random() < 0.1 for _ in range(40)))
    return sampled_job(rng, temperature, rng.gauss(-2.5, 1.0))


def inflated(rng: random.Random, temperature: float) -> JobScore:
    score = honest(rng, temperature)
    return JobScore(score.temperature, score.answer_tokens, 3 * score.answer_tokens,
                    score.positions, score.mismatches, score.deviation, score.variance)


@pytest.fixture(scope="module")
def bands() -> HonestBands:
    rng = random.Random(1)
    return HonestBands.learn(honest(rng, t) for t in TEMPERATURES for _ in range(2000))


def run(bands: HonestBands, make, jobs: int, seed: int) -> Standing:
    rng = random.Random(seed)
    standing = Standing()
    for _ in range(jobs):
        standing = standing.after(judge(make(rng, rng.choice(TEMPERATURES)), bands), PARAMS)
        if standing.state == "flagged":
            break
    return standing


def test_learned_bands_match_the_honest_runs(bands):
    sampled = bands.for_temperature(0.7)
    assert abs(sampled.z_mean) < 0.1
    assert 0.9 < sampled.z_sd < 1.1
    assert bands.for_temperature(0.0).mismatch_rate < 0.02
    assert HonestBands.from_dict(bands.to_dict()) == bands


def test_honest_workers_are_not_flagged_over_a_thousand_jobs(bands):
    flagged = sum(run(bands, honest, 1000, seed).state == "flagged" for seed in range(200))
    assert flagged <= 1  # < 1 % of 200 honest workers, each audited 1,000 times


@pytest.mark.parametrize("cheat", [garbage, other_model, inflated])
def test_each_cheat_is_flagged_within_twenty_jobs(bands, cheat):
    runs = [run(bands, cheat, 20, seed) for seed in range(200)]
    assert sum(standing.state == "flagged" for standing in runs) >= 198


def test_one_unlucky_job_flags_nobody():
    worst = Verdict(CLIP, True, "unlucky")
    standing = Standing().after(worst, PARAMS)
    assert standing.state == "unknown"
    assert standing.reasons == ("unlucky",)
    for _ in range(20):
        standing = standing.after(Verdict(0.0), PARAMS)
    assert standing.state == "good"
    assert standing.llr == PARAMS.lower  # held at the boundary


def test_a_clip_that_would_flag_on_one_job_is_refused():
    with pytest.raises(ValueError, match="one job"):
        SprtParams(delta=3.0)


def test_a_good_worker_that_turns_is_flagged_and_an_admin_can_clear_it():
    standing = Standing()
    for _ in range(20):
        standing = standing.after(Verdict(0.0), PARAMS)
    assert standing.state == "good"
    while standing.state != "flagged":
        standing = standing.after(Verdict(CLIP, True, "garbage"), PARAMS)
    assert standing.failed <= 4  # from the lower boundary: a handful of failures
    assert standing.after(Verdict(0.0), PARAMS).state == "flagged"  # stays until cleared
    assert standing.cleared().state == "unknown"


def test_a_job_that_says_nothing_is_counted_but_moves_nothing():
    standing = Standing().after(Verdict(None, False, "only the usage was checked"), PARAMS)
    assert standing.audited == 1
    assert standing.llr == 0.0


def test_usage_past_the_auditors_count_fails_even_a_perfect_answer(bands):
    assert not judge(greedy_job(0, claimed=30, tokens=30), bands).failed
    verdict = judge(greedy_job(0, claimed=90, tokens=30), bands)
    assert verdict.failed
    assert verdict.suspicion == CLIP
    assert not verdict.ambiguous  # a proof: it weighs in full
    assert "counted 30" in verdict.reason
    assert not judge(greedy_job(0, claimed=31, tokens=30), bands).failed  # the end token


def test_a_false_length_finish_fails(bands):
    cut = JobScore(0.7, 20, 20, 20, 0, 0.0, 20.0, finish_reason="length", max_tokens=128)
    assert judge(cut, bands).failed
    whole = JobScore(0.7, 120, 128, 120, 0, 0.0, 120.0, finish_reason="length", max_tokens=128)
    assert not judge(whole, bands).failed


def test_greedy_answers_that_are_not_the_top_choice_fail(bands):
    verdict = judge(greedy_job(8), bands)
    assert verdict.failed
    assert "top choice" in verdict.reason
    assert not judge(greedy_job(1), bands).failed


def test_a_greedy_answer_served_for_a_sampled_request_is_too_sure(bands):
    verdict = judge(sampled_job(random.Random(2), 1.0, 9.0), bands)
    assert verdict.failed
    assert "not sampled" in verdict.reason


def test_uncomparable_and_short_answers_are_judged_on_usage_only(bands):
    constrained = JobScore(1.0, 40, 40, 40, 0, -400.0, 40.0, comparable=False)
    assert judge(constrained, bands).suspicion is None
    assert judge(greedy_job(3, tokens=3), bands).suspicion is None


def test_score_job_reads_the_auditors_numbers():
    score = score_job(
        temperature=0.7, claimed_completion_tokens=3,
        logprobs=[-0.1, -2.0, -0.2], best_logprobs=[-0.1, -0.1, -0.2],
        sampled=([-0.2, -2.5, -0.3], [-0.4, -0.5, -0.4], [0.2, 0.3, 0.1]),
        end=EndScore(-0.05, -0.05, (-0.1, -0.2, 0.05)))
    assert score.positions == 3
    assert score.mismatches == 1
    assert score.deviation == pytest.approx(0.2 - 2.0 + 0.1)
    assert score.variance == pytest.approx(0.6)
    assert score.end_gap == pytest.approx(0.0)
    assert score.end_logprob == pytest.approx(-0.1)


def test_one_absurd_token_weighs_at_most_token_clip():
    score = score_job(temperature=1.0, claimed_completion_tokens=2, logprobs=[-12.0, -0.1],
                      best_logprobs=[-0.1, -0.1],
                      sampled=([-12.0, -1.0], [-1.0, -1.0], [1.0, 1.0]))
    assert score.deviation == pytest.approx(-TOKEN_CLIP)


def test_an_answer_cut_short_ends_where_the_model_would_go_on(bands):
    greedy = JobScore(0.0, 30, 30, 30, 0, end_gap=20.0)
    verdict = judge(greedy, bands)
    assert verdict.failed
    assert "would go on" in verdict.reason
    sampled = JobScore(0.7, 30, 30, 30, 0, 0.0, 30.0, end_logprob=-15.0)
    assert judge(sampled, bands).failed
    assert not judge(JobScore(0.7, 30, 30, 30, 0, 0.0, 30.0, end_logprob=-2.5), bands).failed
    assert not judge(JobScore(0.0, 30, 30, 30, 0, end_gap=0.2), bands).failed


def test_default_bands_cover_both_kinds():
    assert DEFAULT_BANDS.for_temperature(0.0).temperature == 0.0
    assert DEFAULT_BANDS.for_temperature(1.3).z_sd > 1.0
    only_sampled = HonestBands((DEFAULT_BANDS.for_temperature(0.7),))
    assert only_sampled.for_temperature(0.0).temperature == 0.0  # never a sampled band


def test_the_audit_rate_is_high_for_new_workers_and_rises_with_drift():
    assert audit_rate(Standing(), in_escrow=True) == 0.8
    good = Standing(llr=PARAMS.lower, audited=50, state="good")
    assert audit_rate(good, in_escrow=False) == pytest.approx(0.03)
    drifting = Standing(llr=0.0, audited=60, state="good")
    assert 0.03 < audit_rate(drifting, in_escrow=False) < 0.8
    assert audit_rate(Standing(state="flagged"), in_escrow=False) == 0.0


def test_bad_bands_are_refused():
    with pytest.raises(ValueError, match="positive z_sd"):
        HonestBands.from_dict({"bands": [{"temperature": 0.7, "z_sd": 0}]})
    with pytest.raises(ValueError, match="not a bands object"):
        HonestBands.from_dict({"nope": 1})


def test_clustered_greedy_mismatches_learn_a_dispersion():
    clean = [greedy_job(0, tokens=100) for _ in range(40)]
    clustered = [*clean, greedy_job(12, tokens=100)]  # one word re-tokenised badly
    plain, spread = HonestBands.learn(clean), HonestBands.learn(clustered)
    assert plain.for_temperature(0).mismatch_dispersion == 1.0
    assert spread.for_temperature(0).mismatch_dispersion > 5
    # The same clustered answer weighs less against the bands that know clusters happen.
    assert judge(greedy_job(4, tokens=100), spread).suspicion < \
        judge(greedy_job(4, tokens=100), plain).suspicion


# --- the prompt's count -----------------------------------------------------------------------

def prompt_claim(claimed: int, counted: int = 100, *, temperature: float = 0.0) -> JobScore:
    """An otherwise honest job whose worker claimed ``claimed`` prompt tokens."""
    base = greedy_job(0) if temperature == 0 else sampled_job(random.Random(3), temperature, 0.0)
    return JobScore(base.temperature, base.answer_tokens, base.claimed_completion_tokens,
                    base.positions, base.mismatches, base.deviation, base.variance,
                    prompt_tokens=counted, claimed_prompt_tokens=claimed)


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_a_prompt_claim_up_to_the_allowance_passes_and_one_above_fails(bands, temperature):
    allowance = 100 + round(100 * USAGE_SLACK) + PROMPT_SLACK_TOKENS
    assert prompt_allowance(100) == allowance == 118
    for honest_claim in (0, 100, allowance):  # the count, and the count with its slack
        verdict = judge(prompt_claim(honest_claim, temperature=temperature), bands)
        assert not verdict.failed, verdict.reason
        assert verdict.suspicion is not None
        assert verdict.suspicion < CLIP
    over = judge(prompt_claim(allowance + 1, temperature=temperature), bands)
    assert over == Verdict(CLIP, True, f"claimed {allowance + 1} prompt tokens; the auditor "
                                       "counted 100")


def test_the_prompt_inflater_claiming_the_byte_bound_fails_every_audit_and_is_flagged(bands):
    # A short English prompt: the byte bound (its bytes, its role, 8 tokens a message and the
    # 64-token template allowance) is several times the rendered prompt's count.
    rng = random.Random(4)
    standing = Standing()
    for job in range(2):
        score = honest(rng, TEMPERATURES[job % 3])
        inflated = JobScore(score.temperature, score.answer_tokens,
                            score.claimed_completion_tokens, score.positions, score.mismatches,
                            score.deviation, score.variance, prompt_tokens=31,
                            claimed_prompt_tokens=108)
        verdict = judge(inflated, bands)
        assert verdict.failed
        assert verdict.suspicion == CLIP
        standing = standing.after(verdict, PARAMS)
    assert standing.state == "flagged"


def test_a_grammar_does_not_hide_a_prompt_claim(bands):
    constrained = JobScore(1.0, 40, 40, 40, 0, -400.0, 40.0, comparable=False,
                           prompt_tokens=20, claimed_prompt_tokens=200)
    assert judge(constrained, bands).failed


def test_a_score_with_no_prompt_counts_checks_no_prompt(bands):
    assert not judge(JobScore(0.0, 40, 40, 40, 0, claimed_prompt_tokens=10_000), bands).failed
    assert not judge(JobScore(0.0, 40, 40, 40, 0, prompt_tokens=1), bands).failed


def test_two_accusers_hold_the_test_at_its_line_and_a_third_or_a_trusted_one_flags():
    """Issue 39's Sybil pair: failing verdicts from two untrusted keys never flag; the test is
    held at its upper line, so the next failing verdict from a new accuser (or a trusted
    one) flags at once."""
    params = SprtParams()
    failing = Verdict(CLIP, True, "a failing answer")
    standing = Standing()
    for _ in range(20):
        standing = standing.after(failing, params,
                                  may_flag=enough_accusers({"a", "b"}, trusted=False))
    assert standing.state == "unknown"
    assert standing.llr == params.upper
    assert standing.failed == 20
    assert standing.after(failing, params,
                          may_flag=enough_accusers({"a", "b", "c"}, trusted=False)
                          ).state == "flagged"
    assert standing.after(failing, params, may_flag=enough_accusers((), trusted=True)
                          ).state == "flagged"
    honest = Verdict(-1.0, False, "")
    assert standing.after(honest, params, may_flag=False).llr < params.upper


def test_accusers_are_counted_once_each():
    assert MIN_ACCUSERS == 3
    assert not enough_accusers(["a", "a", "b", "b"], trusted=False)
    assert enough_accusers(["a", "b", "c"], trusted=False)


# --- one pathological honest job against a cheat's (Huber's censored test) --------------------

# The greedy band learned from 1,002 real SmolLM2 jobs (bench/data/smollm2_bands.json).
SMOLLM2_GREEDY = HonestBands((Band(0.0, mismatch_rate=0.002, mismatch_dispersion=7.16),
                              Band(1.0, z_mean=-0.16, z_sd=1.04, z_max=3.33)))
# An honest worker's real greedy answer (trust_scores.json.gz, "Who wrote Romeo and Juliet?"):
# generated " tragic"+"o", re-tokenised " trag"+"ico" by the auditor, three times in the
# answer; each time a clear miss and near-ties tipped the other way for a few tokens.
TRAGICO = JobScore(0.0, 116, 116, 116, 14)


def stream(verdicts, params: SprtParams = PARAMS) -> Standing:
    standing = Standing()
    for verdict in verdicts:
        standing = standing.after(verdict, params)
        if standing.state == "flagged":
            break
    return standing


def test_censoring_point_solves_hubers_equation():
    for delta, eps in ((1.0, 0.01), (1.0, 0.001), (1.5, 0.02)):
        c = censoring_point(delta, eps)
        t = (c + delta ** 2 / 2) / delta
        phi = 0.5 * math.erfc(-t / math.sqrt(2))
        tail = 0.5 * math.erfc((t - delta) / math.sqrt(2))
        assert (1 - eps) * (phi + math.exp(-c) * tail) == pytest.approx(1.0, abs=1e-9)
    assert censoring_point(1.0, 0.01) == pytest.approx(1.58, abs=0.01)
    assert censoring_point(1.0, 0.001) > censoring_point(1.0, 0.01) > censoring_point(1.0, 0.1)
    assert censoring_point(1.0, 0.0) == math.inf
    assert PARAMS.job_cap == censoring_point(1.0, 0.01)
    with pytest.raises(ValueError, match="contamination"):
        SprtParams(contamination=1.0)


def test_only_ambiguous_evidence_is_censored():
    assert PARAMS.step(CLIP, ambiguous=True) == PARAMS.job_cap
    assert PARAMS.step(CLIP) == CLIP - 0.5
    assert PARAMS.step(-CLIP, ambiguous=True) == -CLIP - 0.5  # good evidence is not censored
    uncensored = SprtParams(contamination=0.0)
    assert uncensored.step(CLIP, ambiguous=True) == uncensored.step(CLIP)
    standing = Standing().after(Verdict(CLIP, True, "scores", ambiguous=True), PARAMS)
    assert standing.llr == PARAMS.job_cap


def test_an_honest_re_tokenised_answer_fails_but_cannot_flag_its_worker_by_recurring():
    verdict = judge(TRAGICO, SMOLLM2_GREEDY)
    assert verdict.failed  # per job it looks like a cheat's
    assert verdict.suspicion == CLIP
    assert verdict.ambiguous
    # Served and audited four times in a row by a new worker: before, two flagged it.
    assert stream([verdict] * 2, SprtParams(contamination=0.0)).state == "flagged"
    held = stream([verdict] * 4)
    assert held.state == "unknown"
    assert held.llr < PARAMS.upper
    # Then its ordinary answers clear it.
    clean = judge(JobScore(0.0, 60, 60, 60, 0), SMOLLM2_GREEDY)
    assert stream([verdict] * 4 + [clean] * 30).state == "good"


@pytest.mark.parametrize("answer", [
    greedy_job(38),  # every token garbage: one run as long as the answer
    JobScore(1.0, 40, 40, 40, 0, -4.0 * 40, 40.0),  # sampled garbage, each token at the clip
])
def test_garbage_weighs_in_full_however_it_runs(answer):
    """A cheat cannot pass its garbage off as one long re-tokenisation: an answer that is
    mostly not the model's text is no honest accident, and two flag."""
    assert not_the_models(answer)
    verdict = judge(answer, SMOLLM2_GREEDY)
    assert verdict.failed
    assert not verdict.ambiguous
    standing = stream([verdict] * 2)
    assert standing.state == "flagged"
    assert standing.audited == 2


@pytest.mark.parametrize("answer", [
    TRAGICO,  # a cheat whose every answer misses like the honest re-tokenised one
    greedy_job(19, tokens=40),  # garbage kept to just under half of each answer
    JobScore(1.0, 40, 40, 40, 0, -1.9 * 40, 40.0),  # a shifted model, just above the line
])
def test_a_cheat_that_keeps_its_evidence_ambiguous_is_still_flagged_within_a_few_jobs(answer):
    """What the censoring relaxes, played by the cheat: each job weighs at most ``job_cap``,
    so a cheat whose every answer fails on its scores is flagged after ``upper / job_cap``
    jobs (5) instead of 2, never later."""
    assert not not_the_models(answer)
    verdict = judge(answer, SMOLLM2_GREEDY)
    assert verdict.failed
    assert verdict.ambiguous
    standing = stream([verdict] * 20)
    assert standing.state == "flagged"
    assert standing.audited == math.ceil(PARAMS.upper / PARAMS.job_cap) == 5


def test_a_short_answer_is_never_mostly_foreign():
    """A re-tokenised made-up word in a short answer can be most of it: below
    ``FOREIGN_MIN_TOKENS`` positions the evidence stays ambiguous."""
    short = greedy_job(FOREIGN_MIN_TOKENS - 1, tokens=FOREIGN_MIN_TOKENS - 1)
    assert not not_the_models(short)
    assert judge(short, SMOLLM2_GREEDY).ambiguous
    assert not_the_models(greedy_job(FOREIGN_MIN_TOKENS, tokens=FOREIGN_MIN_TOKENS))
    half = greedy_job(20, tokens=40)  # exactly half is not "most"
    assert not not_the_models(half)


@pytest.mark.parametrize("cheat", [garbage, other_model, inflated])
def test_a_good_worker_that_turns_is_flagged_within_twenty_audited_jobs(bands, cheat):
    for seed in range(50):
        rng = random.Random(seed)
        standing = Standing(PARAMS.lower, 100, 0, "good")  # held at the lower line
        for _ in range(20):
            standing = standing.after(judge(cheat(rng, rng.choice(TEMPERATURES)), bands),
                                      PARAMS)
        assert standing.state == "flagged", (cheat.__name__, seed)
