"""A re-scoring audit's request and its scores (issue 16), without llama.cpp: what the worker
reads from a ``score`` job and what comes back from the engine child that scored it
(``engine.scoring`` computes them there).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from desktop_worker.errors import UnsupportedRequest
from shared_schema.audits import SCORE_OBJECT

KINDS = ("chat", "completions")
# The longest answer text read (characters): far above any context this worker loads, so a
# hostile job cannot make the tokenizer chew on megabytes before the length check refuses it.
MAX_ANSWER_CHARS = 4_000_000


@dataclass(frozen=True, slots=True)
class ScoreRequest:
    """What a score job asks: the original request, its kind and the delivered answer."""

    kind: str  # "chat" or "completions"
    request: dict[str, Any]
    answer: str
    prefix: str = ""  # text delivered before the answer (a failover's earlier part)


@dataclass(slots=True)
class Score:
    """The scores of one answer: per answer token, its log-probability and whether it was the
    model's top choice, and the top choice's log-probability (``best_logprobs``: a delivered
    token a hair below the top is a near-tie that another machine's arithmetic may flip, which
    the queen can tell from a real miss); ``end_logprob``: the log-probability of the model
    ending right after the answer (its end-of-generation tokens; a truncated answer scores low
    here), ``None`` when the model names no such token; ``end_best_logprob``: the top
    choice's there. For a sampled request (``temperature`` > 0), ``sampled_logprobs``,
    ``expected`` and ``variances`` are ``lp``, ``mu`` and ``var`` per token, and ``sampled_end``
    the three for the end (see the module's docstring)."""

    prompt_tokens: int
    temperature: float = 0.0
    logprobs: list[float] = field(default_factory=list)
    argmax: list[bool] = field(default_factory=list)
    best_logprobs: list[float] = field(default_factory=list)
    end_logprob: float | None = None
    end_best_logprob: float | None = None
    sampled_logprobs: list[float] = field(default_factory=list)
    expected: list[float] = field(default_factory=list)
    variances: list[float] = field(default_factory=list)
    sampled_end: tuple[float, float, float] | None = None
    constraints_replayed: bool = False  # bias, penalties and grammar applied as generation did
    format_broken_at: int | None = None  # the answer token its grammar refused, if any

    @property
    def answer_tokens(self) -> int:
        return len(self.logprobs)

    def data(self) -> dict[str, Any]:
        """The Result's ``data``: a ``shared_schema.audits.ScoreData``, built as a plain dict
        (an answer of thousands of tokens is lists of thousands of floats)."""
        sampled = None
        if self.temperature > 0:
            sampled = {"logprobs": self.sampled_logprobs, "expected": self.expected,
                       "variances": self.variances,
                       "end": list(self.sampled_end) if self.sampled_end else None}
        return {"object": SCORE_OBJECT, "prompt_tokens": self.prompt_tokens,
                "answer_tokens": self.answer_tokens, "logprobs": self.logprobs,
                "argmax": self.argmax, "best_logprobs": self.best_logprobs,
                "end_logprob": self.end_logprob, "end_best_logprob": self.end_best_logprob,
                "temperature": self.temperature, "sampled": sampled,
                "constraints_replayed": self.constraints_replayed,
                "format_broken_at": self.format_broken_at}

    def usage(self) -> dict[str, int]:
        """Every token evaluated is prompt work; nothing is generated."""
        evaluated = self.prompt_tokens + self.answer_tokens
        return {"prompt_tokens": evaluated, "completion_tokens": 0, "total_tokens": evaluated}

    @classmethod
    def from_data(cls, data: dict[str, Any]) -> Score:
        """The scores again from ``data()`` (what an engine child sent), checked for shape:
        every per-token list as long as the answer, floats where floats belong."""
        try:
            sampled = data.get("sampled")
            score = cls(
                prompt_tokens=_count(data["prompt_tokens"]),
                temperature=float(data["temperature"]),
                logprobs=_floats(data["logprobs"]),
                argmax=[bool(flag) for flag in data["argmax"]],
                best_logprobs=_floats(data["best_logprobs"]),
                end_logprob=_float_or_none(data.get("end_logprob")),
                end_best_logprob=_float_or_none(data.get("end_best_logprob")),
                constraints_replayed=bool(data.get("constraints_replayed", False)),
                format_broken_at=_count_or_none(data.get("format_broken_at")),
            )
            if sampled is not None:
                score.sampled_logprobs = _floats(sampled["logprobs"])
                score.expected = _floats(sampled["expected"])
                score.variances = _floats(sampled["variances"])
                end = sampled.get("end")
                if end is not None:
                    a, b, c = _floats(end)
                    score.sampled_end = (a, b, c)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed scores: {exc}") from exc
        n = score.answer_tokens
        lists = [score.argmax, score.best_logprobs]
        if sampled is not None:
            lists += [score.sampled_logprobs, score.expected, score.variances]
        if data.get("answer_tokens") != n or any(len(values) != n for values in lists):
            raise ValueError("malformed scores: per-token lists of different lengths")
        return score


def read_score_request(raw: dict[str, Any]) -> ScoreRequest:
    """A score job's fields, checked: a bad one is the queen's mistake, refused by name."""
    kind = raw.get("kind")
    if kind not in KINDS:
        raise UnsupportedRequest(f"a score job's 'kind' must be one of {', '.join(KINDS)}, "
                                 f"not {str(kind)[:40]!r}")
    request = raw.get("request")
    if not isinstance(request, dict):
        raise UnsupportedRequest("a score job's 'request' must be the original request object")
    answer = raw.get("answer")
    if not isinstance(answer, str):
        raise UnsupportedRequest("a score job's 'answer' must be the delivered text")
    if not answer:
        raise UnsupportedRequest("a score job's 'answer' is empty: there is nothing to score")
    if len(answer) > MAX_ANSWER_CHARS:
        raise UnsupportedRequest(f"a score job's 'answer' is {len(answer)} characters, over "
                                 f"the {MAX_ANSWER_CHARS} this worker reads")
    prefix = raw.get("prefix") or ""
    if not isinstance(prefix, str):
        raise UnsupportedRequest("a score job's 'prefix' must be the text delivered before "
                                 "the answer")
    if len(prefix) + len(answer) > MAX_ANSWER_CHARS:
        raise UnsupportedRequest(f"a score job's 'prefix' and 'answer' are "
                                 f"{len(prefix) + len(answer)} characters, over the "
                                 f"{MAX_ANSWER_CHARS} this worker reads")
    return ScoreRequest(kind, request, answer, prefix)


def _count(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{value!r} is not a count")
    return value


def _floats(values: Any) -> list[float]:
    if not isinstance(values, list):
        raise ValueError("not a list")
    return [float(value) for value in values]


def _count_or_none(value: Any) -> int | None:
    return None if value is None else _count(value)


def _float_or_none(value: Any) -> float | None:
    return None if value is None else float(value)
