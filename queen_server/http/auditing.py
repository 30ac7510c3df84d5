"""Offering finished answers to the audits (issue 16; every shape since issue 39).

``consider_audit`` cuts a finished answer into each worker's share and offers each share to the
audits' sampling (``AuditService.wants``: O(1)); a drawn share becomes a case
(``audits.cases.case_for``) whose parts the auditor re-scores one by one: every choice of ``n``
(plain and streamed alike: a stream's choices are kept apart as they arrive), every prompt of a
list, an ``echo``'s completion, and after a failover each worker's own span, given the text the
workers before it delivered. A worker whose part ended in a failover is drawn more often
(``AuditService.wants(..., failed_over=True)``): dropping the socket is no way around them.
A fine-tuned (``ft:``) model's answer (issue 37) is a case of its base's pinned file and its
adapter (``case_for``'s ``base`` and ``adapter_sha256``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from queen_server.audits.cases import case_for
from queen_server.audits.parts import Delivered as DeliveredPart
from queen_server.billing.service import Hold
from queen_server.swarm.jobs import Shares
from queen_server.swarm.relay import Delivered, message_text
from shared_schema import Result

if TYPE_CHECKING:
    from queen_server.runtime import QueenState
    from queen_server.swarm.metering import Meter


class Generation(Protocol):
    """What an audit reads of a request being answered (``http.generation.Generation``)."""

    job_id: str
    model: str
    worker_url: str
    worker_req: dict[str, Any]
    stream: bool
    meter: Meter


@dataclass(frozen=True, slots=True)
class Share:
    """One worker's share of an answer, as an audit case takes it."""

    worker_key: str
    delivered: tuple[DeliveredPart, ...]
    claimed_completion_tokens: int
    claimed_prompt_tokens: int | None  # None: it was billed no prompt (a failover's later part)
    failed_over: bool = False  # its worker was lost mid-answer
    group: tuple[str, ...] = ()  # the model group it headed then: its workers' keys, head first


def shares(gen: Generation, answer: Delivered, result: Result,
           worker_key: str | None, group: Shares = ()) -> list[Share]:
    """Each worker's share of a finished answer (``worker_key``: the worker that ended it, as
    the head of a model group when ``group`` holds that group's shares)."""
    claimed_prompt = min(result.usage.prompt_tokens, gen.meter.prompt_bound)
    if not answer.parts:
        if worker_key is None:
            return []
        return [Share(worker_key, _choices(gen, answer, result),
                      result.usage.completion_tokens, claimed_prompt, group=_keys(group))]
    # A failover (one choice): the text before the last worker, then the last worker's own.
    final = (message_text(result.data) if not gen.stream and result.data.get("choices")
             else answer.text[len(answer.carried):]) or ""
    text = answer.carried + final
    starts = [*answer.part_starts[:len(answer.parts) + 1], len(text)]
    found: list[Share] = []
    for i, part in enumerate(answer.parts):
        if part.worker_key is not None and starts[i] < starts[i + 1]:
            found.append(Share(part.worker_key, (DeliveredPart(
                0, text[starts[i]:starts[i + 1]], "failover", text[:starts[i]]),),
                part.completion_tokens, None, failed_over=True, group=_keys(part.shares)))
    last = starts[len(answer.parts)]
    if worker_key is not None and final:
        found.append(Share(worker_key, (DeliveredPart(
            0, text[last:], answer.finish_reason or "stop", text[:last]),),
            max(0, result.usage.completion_tokens), None, group=_keys(group)))
    return found


def _keys(group: Shares) -> tuple[str, ...]:
    return tuple(key for key, _ in group)


def _choices(gen: Generation, answer: Delivered,
             result: Result) -> tuple[DeliveredPart, ...]:
    """Each choice one worker delivered: a plain answer's messages (or texts), a stream's
    choices as they arrived."""
    choices = result.data.get("choices") if not gen.stream else None
    if isinstance(choices, list) and choices:
        found = []
        for position, choice in enumerate(choices):
            if not isinstance(choice, dict):
                continue
            index = choice.get("index", position)
            message = choice.get("message")
            text = (message_text({"choices": [choice]}) if isinstance(message, dict)
                    else choice.get("text"))
            if isinstance(index, int) and isinstance(text, str):
                found.append(DeliveredPart(index, text, str(choice.get("finish_reason")
                                                           or "stop")))
        return tuple(found)
    texts = answer.choice_texts()
    return tuple(DeliveredPart(index, texts[index], answer.choice_finish.get(index, "stop"))
                 for index in sorted(texts))


def consider_audit(state: QueenState, gen: Generation, hold: Hold | None, worker_key: str | None,
                   answer: Delivered, result: Result, group: Shares = ()) -> None:
    """Offer each worker's share of a finished answer to the audits' sampling; a drawn one is
    queued as a case. The model file it must match is the name's one pinned reading
    (``catalog.audit_file``: the hub file the queen read, or for a local name the operator
    pinned, the worker's file when it is on the list); a model with none cannot be audited,
    and no case is made for it (one would wait for an auditor holding a file nobody vouched
    for, and expire)."""
    audits = state.audits
    base, adapter_sha256 = gen.model, None
    if gen.model.startswith("ft:"):  # its base's file, and its adapter
        tuned = (state.fine_tuning.models.served(gen.model)
                 if state.fine_tuning is not None else None)
        if tuned is None:  # deleted while it answered: its adapter can no longer be fetched
            return
        base, adapter_sha256 = tuned.base, tuned.sha256
    for share in shares(gen, answer, result, worker_key, group):
        worker = state.registry.get(share.worker_key)
        held = worker.models.get(base) if worker is not None else None
        # A worker lost mid-answer has left the registry: it served the name, so it held the
        # one file that may serve it, when there is one.
        file = held.sha256 if held is not None else _only_file(state, base)
        sha256 = state.catalog.audit_file(base, file)
        if sha256 is None or not audits.wants(share.worker_key, failed_over=share.failed_over):
            continue
        case = case_for(
            request_id=gen.job_id, model=gen.model, sha256=sha256, worker_url=gen.worker_url,
            worker_req=gen.worker_req, worker_key=share.worker_key, answer="",
            claimed_completion_tokens=share.claimed_completion_tokens,
            # What the client paid for: the claim, capped at the byte bound (``Meter.bill``).
            claimed_prompt_tokens=share.claimed_prompt_tokens,
            finish_reason=None, delivered=share.delivered,
            key_id=hold.key_id if hold is not None else None,
            charged_msat=hold.charged_msat if hold is not None else 0, group=share.group,
            base=base if adapter_sha256 is not None else None, adapter_sha256=adapter_sha256)
        if case is not None:
            audits.consider(case)


def _only_file(state: QueenState, model: str) -> str | None:
    """The one file that may serve ``model`` (``catalog.served_files``), or None."""
    files = {sha for sha in state.catalog.served_files(model) or () if sha is not None}
    return next(iter(files)) if len(files) == 1 else None
