"""What an audit is about, who may audit it, and how an auditor's answer is read. Pure.

An ``AuditCase`` is one finished answer the queen may re-score: the original request as the
worker got it, the text the client was delivered, the worker's claims (usage: the completion
tokens it claimed and the prompt tokens the client was billed for; finish reason) and the money
it moved. ``case_for`` says whether an answer can be audited at all (one worker
served all of it, one choice, a real worker key). ``choose_auditor`` picks who re-scores it:
never the audited worker, only a worker holding the same model file (the sha256 the queen read
from the hub, not the audited worker's word) with the ``score`` capability, never one
outvoted too often as an auditor; operator-trusted auditors first, then workers independent of
the audited one (and of a first auditor: ``independence``), then the longest good record, so a
developer's prompt goes to as few and as trusted parties as possible. ``read_score`` turns
the auditor's result into the decision rule's ``JobScore`` (the auditor's prompt and answer
counts beside the worker's claims), refusing one that does not fit the case.

An answer of a fine-tuned (``ft:``) model (issue 37) is a case like any other, carrying the
model's identity: its base (the name workers hold it by), the base's pinned sha256 and the
adapter's sha256. The "same file" its auditor must hold is that pair: the base's file and the
``lora`` capability (any adapter is fetched on demand, with the score job's ``Job.adapter``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol, TypeVar

from queen_server.audits.decision import EndScore, JobScore, combine, score_job
from queen_server.audits.parts import AuditPart, Delivered, audit_parts
from shared_schema import ModelDescriptor, capabilities
from shared_schema.audits import ScoreData, ScoreJob

# Penalties change the distribution an answer was drawn from (as does a grammar): such answers
# are judged on their scores only when the auditor replayed them (``constraints_replayed``,
# every auditor since issue 39), else on their usage only.
_PENALTIES = ("presence_penalty", "frequency_penalty")


@dataclass(frozen=True, slots=True)
class AuditCase:
    request_id: str
    model: str
    sha256: str | None  # the file the answer must have come from (the queen's reading first)
    worker_key: str
    kind: str  # "chat" or "completions"
    request: dict[str, Any]  # as the worker got it
    answer: str  # every part's text, joined (what the pages show)
    claimed_completion_tokens: int  # the worker's claim for all of its parts
    # As billed: the worker's claim, capped at the queen's bound; None where the worker was
    # billed none (a failover's later part: the first worker was credited the prompt).
    claimed_prompt_tokens: int | None
    finish_reason: str
    key_id: int | None
    charged_msat: int
    # What the auditor re-scores, one score job each (issue 39: each choice, each prompt of a
    # list, a failover's part); empty: one part, the request and the answer as they are.
    parts: tuple[AuditPart, ...] = ()
    # The model group that served it (issue 39): its workers' keys, the head first; empty for
    # a worker alone. Its auditor shares no worker with it (``choose_auditor``).
    group: tuple[str, ...] = ()
    # A fine-tuned model's answer (issue 37): its base as workers hold it (``sha256`` is the
    # base's file) and its adapter's sha256; None for any other model.
    base: str | None = None
    adapter_sha256: str | None = None

    @property
    def held_as(self) -> str:
        """The name an auditor holds the case's model file by (a fine-tuned model's base)."""
        return self.base if self.base is not None else self.model

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
        """Whether the answer's scores can be judged by any auditor (no grammar, no
        penalties); an auditor that replays them judges the others too."""
        request = self.request
        return _plain_format(request) and not any(request.get(name) for name in _PENALTIES)

    @property
    def ended_by_model(self) -> bool:
        """The model chose to end here: "stop" without a stop string that could have cut it."""
        return self.finish_reason == "stop" and not self.request.get("stop")

    @property
    def score_parts(self) -> tuple[AuditPart, ...]:
        return self.parts or (AuditPart(self.request, self.answer, self.finish_reason),)

    def jobs(self) -> list[dict[str, Any]]:
        """The score jobs' requests (``shared_schema.audits.ScoreJob``), one per part."""
        return [ScoreJob(model=self.model, kind=self.kind, request=part.request,
                         answer=part.answer, prefix=part.prefix).model_dump(
                             exclude_defaults=True)
                for part in self.score_parts]

    def job(self) -> dict[str, Any]:
        """The one score job of a case of one part."""
        return self.jobs()[0]


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
    single_worker: bool = True,
    key_id: int | None = None,
    charged_msat: int = 0,
    delivered: Sequence[Delivered] | None = None,
    group: Sequence[str] = (),
    base: str | None = None,
    adapter_sha256: str | None = None,
) -> AuditCase | None:
    """The audit case of one worker's share of a finished answer, or None if it cannot be
    audited (a legacy worker, no text, a shape ``audit_parts`` cannot cut). ``delivered``:
    what the worker delivered per choice (a failover's part with the text before it); without
    it, ``answer`` is the one choice's text, and an answer several workers served
    (``single_worker`` false) is not audited. An answer of a fine-tuned (``ft:``) model names
    its ``base`` and ``adapter_sha256`` (``sha256``: the base's file); without them it cannot
    be audited."""
    fine_tuned = model.startswith("ft:")
    if worker_key is None or fine_tuned != (base is not None and adapter_sha256 is not None):
        return None
    if worker_url.endswith("/chat/completions"):
        kind = "chat"
    elif worker_url.endswith("/completions"):
        kind = "completions"
    else:
        return None
    if delivered is None:
        if not single_worker or not answer:
            return None
        delivered = [Delivered(0, answer, finish_reason or "stop")]
    parts = audit_parts(kind, worker_req, delivered)
    if parts is None:
        return None
    return AuditCase(request_id, model, sha256, worker_key, kind, dict(worker_req),
                     "".join(part.answer for part in parts), claimed_completion_tokens,
                     claimed_prompt_tokens, parts[0].finish_reason, key_id, charged_msat,
                     parts, tuple(group), base if fine_tuned else None,
                     adapter_sha256 if fine_tuned else None)


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
    ineligible: Collection[str] = (),
    independent: Callable[[A], bool] | None = None,
    holds_group_model: Callable[[A], bool] | None = None,
    fresh: Callable[[A], bool] | None = None,
    busy_too: bool = False,
) -> A | None:
    """The best free auditor for ``case`` among the model's holders, or None. ``record(key)``
    is a worker's audit ``(state, audits passed)``: after the operator's trusted auditors come
    the untrusted ones ``independent`` says are independent (of the audited worker and, for a
    second opinion, of the first auditor: ``audits.independence``), then the rest; within each,
    workers in good standing with the longest record, then unknown ones. Never a flagged one,
    nor one ``ineligible`` (outvoted too often as an auditor). Among equals, one ``fresh`` says
    has not failed this worker before comes first: a flag on untrusted evidence needs several
    accusers (``decision.enough_accusers``), so a new one is worth more than the same again.
    ``busy_too``: one without a free slot will do (is there any such auditor at all?).

    A group's answer (``case.group``): never a worker of that group, and only one that
    ``holds_group_model`` says can hold the model (a trusted auditor with the memory, or the
    head of another group with no worker in common); none without that judge.

    A fine-tuned model's answer: only a holder of its base's file with the ``lora`` capability
    (it fetches the adapter the score job names)."""
    best: tuple[tuple[int, int, int, int, int], A] | None = None
    group = frozenset(case.group)
    for worker in holders:
        if (worker.key == case.worker_key or worker.key in exclude or worker.flagged
                or worker.key in ineligible
                or (worker.free_slots <= 0 and not busy_too)
                or capabilities.SCORE not in worker.capabilities
                or (case.adapter_sha256 is not None
                    and capabilities.LORA not in worker.capabilities)):
            continue
        if group and (worker.key in group or holds_group_model is None
                      or not holds_group_model(worker)):
            continue
        held = worker.models.get(case.held_as)
        if case.sha256 is None or held is None or held.sha256 != case.sha256:
            continue
        state, passed = record(worker.key)
        new = 0 if fresh is None or fresh(worker) else 1
        if worker.key in trusted:
            rank = (0, 0, new, 0, -passed)
        elif state in ("good", "unknown"):
            apart = independent is None or independent(worker)
            rank = (1, 0 if apart else 1, new, 0 if state == "good" else 1, -passed)
        else:
            continue
        if best is None or rank < best[0]:
            best = (rank, worker)
    return best[1] if best is not None else None


class BadScore(ValueError):
    """An auditor's result that is not a score of this case's answer."""


def read_score(case: AuditCase, data: Mapping[str, Any]) -> JobScore:
    """The decision rule's reading of an auditor's result for a case of one part."""
    return read_scores(case, [data])


def read_scores(case: AuditCase, results: Sequence[Mapping[str, Any]]) -> JobScore:
    """The decision rule's reading of the auditor's results for ``case``, one per part in
    order: one part as it is; several combined (``decision.combine``), the worker's one usage
    claim against the auditor's counts summed, each prompt counted once."""
    parts = case.score_parts
    if len(results) != len(parts):
        raise BadScore(f"{len(results)} results for {len(parts)} parts")
    read = [_read_part(case, part, data, single=len(parts) == 1)
            for part, data in zip(parts, results, strict=True)]
    if len(read) == 1:
        return read[0][0]
    counted: dict[int, int] = {}
    for part, (_, prompt_tokens) in zip(parts, read, strict=True):
        counted.setdefault(part.prompt_index, prompt_tokens)
    return combine([score for score, _ in read],
                   claimed_completion_tokens=case.claimed_completion_tokens,
                   claimed_prompt_tokens=case.claimed_prompt_tokens,
                   prompt_tokens=sum(counted.values()))


def _read_part(case: AuditCase, part: AuditPart, data: Mapping[str, Any], *,
               single: bool) -> tuple[JobScore, int]:
    """One part's ``JobScore`` and the auditor's prompt count for it. A part alone carries the
    worker's claims; one of several claims exactly what the auditor counted (the usage is
    judged on their sum)."""
    try:
        score = ScoreData.read(dict(data))
    except ValueError as exc:
        raise BadScore(f"the auditor's result is malformed: {exc}") from exc
    if score.answer_tokens > len(part.answer.encode("utf-8")) + 1:
        raise BadScore(f"the auditor counted {score.answer_tokens} tokens in a "
                       f"{len(part.answer.encode('utf-8'))}-byte answer")
    if part.prefix and not score.constraints_replayed:
        raise BadScore("the auditor scores no continuation (it predates issue 39)")
    greedy = case.temperature == 0
    if greedy != (score.sampled is None):
        raise BadScore("the auditor scored the answer at another temperature than asked")
    end = None
    if part.ended_by_model and score.end_logprob is not None \
            and score.end_best_logprob is not None:
        sampled_end = score.sampled.end if score.sampled is not None else None
        end = EndScore(score.end_logprob, score.end_best_logprob,
                       tuple(sampled_end) if sampled_end is not None else None)
    sampled = None
    if score.sampled is not None:
        sampled = (score.sampled.logprobs, score.sampled.expected, score.sampled.variances)
    scored = score_job(
        temperature=case.temperature,
        claimed_completion_tokens=(case.claimed_completion_tokens if single
                                   else score.answer_tokens),
        logprobs=score.logprobs,
        best_logprobs=score.best_logprobs,
        sampled=sampled,
        end=end,
        finish_reason=part.finish_reason,
        max_tokens=case.max_tokens,
        comparable=case.comparable or score.constraints_replayed,
        prompt_tokens=score.prompt_tokens,
        claimed_prompt_tokens=case.claimed_prompt_tokens if single else None,
        format_broken_at=score.format_broken_at,
    )
    if not _plain_format(part.request):  # whitespace a character at a time (``token_slack``)
        scored = replace(scored, token_slack=sum(char.isspace() for char in part.answer))
    return scored, score.prompt_tokens
