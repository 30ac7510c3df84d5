"""What an audit is about, who may audit it, and how an auditor's answer is read. Pure.

An ``AuditCase`` is one finished answer the queen may re-score: the original request as the
worker got it, the text the client was delivered, the worker's claims (usage: the completion
tokens it claimed and the prompt tokens the client was billed for; finish reason) and the money
it moved. ``case_for`` says whether an answer can be audited at all (one worker
served all of it, one choice, a real worker key). ``choose_auditor`` picks who re-scores it:
never the audited worker, only a worker holding the same model file (the sha256 the queen read
from the hub, not the audited worker's word) with the ``score`` capability; operator-trusted
auditors first, then the workers with the longest good record, so a developer's prompt goes to
as few and as trusted parties as possible. ``read_score`` turns the auditor's result into the
decision rule's ``JobScore`` (the auditor's prompt and answer counts beside the worker's
claims), refusing one that does not fit the case.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from queen_server.audits.decision import EndScore, JobScore, score_job
from shared_schema import ModelDescriptor, capabilities
from shared_schema.audits import ScoreData, ScoreJob

# Penalties change the distribution an answer was drawn from in ways the auditor does not
# replay (as does a grammar): such answers are judged on their usage only.
_PENALTIES = ("presence_penalty", "frequency_penalty")


@dataclass(frozen=True, slots=True)
class AuditCase:
    request_id: str
    model: str
    sha256: str | None  # the file the answer must have come from (the queen's reading first)
    worker_key: str
    kind: str  # "chat" or "completions"
    request: dict[str, Any]  # as the worker got it
    answer: str
    claimed_completion_tokens: int
    claimed_prompt_tokens: int  # as billed: the worker's claim, capped at the queen's bound
    finish_reason: str
    key_id: int | None
    charged_msat: int

    @property
    def temperature(self) -> float:
        value = self.request.get("temperature")
        return float(value) if isinstance(value, int | float) else 1.0

    @property
    def max_tokens(self) -> int | None:
        for name in ("max_completion_tokens", "max_tokens"):
            value = self.request.get(name)
            if isinstance(value, int):
                return value
        return None

    @property
    def comparable(self) -> bool:
        """Whether the answer's scores can be judged (no grammar, no penalties)."""
        request = self.request
        return _plain_format(request) and not any(request.get(name) for name in _PENALTIES)

    @property
    def ended_by_model(self) -> bool:
        """The model chose to end here: "stop" without a stop string that could have cut it."""
        return self.finish_reason == "stop" and not self.request.get("stop")

    def job(self) -> dict[str, Any]:
        """The score job's request (``shared_schema.audits.ScoreJob``)."""
        return ScoreJob(model=self.model, kind=self.kind, request=self.request,
                        answer=self.answer).model_dump()


def _plain_format(request: Mapping[str, Any]) -> bool:
    value = request.get("response_format")
    return not isinstance(value, Mapping) or value.get("type") in (None, "text")


def case_for(
    *,
    request_id: str,
    model: str,
    sha256: str | None,
    worker_url: str,
    worker_req: Mapping[str, Any],
    worker_key: str | None,
    answer: str,
    claimed_completion_tokens: int,
    claimed_prompt_tokens: int,
    finish_reason: str | None,
    single_worker: bool,
    key_id: int | None = None,
    charged_msat: int = 0,
) -> AuditCase | None:
    """The audit case of a finished answer, or None if it cannot be audited: served by more
    than one worker (a failover), by a legacy worker, with several choices or prompts, or
    with no text."""
    if not single_worker or worker_key is None or not answer:
        return None
    if worker_url.endswith("/chat/completions"):
        kind = "chat"
    elif worker_url.endswith("/completions"):
        kind = "completions"
        prompt = worker_req.get("prompt")
        if not isinstance(prompt, str) or worker_req.get("echo"):
            return None  # one text prompt only (a list makes several answers)
    else:
        return None
    if isinstance(worker_req.get("n"), int) and worker_req["n"] > 1:
        return None
    return AuditCase(request_id, model, sha256, worker_key, kind, dict(worker_req), answer,
                     claimed_completion_tokens, claimed_prompt_tokens, finish_reason or "stop",
                     key_id, charged_msat)


class AuditorView(Protocol):
    """What choosing an auditor reads of a worker (``swarm.worker.Worker`` has it)."""

    @property
    def key(self) -> str: ...
    @property
    def capabilities(self) -> frozenset[str]: ...
    @property
    def free_slots(self) -> int: ...
    @property
    def flagged(self) -> bool: ...
    @property
    def models(self) -> Mapping[str, ModelDescriptor]: ...


A = TypeVar("A", bound=AuditorView)


def choose_auditor(
    case: AuditCase,
    holders: Iterable[A],
    *,
    trusted: Collection[str],
    record: Callable[[str], tuple[str, int]],
    exclude: Collection[str] = (),
) -> A | None:
    """The best free auditor for ``case`` among the model's holders, or None. ``record(key)``
    is a worker's audit ``(state, audits passed)``: after the operator's trusted auditors come
    workers in good standing with the longest record, then unknown ones; flagged never."""
    best: tuple[int, int, A] | None = None
    for worker in holders:
        if (worker.key == case.worker_key or worker.key in exclude or worker.flagged
                or worker.free_slots <= 0 or capabilities.SCORE not in worker.capabilities):
            continue
        held = worker.models.get(case.model)
        if case.sha256 is None or held is None or held.sha256 != case.sha256:
            continue
        state, passed = record(worker.key)
        if worker.key in trusted:
            rank = 0
        elif state == "good":
            rank = 1
        elif state == "unknown":
            rank = 2
        else:
            continue
        if best is None or (rank, -passed) < (best[0], -best[1]):
            best = (rank, passed, worker)
    return best[2] if best is not None else None


class BadScore(ValueError):
    """An auditor's result that is not a score of this case's answer."""


def read_score(case: AuditCase, data: Mapping[str, Any]) -> JobScore:
    """The decision rule's reading of an auditor's result for ``case``."""
    try:
        score = ScoreData.read(dict(data))
    except ValueError as exc:
        raise BadScore(f"the auditor's result is malformed: {exc}") from exc
    if score.answer_tokens > len(case.answer.encode("utf-8")) + 1:
        raise BadScore(f"the auditor counted {score.answer_tokens} tokens in a "
                       f"{len(case.answer.encode('utf-8'))}-byte answer")
    greedy = case.temperature == 0
    if greedy != (score.sampled is None):
        raise BadScore("the auditor scored the answer at another temperature than asked")
    end = None
    if case.ended_by_model and score.end_logprob is not None \
            and score.end_best_logprob is not None:
        sampled_end = score.sampled.end if score.sampled is not None else None
        end = EndScore(score.end_logprob, score.end_best_logprob,
                       tuple(sampled_end) if sampled_end is not None else None)
    sampled = None
    if score.sampled is not None:
        sampled = (score.sampled.logprobs, score.sampled.expected, score.sampled.variances)
    return score_job(
        temperature=case.temperature,
        claimed_completion_tokens=case.claimed_completion_tokens,
        logprobs=score.logprobs,
        best_logprobs=score.best_logprobs,
        sampled=sampled,
        end=end,
        finish_reason=case.finish_reason,
        max_tokens=case.max_tokens,
        comparable=case.comparable,
        prompt_tokens=score.prompt_tokens,
        claimed_prompt_tokens=case.claimed_prompt_tokens,
    )
