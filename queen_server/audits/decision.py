"""The audits' decision rule: how suspicious an audited answer is, and when a worker is flagged.

An auditor re-scores a delivered answer (the worker's ``score`` job: one teacher-forced pass of
prompt plus answer under the same model file) and returns, per delivered token, what the model
thinks of it. The queen folds that into one ``JobScore`` per job:

* **Greedy answers** (temperature 0): an honest worker's every token is the model's top choice,
  so the evidence is the count of *mismatches* (a delivered token more than ``near_tie`` nats
  below the top choice: another machine's arithmetic can flip a near-tie, never a clear miss).
* **Sampled answers** (temperature > 0): for each delivered token the auditor gives its
  log-probability ``lp`` at the request's temperature and, under the distribution the honest
  sampler really draws from (top-k, top-p, min-p, temperature), its expectation ``mu`` and
  variance. Honestly sampled tokens make ``sum(lp - mu)`` a martingale with mean 0 and variance
  ``sum(var)``, so ``z = sum(lp - mu) / sqrt(sum(var))`` is close to a standard normal whatever
  the prompt; a different model, garbage or text made for another prompt drives it far below 0,
  and greedy text served for a sampled request (a replay) far above.
* When the answer ended by the model's own choice (``finish_reason`` "stop" with no stop
  string), the end is checked on its own: a truncated answer ends where the model would not
  (greedy: ending far below the top choice; sampled: ending at odds under 1 in 1,000).
* The exact usage: a worker's claimed completion tokens against the auditor's count, its
  claimed prompt tokens against the auditor's count of the prompt as the model's template
  renders it, and an answer that claims it hit ``max_tokens`` with far fewer tokens.

``HonestBands`` is what honest runs of the same file look like at each temperature (learned by
``HonestBands.learn`` from real runs; ``DEFAULT_BANDS`` otherwise): the mismatch rate of greedy
answers, and the mean and spread of ``z`` for sampled ones, so that each job's *suspicion* is a
standardised number (``judge``): about N(0, 1) for an honest worker, clipped to ``±CLIP``, and
``CLIP`` for a job that is certainly wrong (usage, length).

A single job flags nobody. Jobs combine per worker in Wald's sequential probability ratio test
(``SprtParams``, ``Standing``) between "honest" (suspicion ~ N(0, 1)) and "cheating" (~ N(delta,
1)): each job adds ``delta * s - delta**2 / 2``; the worker is flagged when the sum crosses
``log((1 - beta) / alpha)``, and is in good standing when it falls below ``log(beta / (1 -
alpha))``, where it is held so that evidence can build again if the worker turns. ``alpha``
bounds the false-flag rate, ``beta`` the missed cheats; with ``CLIP`` below the flag line no
single job, however unlucky, can flag a worker.

Honest scores are not N(0, 1) in the tail: about 1 % of honest answers score like a cheat's
(real SmolLM2 runs), mostly where the auditor's tokenization of the delivered text differs from
the worker's (" tragic"+"o" generated, " trag"+"ico" re-tokenised: a miss, then near-ties tipped
the other way for a few tokens, again at each use of the word), and no reading of one job's
scores tells such an answer from a smaller model's. So a job whose evidence is its scores is
``Verdict.ambiguous`` and weighs at most ``SprtParams.job_cap`` in the test: Huber's censored
probability ratio test for a share ``contamination`` of honest jobs that may score anyhow
(``censoring_point``). Evidence no honest answer gives weighs in full: usage past the counts, a
false "length", a broken format, an end the model would not make, an answer far surer than
sampling, and an answer that is mostly not the model's text (``not_the_models``: garbage, text
for another prompt). ``audit_rate`` audits most of a new worker's jobs and a few percent of an
established one's, more as its test drifts. Everything here is pure: the audit service feeds it
and acts on its answers.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

State = Literal["unknown", "good", "flagged"]

CLIP = 4.0  # the most one job can weigh, either way (in standard deviations)
NEAR_TIE = 0.5  # nats: a greedy token this close to the top choice is a near-tie, not a miss
MIN_TOKENS = 4  # shorter answers say too little to be judged on their scores
USAGE_SLACK = 0.1  # re-tokenising a text can count a few tokens differently than generating it
# Tokens a prompt claim may exceed the auditor's count by, beyond ``USAGE_SLACK``. An honest
# worker and its auditor build the prompt with the same code (``engine.llama_model``'s chat
# template and tokenizer: ``_chat_prompt`` and ``_completion_tokens`` serve generation and
# scoring alike), so on one build and one file they count it alike. What can still differ: a
# template's date line (``strftime_now`` on each machine's own clock and time zone: a day's
# digits), whether BOS is counted, and another llama.cpp build's pre-tokenizer.
PROMPT_SLACK_TOKENS = 8
LENGTH_SHARE = 0.75  # an answer that "hit max_tokens" has at least this share of them
# The most one token can weigh below its expectation (nats). Re-tokenising delivered text can
# split it differently than the worker sampled it, which now and then makes one honest token
# look absurd (-7 to -12 in real SmolLM2 runs); a cheat's evidence is many bad tokens, not one.
TOKEN_CLIP = 4.0
# An answer the model itself ended: greedy, ending was the top choice (within this many nats);
# sampled, ending had at least this log-probability (1 in 1,000). Honest SmolLM2 answers ended
# within 0.3 nats of the top (greedy) and above -3 (sampled); truncated ones 20 nats below the
# top and below -7.
END_GAP = 3.0
END_FLOOR = -6.9
# An answer that is mostly not the model's text: more than half of a greedy answer's positions
# are clear misses, or a sampled answer's tokens sit on average more than TOKEN_CLIP / 2 nats
# below expectation, over at least this many positions (``not_the_models``). Real SmolLM2 runs
# (1,702 honest jobs): honest answers at most 12 % misses and -0.9 nats a token (a re-tokenised
# word touches a few tokens); garbage and a shape-picker's garbage 89-100 % and -2.7 to -4; a
# requantised model 3-45 % and -1.1 at worst, another prompt's answer 36-58 % and -1.0 (those
# under the line weigh as ambiguous: a few more jobs to their flag).
FOREIGN_MIN_TOKENS = 8


@dataclass(frozen=True, slots=True)
class JobScore:
    """One audited job, as the queen reads the auditor's scores (see ``score_job``)."""

    temperature: float
    answer_tokens: int  # as the auditor tokenized the delivered text
    claimed_completion_tokens: int  # what the audited worker reported
    positions: int = 0  # positions judged (answer tokens, and the end when it counts)
    mismatches: int = 0  # greedy: positions where the delivered token was clearly not the top
    deviation: float = 0.0  # sampled: sum(lp - mu)
    variance: float = 0.0  # sampled: sum(var)
    finish_reason: str = "stop"
    max_tokens: int | None = None
    # False under a grammar or penalties scored by an auditor that did not replay them (one
    # from before issue 39): then only the usage is judged
    comparable: bool = True
    # The end, when the answer ended by the model's own choice: how far ending was below the
    # top choice (temperature 1), and its log-probability at the request's temperature.
    end_gap: float | None = None
    end_logprob: float | None = None
    # The prompt as the auditor counted it (the model's template rendered, tokenized) and what
    # the audited worker was billed for; None where a score carries no counts (not checked).
    prompt_tokens: int | None = None
    claimed_prompt_tokens: int | None = None
    # Under a response_format: the answer token its grammar refused (no worker generating
    # under that format could have written it), None when it kept to it (or had none).
    format_broken_at: int | None = None
    # A part of a several-part case (issue 39: choices, prompts) that said it stopped at
    # ``max_tokens`` with far fewer tokens: ``(max_tokens, its tokens)`` (``combine``).
    length_short: tuple[int, int] | None = None
    parts: int = 1  # the answers its counts add up (each may end on an end token unseen)
    # Tokens an honest worker may have made beyond the auditor's count of the text: under a
    # JSON grammar, one per whitespace character (the grammar takes whitespace a character at
    # a time, where the tokenizer merges a run into one token).
    token_slack: int = 0

    @property
    def z(self) -> float:
        """The sampled answer's standardised log-likelihood (0 with nothing to judge)."""
        if self.variance <= 0:
            return 0.0
        return self.deviation / math.sqrt(self.variance)


@dataclass(frozen=True, slots=True)
class EndScore:
    """The position after the answer, for an answer the model itself ended: the end's
    log-probability and the top choice's (temperature 1), and, for a sampled answer, the end's
    ``(lp, mu, var)`` at the request's temperature (every end token merged into one outcome)."""

    logprob: float
    best_logprob: float
    sampled: tuple[float, float, float] | None = None


def score_job(
    *,
    temperature: float,
    claimed_completion_tokens: int,
    logprobs: Sequence[float],
    best_logprobs: Sequence[float],
    sampled: tuple[Sequence[float], Sequence[float], Sequence[float]] | None = None,
    end: EndScore | None = None,
    finish_reason: str = "stop",
    max_tokens: int | None = None,
    comparable: bool = True,
    near_tie: float = NEAR_TIE,
    prompt_tokens: int | None = None,
    claimed_prompt_tokens: int | None = None,
    format_broken_at: int | None = None,
) -> JobScore:
    """A ``JobScore`` from an auditor's per-token numbers: ``logprobs`` and ``best_logprobs``
    at temperature 1 (the delivered token's and the top choice's); ``sampled``, for a sampled
    request, ``(lp, mu, var)`` per token at its temperature; ``end`` only when the answer ended
    by the model's own choice (the caller knows: "stop" and no stop string); ``prompt_tokens``
    the auditor's count of the prompt and ``claimed_prompt_tokens`` the worker's billed claim.
    Each token's ``lp - mu`` is floored at ``-TOKEN_CLIP``."""
    positions = len(logprobs)
    mismatches = sum(best - lp > near_tie
                     for lp, best in zip(logprobs, best_logprobs, strict=True))
    deviation = variance = 0.0
    if sampled is not None:
        lps, mus, variances = sampled
        deviation = math.fsum(max(lp - mu, -TOKEN_CLIP)
                              for lp, mu in zip(lps, mus, strict=True))
        variance = math.fsum(variances)
    end_gap = end_logprob = None
    if end is not None:
        end_gap = end.best_logprob - end.logprob
        if end.sampled is not None:
            end_logprob = end.sampled[0]
    return JobScore(temperature, len(logprobs), claimed_completion_tokens, positions, mismatches,
                    deviation, variance, finish_reason, max_tokens, comparable, end_gap,
                    end_logprob, prompt_tokens, claimed_prompt_tokens, format_broken_at)


def combine(parts: Sequence[JobScore], *, claimed_completion_tokens: int,
            claimed_prompt_tokens: int | None, prompt_tokens: int | None,
            usage_slack: float = USAGE_SLACK) -> JobScore:
    """One ``JobScore`` for a case of several parts (each choice of ``n``, each prompt of a
    list, issue 39), each part scored on its own by the auditor: the evidence adds up
    (mismatches, positions, ``sum(lp - mu)`` and its variance), the usage is the worker's one
    claim for them all against the auditor's counts summed (``prompt_tokens``: each prompt
    counted once), the worst end and the first broken format or false "length" of any part
    decide alone."""
    first = parts[0]
    ends = [part.end_gap for part in parts if part.end_gap is not None]
    sampled_ends = [part.end_logprob for part in parts if part.end_logprob is not None]
    short = next(((part.max_tokens, part.answer_tokens) for part in parts
                  if part.finish_reason == "length" and part.max_tokens is not None
                  and math.ceil(part.answer_tokens * (1 + usage_slack)) + 1
                  < LENGTH_SHARE * part.max_tokens), None)
    broken = next((part.format_broken_at for part in parts
                   if part.format_broken_at is not None), None)
    return JobScore(
        first.temperature, sum(part.answer_tokens for part in parts),
        claimed_completion_tokens, sum(part.positions for part in parts),
        sum(part.mismatches for part in parts), math.fsum(part.deviation for part in parts),
        math.fsum(part.variance for part in parts), "stop", None,
        all(part.comparable for part in parts), max(ends) if ends else None,
        min(sampled_ends) if sampled_ends else None, prompt_tokens, claimed_prompt_tokens,
        broken, short, len(parts), sum(part.token_slack for part in parts))


@dataclass(frozen=True, slots=True)
class Band:
    """What honest answers look like at one temperature. Greedy (0): the rate of mismatches
    per position. Sampled: the mean and spread of ``z``, and the highest ``z`` seen (an answer
    far surer of itself than sampling makes it was not sampled)."""

    temperature: float
    mismatch_rate: float = 0.01
    # How much more greedy mismatches spread than a Poisson count: they come in clusters where
    # re-tokenising a word splits it differently than it was generated.
    mismatch_dispersion: float = 1.0
    z_mean: float = 0.0
    z_sd: float = 1.0
    z_max: float = CLIP


@dataclass(frozen=True, slots=True)
class HonestBands:
    """Bands per temperature; ``for_temperature`` picks the nearest one learned (greedy only
    for greedy jobs: the two kinds of evidence do not mix)."""

    bands: tuple[Band, ...]

    @classmethod
    def learn(cls, honest: Iterable[JobScore], *, tail: float = 0.001,
              min_tokens: int = MIN_TOKENS) -> HonestBands:
        """Bands from honest jobs: per temperature, the greedy mismatch rate (with one extra
        mismatch of slack per temperature, so a clean sample does not learn a rate of 0) and
        dispersion, or the mean and standard deviation of ``z`` and its ``1 - tail`` quantile
        (plus one)."""
        by_temperature: dict[float, list[JobScore]] = {}
        for score in honest:
            if score.comparable and score.answer_tokens >= min_tokens:
                by_temperature.setdefault(round(score.temperature, 2), []).append(score)
        bands = []
        for temperature, scores in sorted(by_temperature.items()):
            if temperature == 0:
                positions = sum(score.positions for score in scores)
                mismatches = sum(score.mismatches for score in scores)
                rate = max(0.002, (mismatches + 1) / positions)
                spread = math.fsum((score.mismatches - rate * score.positions) ** 2
                                   for score in scores)
                dispersion = max(1.0, spread / math.fsum(rate * score.positions
                                                         for score in scores))
                bands.append(Band(0.0, mismatch_rate=rate, mismatch_dispersion=dispersion))
                continue
            zs = sorted(score.z for score in scores)
            mean = math.fsum(zs) / len(zs)
            sd = math.sqrt(math.fsum((z - mean) ** 2 for z in zs) / max(1, len(zs) - 1))
            sd = max(sd, 0.5)
            high = (_quantile(zs, 1 - tail) - mean) / sd + 1.0
            bands.append(Band(temperature, z_mean=mean, z_sd=sd, z_max=max(high, 3.0)))
        if not bands:
            raise ValueError("no honest scores to learn bands from")
        return cls(tuple(bands))

    def for_temperature(self, temperature: float) -> Band:
        greedy = temperature == 0
        same_kind = [band for band in self.bands if (band.temperature == 0) == greedy]
        pool = same_kind or [Band(0.0) if greedy else Band(temperature, z_sd=1.25)]
        return min(pool, key=lambda band: abs(band.temperature - temperature))

    def to_dict(self) -> dict[str, Any]:
        return {"bands": [asdict(band) for band in self.bands]}

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> HonestBands:
        """Bands as ``to_dict`` wrote them; ``ValueError`` on anything else."""
        try:
            bands = tuple(Band(**{name: float(value) for name, value in entry.items()})
                          for entry in raw["bands"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a bands object: {exc}") from exc
        if not bands or any(band.z_sd <= 0 or not 0 < band.mismatch_rate < 1
                            or band.mismatch_dispersion < 1 for band in bands):
            raise ValueError("bands need a positive z_sd, a mismatch_rate in (0, 1) and a "
                             "mismatch_dispersion of at least 1")
        return cls(bands)


# Where no honest runs of a file were learned: a standard normal z (a little wider), and one
# greedy mismatch in fifty positions.
DEFAULT_BANDS = HonestBands((Band(0.0, mismatch_rate=0.02),
                             Band(0.7, z_mean=0.0, z_sd=1.25, z_max=CLIP)))


def _quantile(ordered: Sequence[float], q: float) -> float:
    """The ``q`` quantile of sorted values, linearly interpolated."""
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(frozen=True, slots=True)
class Verdict:
    """One job's judgement: its ``suspicion`` (about N(0, 1) for honest work; None when the job
    says nothing either way), whether it counts as failed (for the pages and refunds), and
    why. ``ambiguous``: the evidence is the answer's scores, which an honest answer also shows
    now and then (a re-tokenised word): it weighs at most ``SprtParams.job_cap`` in the test."""

    suspicion: float | None
    failed: bool = False
    reason: str = ""
    ambiguous: bool = False


FAIL_AT = 2.5  # a job this suspicious is shown (and refunded, if its worker is flagged) as failed


def judge(score: JobScore, bands: HonestBands, *, usage_slack: float = USAGE_SLACK,
          prompt_slack_tokens: int = PROMPT_SLACK_TOKENS, min_tokens: int = MIN_TOKENS
          ) -> Verdict:
    """How suspicious one audited job is: certain for usage past the auditor's counts (the
    completion's, or the prompt's beyond ``usage_slack`` and ``prompt_slack_tokens``) or a false
    "length"; otherwise, for answers of at least ``min_tokens`` whose scores are comparable
    (free text, or an auditor that replayed the grammar and penalties), the standardised
    evidence of its temperature's band; certain for an answer its format's grammar refuses."""
    # + each part's end token
    allowed = (math.ceil((score.answer_tokens + score.token_slack) * (1 + usage_slack))
               + score.parts)
    if score.claimed_completion_tokens > allowed:
        return Verdict(CLIP, True, f"claimed {score.claimed_completion_tokens} completion "
                                   f"tokens; the auditor counted {score.answer_tokens}")
    if score.prompt_tokens is not None and score.claimed_prompt_tokens is not None \
            and score.claimed_prompt_tokens > prompt_allowance(score.prompt_tokens, usage_slack,
                                                               prompt_slack_tokens):
        return Verdict(CLIP, True, f"claimed {score.claimed_prompt_tokens} prompt tokens; the "
                                   f"auditor counted {score.prompt_tokens}")
    short = score.length_short or (
        (score.max_tokens, score.answer_tokens) if score.finish_reason == "length"
        and score.max_tokens is not None and allowed < LENGTH_SHARE * score.max_tokens
        else None)
    if short is not None:
        return Verdict(CLIP, True, f"said it stopped at max_tokens ({short[0]}); the "
                                   f"answer has {short[1]} tokens")
    if score.format_broken_at is not None:
        return Verdict(CLIP, True, f"the answer leaves the requested response_format at its "
                                   f"token {score.format_broken_at + 1}: no worker generating "
                                   f"under that format could have written it")
    if not score.comparable:
        return Verdict(None, False, "only the usage was checked")
    if score.temperature == 0 and score.end_gap is not None and score.end_gap > END_GAP:
        return Verdict(CLIP, True, f"said it stopped, where the model would go on (ending was "
                                   f"{score.end_gap:.1f} nats below its top choice)")
    if score.temperature > 0 and score.end_logprob is not None \
            and score.end_logprob < END_FLOOR:
        return Verdict(CLIP, True, f"said it stopped, where the model almost never ends "
                                   f"(log-probability {score.end_logprob:.1f})")
    if score.positions < min_tokens:
        return Verdict(None, False, "too short to judge on its scores")
    band = bands.for_temperature(score.temperature)
    ambiguous = not not_the_models(score)
    if score.temperature == 0:
        expected = band.mismatch_rate * score.positions
        suspicion = ((score.mismatches - expected)
                     / math.sqrt(expected * band.mismatch_dispersion + 0.25))
        suspicion = max(-CLIP, min(CLIP, suspicion))
        if suspicion >= FAIL_AT:
            return Verdict(suspicion, True,
                           f"{score.mismatches} of {score.positions} greedy tokens were not the "
                           f"model's top choice (honest answers: about {expected:.1f})",
                           ambiguous)
        return Verdict(suspicion, ambiguous=ambiguous)
    standard = (score.z - band.z_mean) / band.z_sd
    if standard > band.z_max:
        return Verdict(CLIP, True, f"far likelier than sampling at temperature "
                                   f"{score.temperature:g} makes an answer (z = {score.z:+.1f}): "
                                   f"not sampled for this request")
    suspicion = max(-CLIP, min(CLIP, -standard))
    if suspicion >= FAIL_AT:
        return Verdict(suspicion, True,
                       f"the model finds this answer unlikely for the request (z = "
                       f"{score.z:+.1f} at temperature {score.temperature:g}; honest answers "
                       f"sit near {band.z_mean:+.1f})", ambiguous)
    return Verdict(suspicion, ambiguous=ambiguous)


def not_the_models(score: JobScore, *, min_tokens: int = FOREIGN_MIN_TOKENS) -> bool:
    """Whether an answer of at least ``min_tokens`` positions is mostly not what the model
    writes: more than half of a greedy answer's positions clear misses, or a sampled answer's
    tokens on average more than ``TOKEN_CLIP / 2`` nats below their expectation. A re-tokenised
    word touches a few tokens, never most of an answer: such evidence weighs in full."""
    if score.positions < min_tokens:
        return False
    if score.temperature == 0:
        return 2 * score.mismatches > score.positions
    return score.deviation <= -TOKEN_CLIP / 2 * score.positions


def prompt_allowance(counted: int, usage_slack: float = USAGE_SLACK,
                     slack_tokens: int = PROMPT_SLACK_TOKENS) -> int:
    """The most prompt tokens an honest worker may claim for a prompt the auditor counted as
    ``counted``."""
    return counted + math.ceil(round(counted * usage_slack, 6)) + slack_tokens  # 110 % of 100: 110


def censoring_point(delta: float, contamination: float) -> float:
    """Huber's (1965) censoring point for one job's log-likelihood ratio between N(``delta``, 1)
    and N(0, 1) when a share ``contamination`` of honest jobs may score anyhow: the ``c`` with
    ``(1 - eps) * (Phi(t) + exp(-c) * (1 - Phi(t - delta))) = 1``, where ``t = (c + delta**2 /
    2) / delta`` is the suspicion at which the ratio reaches ``c``. Censoring each job's ratio
    at ``c`` makes the test hold its error rates against the least favourable such honest
    worker. Infinite (nothing censored) for ``contamination`` 0."""
    if contamination <= 0:
        return math.inf

    def excess(c: float) -> float:  # decreasing in c: the least favourable density's mass - 1
        t = (c + delta ** 2 / 2) / delta
        phi = 0.5 * math.erfc(-t / math.sqrt(2))
        tail = 0.5 * math.erfc((t - delta) / math.sqrt(2))
        return (1 - contamination) * (phi + math.exp(-c) * tail) - 1

    low, high = 0.0, 64.0
    if excess(low) <= 0:
        return 0.0
    for _ in range(100):
        middle = (low + high) / 2
        low, high = (middle, high) if excess(middle) > 0 else (low, middle)
    return (low + high) / 2


@dataclass(frozen=True, slots=True)
class SprtParams:
    """Wald's test between "honest" (suspicion ~ N(0, 1)) and "cheating" (~ N(``delta``, 1)),
    with error rates ``alpha`` (flagging an honest worker) and ``beta`` (missing a cheat), made
    robust to a share ``contamination`` of honest jobs whose scores look like a cheat's: an
    ambiguous job adds at most ``job_cap`` (``censoring_point``: 1.58 at the defaults, where a
    job at the clip adds 3.5; a contamination of 0 censors nothing). Real SmolLM2 runs: 0.9-1.5 %
    of honest jobs fail on their scores."""

    delta: float = 1.0
    alpha: float = 0.001
    beta: float = 0.01
    contamination: float = 0.01
    job_cap: float = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.delta > 0 or not 0 < self.alpha < 1 or not 0 < self.beta < 1:
            raise ValueError("need delta > 0 and error rates in (0, 1)")
        if not 0 <= self.contamination < 1:
            raise ValueError("need a contamination in [0, 1)")
        object.__setattr__(self, "job_cap", censoring_point(self.delta, self.contamination))
        if self.step(CLIP) >= self.upper:
            raise ValueError("one job at the clip would flag a worker: lower delta")

    @property
    def upper(self) -> float:
        return math.log((1 - self.beta) / self.alpha)

    @property
    def lower(self) -> float:
        return math.log(self.beta / (1 - self.alpha))

    def step(self, suspicion: float, *, ambiguous: bool = False) -> float:
        """One job's log-likelihood ratio, censored at ``job_cap`` for ambiguous evidence."""
        ratio = self.delta * suspicion - self.delta ** 2 / 2
        return min(ratio, self.job_cap) if ambiguous else ratio


@dataclass(frozen=True, slots=True)
class Standing:
    """One worker's audit record: the test's running sum and what it has decided."""

    llr: float = 0.0
    audited: int = 0
    failed: int = 0
    state: State = "unknown"
    reasons: tuple[str, ...] = field(default=())  # the failed jobs' reasons, newest last

    def after(self, verdict: Verdict, params: SprtParams = SprtParams(), *,
              may_flag: bool = True) -> Standing:
        """The standing after one more audited job. A flag stays until an admin clears it; a
        job that says nothing (``suspicion`` None) is counted but moves nothing. Without
        ``may_flag`` (the evidence so far comes from too few accusers: ``enough_accusers``) the
        test is held at its upper line instead: one more failing verdict from a new accuser
        flags."""
        failed = self.failed + verdict.failed
        reasons = (*self.reasons[-9:], verdict.reason) if verdict.failed else self.reasons
        if self.state == "flagged" or verdict.suspicion is None:
            return replace(self, audited=self.audited + 1, failed=failed, reasons=reasons)
        llr = self.llr + params.step(verdict.suspicion, ambiguous=verdict.ambiguous)
        state: State = self.state
        if llr >= params.upper and not may_flag:
            llr = params.upper
        elif llr >= params.upper:
            state = "flagged"
        elif llr <= params.lower:
            state, llr = "good", params.lower  # held at the boundary: evidence can build again
        return Standing(llr, self.audited + 1, failed, state, reasons)

    def cleared(self) -> Standing:
        """An admin cleared a false flag: the test starts again."""
        return Standing(audited=self.audited, failed=self.failed)


MIN_ACCUSERS = 3  # untrusted auditors whose failing verdicts a flag needs, with no trusted one


def enough_accusers(accusers: Collection[str], *, trusted: bool) -> bool:
    """Whether failing verdicts from ``accusers`` (the distinct auditors whose failing verdicts
    on a worker counted) may flag it: any from a trusted auditor, else at least
    ``MIN_ACCUSERS`` of them. Two keys of one party, however independent they look, never
    flag anyone (issue 39's Sybil pair); a cheat that only two others can audit is audited at
    the highest rate until a third auditor or a trusted one comes."""
    return trusted or len(set(accusers)) >= MIN_ACCUSERS


def audit_rate(standing: Standing, *, in_escrow: bool, base_rate: float = 0.03,
               new_rate: float = 0.8, params: SprtParams = SprtParams()) -> float:
    """The share of a worker's jobs to audit: most of a new worker's (escrow, or no verdict
    yet), a few percent of an established one's, rising as its test drifts toward a flag."""
    if standing.state == "flagged":
        return 0.0  # out of routing anyway
    if in_escrow or standing.state == "unknown":
        return new_rate
    drift = (standing.llr - params.lower) / (params.upper - params.lower)  # 0 at rest, 1 flagged
    return min(new_rate, base_rate + (new_rate - base_rate) * max(0.0, drift))
