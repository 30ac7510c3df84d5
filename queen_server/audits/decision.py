"""The audits' decision rule: is an audited answer suspicious, and when is a worker flagged.

An auditor re-scores a delivered answer (the worker's ``score`` job: one teacher-forced pass of
prompt plus answer) and returns, per delivered token, its log-probability under the model at
temperature 1 and whether it was the model's top choice, plus the answer's exact token count.
From honest runs of the same model file the queen knows what an honest answer's scores look like
at each temperature (``HonestBands``): at temperature 0 nearly every delivered token is the top
choice; at higher temperatures the mean log-probability per token sits in a band. One job outside
its band, or one whose claimed usage is past what the auditor counted, *fails*.

A single failed job flags nobody. Jobs combine per worker in Wald's sequential probability ratio
test (``SprtParams``, ``Standing``): honest workers fail with a small probability ``p0`` (the
band's own tail), cheats with a large one ``p1``; each job adds its log-likelihood ratio, and the
worker is flagged when the sum crosses ``log((1 - beta) / alpha)``, or settles in good standing
when it falls below ``log(beta / (1 - alpha))`` (where it is held, so evidence can accumulate
again if the worker turns). ``alpha`` bounds the false-flag rate, ``beta`` the rate of missed
cheats. Everything here is pure: the queen's audit service feeds it and acts on its answers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

State = Literal["unknown", "good", "flagged"]


@dataclass(frozen=True, slots=True)
class JobScore:
    """An auditor's reading of one delivered answer."""

    temperature: float
    answer_tokens: int  # as the auditor tokenized the delivered text
    logprobs: Sequence[float]  # per delivered token, at temperature 1
    argmax: Sequence[bool]  # per delivered token: the model's top choice
    claimed_completion_tokens: int  # what the audited worker reported

    @property
    def mean_logprob(self) -> float:
        return sum(self.logprobs) / len(self.logprobs) if self.logprobs else 0.0

    @property
    def top_share(self) -> float:
        return sum(self.argmax) / len(self.argmax) if self.argmax else 1.0


@dataclass(frozen=True, slots=True)
class Band:
    """What honest answers score at one temperature: the lowest share of top choices and the
    range of mean log-probabilities that count as honest (percentiles of honest runs)."""

    temperature: float
    min_top_share: float
    min_mean_logprob: float
    max_mean_logprob: float


@dataclass(frozen=True, slots=True)
class HonestBands:
    """Bands per temperature, learned from honest scores (``learn``); ``for_temperature`` picks
    the nearest one learned."""

    bands: tuple[Band, ...]

    @classmethod
    def learn(cls, honest: Iterable[JobScore], tail: float = 0.005,
              min_tokens: int = 4) -> HonestBands:
        """Each temperature's band spans its honest scores but the ``tail`` share at each end
        (answers shorter than ``min_tokens`` say too little and are left out)."""
        by_temperature: dict[float, list[JobScore]] = {}
        for score in honest:
            if score.answer_tokens >= min_tokens:
                by_temperature.setdefault(round(score.temperature, 2), []).append(score)
        bands = []
        for temperature, scores in sorted(by_temperature.items()):
            means = sorted(score.mean_logprob for score in scores)
            shares = sorted(score.top_share for score in scores)
            # Greedy answers have no upper bound: a model sure of every token is honest. At
            # higher temperatures an answer too sure of itself was not sampled (a replay).
            high = 0.0 if temperature == 0 else _quantile(means, 1 - tail)
            bands.append(Band(temperature, _quantile(shares, tail), _quantile(means, tail),
                              high))
        if not bands:
            raise ValueError("no honest scores to learn bands from")
        return cls(tuple(bands))

    def for_temperature(self, temperature: float) -> Band:
        return min(self.bands, key=lambda band: abs(band.temperature - temperature))


def _quantile(ordered: Sequence[float], q: float) -> float:
    """The ``q`` quantile of sorted values, linearly interpolated."""
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(frozen=True, slots=True)
class Verdict:
    failed: bool
    reason: str = ""


def judge(score: JobScore, bands: HonestBands, *, usage_slack: float = 0.1,
          min_tokens: int = 4) -> Verdict:
    """Whether one audited job fails: its claimed usage past the auditor's count (beyond
    ``usage_slack``, for tokenizer boundaries), or its scores outside the honest band at its
    temperature (only for answers of at least ``min_tokens``)."""
    allowed = math.ceil(score.answer_tokens * (1 + usage_slack)) + 1  # + the end token
    if score.claimed_completion_tokens > allowed:
        return Verdict(True, f"claimed {score.claimed_completion_tokens} tokens; the auditor "
                             f"counted {score.answer_tokens}")
    if score.answer_tokens < min_tokens:
        return Verdict(False, "too short to judge")
    band = bands.for_temperature(score.temperature)
    if score.top_share < band.min_top_share:
        return Verdict(True, f"{score.top_share:.0%} of tokens were the model's top choice; "
                             f"honest answers at temperature {band.temperature:g} have at least "
                             f"{band.min_top_share:.0%}")
    mean = score.mean_logprob
    if not band.min_mean_logprob <= mean <= band.max_mean_logprob:
        return Verdict(True, f"mean log-probability {mean:.2f} per token is outside the honest "
                             f"band {band.min_mean_logprob:.2f} to {band.max_mean_logprob:.2f} "
                             f"at temperature {band.temperature:g}")
    return Verdict(False)


@dataclass(frozen=True, slots=True)
class SprtParams:
    """Wald's test between "honest" (a job fails with probability ``p0``) and "cheating"
    (``p1``), with error rates ``alpha`` (flagging an honest worker) and ``beta`` (missing a
    cheat)."""

    p0: float = 0.02
    p1: float = 0.5
    alpha: float = 0.001
    beta: float = 0.01

    def __post_init__(self) -> None:
        if not 0 < self.p0 < self.p1 < 1 or not 0 < self.alpha < 1 or not 0 < self.beta < 1:
            raise ValueError("need 0 < p0 < p1 < 1 and error rates in (0, 1)")

    @property
    def upper(self) -> float:
        return math.log((1 - self.beta) / self.alpha)

    @property
    def lower(self) -> float:
        return math.log(self.beta / (1 - self.alpha))

    @property
    def fail_step(self) -> float:
        return math.log(self.p1 / self.p0)

    @property
    def pass_step(self) -> float:
        return math.log((1 - self.p1) / (1 - self.p0))


@dataclass(frozen=True, slots=True)
class Standing:
    """One worker's audit record: the test's running sum and what it has decided."""

    llr: float = 0.0
    audited: int = 0
    failed: int = 0
    state: State = "unknown"
    reasons: tuple[str, ...] = field(default=())  # the failed jobs' reasons, newest last

    def after(self, verdict: Verdict, params: SprtParams = SprtParams()) -> Standing:
        """The standing after one more audited job. A flag stays until an admin clears it."""
        if self.state == "flagged":
            return replace(self, audited=self.audited + 1,
                           failed=self.failed + verdict.failed)
        llr = self.llr + (params.fail_step if verdict.failed else params.pass_step)
        state: State = self.state
        if llr >= params.upper:
            state = "flagged"
        elif llr <= params.lower:
            state, llr = "good", params.lower  # held at the boundary: evidence can build again
        reasons = (*self.reasons[-9:], verdict.reason) if verdict.failed else self.reasons
        return Standing(llr, self.audited + 1, self.failed + verdict.failed, state, reasons)

    def cleared(self) -> Standing:
        """An admin cleared a false flag: the test starts again."""
        return Standing(audited=self.audited, failed=self.failed)


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
