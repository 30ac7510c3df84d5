"""``AdapterCheck``: a trained adapter scored on the job's held-out examples before the job
succeeds (issue 37; the rule is ``checks``).

Each held-out example (at most ``finetune_check_examples``, each cut to the scorer's context)
is a ``score`` job twice on one scorer: once on the base model, once on base plus the new
adapter (``Job.adapter``, read from the queen with a token for that adapter's hash and that
scorer, while the job still runs: ``Transfers.adapter``). The scorer is a connected, unflagged
worker with ``lora`` and ``score`` that holds the base (the same file as the trainer's, when
the trainer said which): the operator's trusted auditors first, then any worker other than the
trainer; the trainer itself only when no other exists (the job's events say so). A scorer that
fails, goes away, stays silent past ``finetune_check_timeout_s`` or answers scores that cannot
be the same text twice is left, and the check starts again on another, at most
``finetune_check_max_scorers`` in all.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from queen_server.finetune.checks import (
    HoldOut,
    Scored,
    ScoreRequest,
    Verdict,
    example_of,
    fitted,
    judge,
    mismatched,
)
from queen_server.finetune.heldout import held_lines, held_of
from queen_server.finetune.models import FineTunedModel
from queen_server.finetune.plan import fine_tuned_name
from queen_server.swarm.jobs import JobHandle, WorkerLost, answer_budget
from shared_schema import Chunk, JobError, Result
from shared_schema.audits import SCORE_URL, ScoreData, ScoreJob
from shared_schema.capabilities import LORA, SCORE
from shared_schema.errors import InvalidScoreData

if TYPE_CHECKING:
    from collections.abc import Callable

    from queen_server.files.service import Files
    from queen_server.settings import QueenSettings
    from queen_server.swarm.dispatch import Dispatcher
    from queen_server.swarm.registry import Registry
    from queen_server.swarm.worker import Worker
    from shared_schema.training import AdapterRef

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Candidate:
    """The adapter to check: where it is and what it is."""

    sha256: str
    size_bytes: int


@dataclass(frozen=True, slots=True)
class Checked:
    verdict: Verdict
    scorer_id: str
    on_trainer: bool


@dataclass(frozen=True, slots=True)
class Unchecked:
    """No example to score (the adapter is not judged), with why."""

    reason: str


@dataclass(frozen=True, slots=True)
class Uncheckable:
    """No scorer could check it (none, or every one tried failed): why."""

    reason: str


CheckOutcome = Checked | Unchecked | Uncheckable


class ScorerFailed(Exception):
    """A scorer that could not be believed or did not answer."""


class AdapterCheck:
    def __init__(self, settings: QueenSettings, files: Files, registry: Registry,
                 dispatcher: Dispatcher, secret: Callable[[], bytes | None],
                 holdout: HoldOut) -> None:
        self.settings = settings
        self.files = files
        self.registry = registry
        self.dispatcher = dispatcher
        self.secret = secret
        self.holdout = holdout
        self._seq = 0

    async def examples(self, row: Any) -> list[ScoreRequest]:
        """The job's held-out examples to score (those with an answer to score)."""
        if row.validation_file is not None:
            record = await self.files.get(row.owner, row.validation_file)
            indexes = self.holdout.sample(record.examples, row.seed)
        else:
            record = await self.files.get(row.owner, row.training_file)
            indexes = held_of(row, record, self.holdout)
        found = [example_of(line) for line in
                 await held_lines(self.files, record.location, indexes)]
        return [example for example in found if example is not None]

    def choose(self, model: str, trainer: Worker, tried: set[str]) -> Worker | None:
        """The scorer of ``model``'s adapter: trusted first, then one that is not the trainer,
        then the least busy; never one tried already."""
        trained_on = trainer.models.get(model)
        sha256 = trained_on.sha256 if trained_on is not None else None
        trusted = set(self.settings.trusted_auditors)

        def able(worker: Worker) -> bool:
            held = worker.models.get(model)
            return (worker.key not in tried and LORA in worker.capabilities
                    and SCORE in worker.capabilities and held is not None
                    and (sha256 is None or held.sha256 in (None, sha256))
                    and not (worker.flagged or worker.paused or worker.closed
                             or worker.held_by)
                    and worker.free_slots > 0
                    and self.registry.connection(worker.key) is not None)

        found = sorted((worker for worker in self.registry.holders(model) if able(worker)),
                       key=lambda worker: (worker.key not in trusted, worker.key == trainer.key,
                                           worker.active_jobs))
        return found[0] if found else None

    async def check(self, row: Any, trainer: Worker, candidate: Candidate,
                    note: Callable[[str], Any]) -> CheckOutcome:
        """Score the held-out examples with the base and with the candidate adapter; ``note``
        adds an event to the job (awaited)."""
        examples = (await self.examples(row))[: max(1, self.settings.finetune_check_examples)]
        if not examples:
            return Unchecked("no held-out example has an assistant answer to score")
        tried: set[str] = set()
        last = "no worker with the lora and score capabilities holds the base model"
        while len(tried) < self.settings.finetune_check_max_scorers:
            scorer = self.choose(row.model, trainer, tried)
            if scorer is None:
                break
            tried.add(scorer.key)
            on_trainer = scorer.key == trainer.key
            await note(f"Checking the adapter on {len(examples)} held-out example(s) on "
                       f"worker {scorer.public_id}"
                       + (" (the worker that trained it: no other can score it now)"
                          if on_trainer else ""))
            try:
                verdict = await self._score_all(row, scorer, candidate, examples)
            except ScorerFailed as exc:
                last = f"scorer {scorer.public_id} failed: {exc}"
                log.info("fine-tuning job %s: %s", row.id, last)
                continue
            return Checked(verdict, scorer.public_id, on_trainer)
        return Uncheckable(last)

    async def _score_all(self, row: Any, scorer: Worker, candidate: Candidate,
                         examples: list[ScoreRequest]) -> Verdict:
        secret = self.secret()
        if secret is None:
            raise ScorerFailed("the queen has no adapters' secret")
        name = fine_tuned_name(row.model, row.suffix, row.id)
        model = FineTunedModel(name=name, base=row.model, owner=row.owner, job_id=row.id,
                               created=0, sha256=candidate.sha256,
                               size_bytes=candidate.size_bytes)
        ref = model.ref(secret, scorer.key)
        held = scorer.models.get(row.model)
        context = held.context_length if held is not None else None
        base: list[Scored] = []
        adapted: list[Scored] = []
        for example in examples:
            cut = fitted(example, context)
            if cut is None:
                continue
            base.append(await self._score(scorer, row.model, cut, None))
            adapted.append(await self._score(scorer, name, cut, ref))
        if not base:
            raise ScorerFailed("no held-out example fits its context")
        at = mismatched(base, adapted)
        if at is not None:
            raise ScorerFailed(f"it counted different tokens in example {at} for the base and "
                               "the adapter")
        return judge(base, adapted, self.settings.finetune_check_margin)

    async def _score(self, scorer: Worker, model: str, example: ScoreRequest,
                     adapter: AdapterRef | None) -> Scored:
        """One score job on ``scorer``; ``ScorerFailed`` unless it answers a valid score."""
        connection = self.registry.connection(scorer.key)
        if connection is None or scorer.closed or scorer.free_slots <= 0:
            raise ScorerFailed("it has no free slot or left")
        self._seq += 1
        job = ScoreJob(model=model, kind="chat", request=example.request(model),
                       answer=example.answer).model_dump(exclude_defaults=True)
        loop = asyncio.get_running_loop()
        handle = JobHandle(f"ftcheck-{self._seq}-{scorer.public_id[:8]}", model, scorer.key,
                           loop.time(), worker_id=scorer.public_id,
                           cancel=connection.send_cancel,
                           budget=answer_budget(job, self.settings.default_max_tokens))
        self.registry.lease(scorer, handle)
        try:
            await connection.send_job(handle.id, SCORE_URL, job, None, None, adapter=adapter)
            deadline = loop.time() + self.settings.finetune_check_timeout_s
            event = await handle.next(deadline)
            while isinstance(event, Chunk):
                event = await handle.next(deadline)
        except TimeoutError:
            raise ScorerFailed(f"no score within {self.settings.finetune_check_timeout_s:g} s"
                               ) from None
        except Exception as exc:
            raise ScorerFailed(f"sending the score job failed: {exc}") from exc
        finally:
            await self.dispatcher.end(handle, "check done")
        if isinstance(event, WorkerLost):
            raise ScorerFailed(f"it was lost: {event.reason}")
        if isinstance(event, JobError):
            raise ScorerFailed(f"it failed the score job: {event.message[:300]}")
        if not isinstance(event, Result):
            raise ScorerFailed(f"it answered {type(event).__name__}")
        try:
            data = ScoreData.read(event.data)
        except InvalidScoreData as exc:
            raise ScorerFailed(str(exc)) from exc
        return Scored(tuple(data.logprobs))
