"""Re-scoring audits' wire shapes (issue 16): the ``score`` job the queen sends an auditor, and
the scores the auditor sends back.

A score job is an ordinary ``Job`` whose ``openai_url`` is ``SCORE_URL`` and whose
``openai_req`` is a ``ScoreJob``: the original request, its kind and the text a worker
delivered. The auditor evaluates prompt and answer in one teacher-forced pass and answers a
``Result`` whose ``data`` is a ``ScoreData``:

- per answer token, at temperature 1 with the request's ``logit_bias``: the token's
  log-probability, whether it was the top choice and the top choice's log-probability (the
  greedy check: at temperature 0 an honest answer is the top choice nearly everywhere);
- the log-probability of ending right after the answer, and the top choice's there;
- for a sampled request (temperature > 0), ``SampledScores``: per token, ``lp = log p_T(x)``
  (the full-vocabulary softmax of logits / T) and, under the distribution llama.cpp's sampler
  chain really draws from (top-k 40, top-p, min-p 0.05, then temperature T: its support S),
  the expectation ``mu = E_q[log p_T(y)]`` and variance ``var = Var_q[log p_T(y)]``. An honest
  worker's ``sum(lp - mu)`` has mean 0 and variance ``sum(var)``; text the chain did not draw
  sits far below.

The queen reads a result with ``ScoreData.read``, which refuses a malformed one (lists of the
wrong length, NaN or infinite floats, positive log-probabilities, negative variances) with
``InvalidScoreData``: an auditor's answer is evidence against another worker, so a garbled one
is never half-read.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, model_validator

from shared_schema.base import WireModel
from shared_schema.errors import InvalidScoreData

SCORE_URL = "/apiary/score"
SCORE_OBJECT = "apiary.score"
# The most answer tokens one score result may carry: far above any context a worker loads, a
# bound on what a hostile auditor can make the queen hold.
MAX_SCORED_TOKENS = 1_000_000
# A log-probability is at most 0; float arithmetic may round a certain token a hair above.
LOGPROB_SLACK = 1e-6

LogProb = Annotated[float, Field(le=LOGPROB_SLACK)]
Variance = Annotated[float, Field(ge=0.0)]
LogProbs = Annotated[list[LogProb], Field(max_length=MAX_SCORED_TOKENS)]


class ScoreJob(WireModel):
    """A score job's ``openai_req``: the model (as every job names it), the original request
    (``kind`` says which endpoint's: a chat or a text completion) and the delivered text.
    ``prefix``: text another worker delivered before this answer, which it continued after a
    failover (issue 39): the answer is scored given the prompt and that text, as its worker
    generated it (an auditor from before ignores it: the queen sends one only to auditors that
    score continuations)."""

    model: str
    kind: Literal["chat", "completions"]
    request: dict[str, Any]
    answer: str
    prefix: str = ""


class SampledScores(WireModel):
    """Per answer token, ``lp``, ``mu`` and ``var`` (see the module's docstring); ``end``: the
    same three for ending right after the answer, every end-of-generation token merged into one
    outcome (``None`` when the model names no such token)."""

    logprobs: LogProbs
    expected: LogProbs
    variances: Annotated[list[Variance], Field(max_length=MAX_SCORED_TOKENS)]
    end: tuple[LogProb, LogProb, Variance] | None = None

    @model_validator(mode="after")
    def _same_lengths(self) -> SampledScores:
        if not len(self.logprobs) == len(self.expected) == len(self.variances):
            raise ValueError(f"sampled scores have {len(self.logprobs)} logprobs, "
                             f"{len(self.expected)} expected and {len(self.variances)} "
                             "variances: one of each per answer token")
        return self


class ScoreData(WireModel):
    """A score result's ``data``. Per answer token (``answer_tokens`` of each): ``logprobs``,
    ``argmax`` and ``best_logprobs`` at temperature 1. ``end_logprob``: ending right after the
    answer (every end-of-generation token's share summed; ``None`` when the model names none);
    ``end_best_logprob``: the top single token's there, so ending was the greedy choice when
    ``end_logprob >= end_best_logprob``. ``temperature``: the request's, as the auditor read it;
    ``sampled`` is there exactly when it is above 0. ``constraints_replayed``: the auditor
    shaped each row as generation's sampler chain did (logit bias, presence and frequency
    penalties, the ``response_format`` grammar; an older auditor applied the bias only), so a
    constrained answer's scores read as a free one's; ``format_broken_at``: the answer token the
    grammar refused (no worker under that format could have written it), if any."""

    object: Literal["apiary.score"] = SCORE_OBJECT
    prompt_tokens: int = Field(ge=0)
    answer_tokens: int = Field(ge=1, le=MAX_SCORED_TOKENS)
    logprobs: LogProbs
    argmax: Annotated[list[bool], Field(max_length=MAX_SCORED_TOKENS)]
    best_logprobs: LogProbs
    end_logprob: LogProb | None = None
    end_best_logprob: LogProb | None = None
    temperature: float = Field(ge=0.0)
    sampled: SampledScores | None = None
    constraints_replayed: bool = False
    format_broken_at: int | None = Field(default=None, ge=0, le=MAX_SCORED_TOKENS)

    @model_validator(mode="after")
    def _consistent(self) -> ScoreData:
        n = self.answer_tokens
        lists = {"logprobs": self.logprobs, "argmax": self.argmax,
                 "best_logprobs": self.best_logprobs}
        if self.sampled is not None:
            lists["sampled.logprobs"] = self.sampled.logprobs
        for name, values in lists.items():
            if len(values) != n:
                raise ValueError(f"'{name}' has {len(values)} entries for {n} answer tokens")
        if self.temperature > 0 and self.sampled is None:
            raise ValueError(f"a request sampled at temperature {self.temperature:g} needs "
                             "'sampled' scores")
        if self.temperature == 0 and self.sampled is not None:
            raise ValueError("a greedy request (temperature 0) has no 'sampled' scores")
        return self

    @classmethod
    def read(cls, data: Any) -> ScoreData:
        """An auditor's ``data``, checked (fields a newer auditor adds are ignored);
        ``InvalidScoreData`` saying what was wrong otherwise."""
        if not isinstance(data, dict):
            raise InvalidScoreData(f"a score result must be an object, not "
                                   f"{type(data).__name__}")
        try:
            return cls.model_validate(data, extra="ignore")
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(map(str, error['loc'])) or 'data'}: {error['msg']}"
                for error in exc.errors(include_url=False)[:5])
            raise InvalidScoreData(f"a malformed score result: {problems}") from exc
