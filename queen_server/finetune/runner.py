"""``TrainingRunner``: fine-tuning jobs leave the queue for workers (issue 37).

Every ``finetune_dispatch_interval_s`` (and at once when a job is queued), each queued job this
replica took (in the order they came) goes to a connected, unflagged, unpaused worker with the
``train`` capability that holds its base model and has a free slot, preferring one that has not
failed it. Claiming it is one guarded update (``queued`` to ``running`` with the next attempt),
so the job runs once. The attempt is an ordinary job on the worker's link (``TRAIN_URL``, its
``TrainOrder``), leased like any job; its events are read with a progress deadline
(``finetune_progress_timeout_s`` between two reports), never a request's total timeout.

Each report is checked (``progress``); an accepted one is the job's newest event and its
``trained_tokens`` and ``estimated_finish``; a checkpoint is kept only when the queen received
that upload whole, with that hash. A ``Result`` succeeds the job only with the adapter upload
the queen hashed itself, and only once that adapter lowered the loss on the job's held-out
examples (``evaluation``; it fails ``adapter_not_learned`` otherwise, counted against its
trainer, and ``adapter_unchecked`` when no scorer could check it: nothing charged either way).
A lost worker, a retryable error, a lie or a silence past the deadline
puts the job back in the queue, to resume from its last kept checkpoint (at most
``finetune_max_attempts`` attempts in all); a non-retryable error fails it. Ending a job (and
its money) is the service's: ``Ender``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import ValidationError

from queen_server.finetune.checks import Verdict
from queen_server.finetune.evaluation import AdapterCheck, Candidate, Checked, Unchecked
from queen_server.finetune.heldout import held_of, holdout_of, split_of
from queen_server.finetune.orders import (
    OrderFacts,
    resume_url,
    train_order,
    transfer_token,
    upload_limit_bytes,
)
from queen_server.finetune.progress import AttemptProgress, Lie
from queen_server.finetune.store import NOT_LEARNED
from queen_server.swarm.jobs import JobHandle, WorkerLost
from shared_schema import Chunk, JobError, Result
from shared_schema.capabilities import TRAIN
from shared_schema.finetune import FINISHED
from shared_schema.protocol import TrainReport
from shared_schema.training import (
    ADAPTER_NAME,
    TRAIN_URL,
    ResumeFrom,
    TrainResultData,
    train_job_id,
    train_memory_mb,
)

if TYPE_CHECKING:
    from queen_server.files.service import Files
    from queen_server.finetune.store import JobStore
    from queen_server.settings import QueenSettings
    from queen_server.swarm.dispatch import Dispatcher
    from queen_server.swarm.registry import Registry
    from queen_server.swarm.worker import Worker

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Succeeded:
    trained_tokens: int
    steps: int
    adapter_location: str
    adapter_sha256: str
    adapter_size_bytes: int
    verdict: Verdict | None = None  # the held-out check's, once it ran


@dataclass(frozen=True, slots=True)
class Retry:
    reason: str


@dataclass(frozen=True, slots=True)
class Failed:
    message: str
    code: str = "training_failed"


@dataclass(frozen=True, slots=True)
class Gone:
    """The job is no longer this attempt's (cancelled, or ended elsewhere)."""


Outcome = Succeeded | Retry | Failed | Gone


class Ender(Protocol):
    """Who ends jobs and settles their money (``FineTuning``)."""

    async def succeed(self, job_id: str, attempt: int, outcome: Succeeded,
                      credits: Sequence[tuple[str | None, int]]) -> bool: ...

    async def fail(self, job_id: str, attempt: int, code: str, message: str) -> bool: ...


@dataclass(slots=True)
class Run:
    """An attempt under way here."""

    worker: Worker
    progress: AttemptProgress
    task: asyncio.Task[None] | None = None
    handle: JobHandle | None = None
    finishing: bool = False  # past its last event: a cancel no longer stops it
    start_tokens: int = 0  # trained before this attempt (its resume checkpoint's)
    kept: tuple[int, int] | None = None  # (step, tokens) of the last checkpoint it made kept


@dataclass(slots=True)
class _Avoid:
    keys: set[str] = field(default_factory=set)


def merged_credits(credits: list[tuple[str | None, int]]) -> list[tuple[str | None, int]]:
    """Each worker once, with the tokens of all its parts, in first-seen order; none at 0."""
    totals: dict[str | None, int] = {}
    for key, tokens in credits:
        totals[key] = totals.get(key, 0) + tokens
    return [(key, tokens) for key, tokens in totals.items() if tokens > 0]


class TrainingRunner:
    def __init__(self, settings: QueenSettings, store: JobStore, files: Files,
                 registry: Registry, dispatcher: Dispatcher, ender: Ender,
                 secret: Callable[[], bytes | None]) -> None:
        self.settings = settings
        self.store = store
        self.files = files
        self.registry = registry
        self.dispatcher = dispatcher
        self.ender = ender
        self.secret = secret
        self._mine: dict[str, _Avoid] = {}  # this replica's unfinished jobs, in queue order
        # Per job, who trained what of it in earlier attempts (earnings key, tokens): the work
        # up to the checkpoint the job resumed from, credited to the worker that made it.
        self._credits: dict[str, list[tuple[str | None, int]]] = {}
        self._runs: dict[str, Run] = {}
        self._kick = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.holdout = holdout_of(settings)
        self.checker = AdapterCheck(settings, files, registry, dispatcher, secret, self.holdout)
        self.not_learned: dict[str, int] = {}  # adapters that did not learn, by trainer key
        # The parameter count of a base model as the queen read it (its catalog), if known.
        self.parameters_of: Callable[[str], int | None] | None = None

    # --- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        self._loop_task = asyncio.create_task(self._loop(), name="fine-tuning dispatch")

    async def stop(self) -> None:
        tasks = [task for task in (self._loop_task, *self._tasks) if task is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def queued(self, job_id: str) -> None:
        """A job this replica took is queued: offer it to a worker now."""
        self._mine.setdefault(job_id, _Avoid())
        self._kick.set()

    def forget(self, job_id: str) -> None:
        self._mine.pop(job_id, None)
        self._credits.pop(job_id, None)

    def credits(self, job_id: str, run: Run | None, total: int) -> list[tuple[str | None, int]]:
        """Whom ``total`` trained tokens of ``job_id`` are credited to (earnings key, tokens):
        each earlier attempt's worker for its work up to the checkpoint the job went on from,
        and ``run``'s worker for the rest (a cancel charges and credits what was trained)."""
        earlier = list(self._credits.get(job_id, ()))
        done = sum(tokens for _key, tokens in earlier)
        if run is not None:
            earlier.append((run.worker.earnings_key, max(0, total - done)))
        return merged_credits(earlier)

    def running(self, job_id: str) -> Run | None:
        return self._runs.get(job_id)

    async def halt(self, job_id: str) -> Run | None:
        """Stop the attempt of ``job_id`` running here (its worker is sent a ``Cancel``); the
        run as it stood, or None when none runs here or it is already finishing."""
        run = self._runs.get(job_id)
        if run is None or run.finishing or run.task is None:
            return None
        run.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await run.task
        return run

    # --- dispatch -------------------------------------------------------------------------------

    async def _loop(self) -> None:
        try:  # whose adapters did not learn, as the database remembers (every replica's)
            self.not_learned = await self.store.not_learned_counts()
        except Exception:
            log.exception("cannot read which trainers' adapters did not learn")
        while True:
            try:
                await self.dispatch()
            except Exception:
                log.exception("dispatching fine-tuning jobs failed")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.settings.finetune_dispatch_interval_s):
                    await self._kick.wait()
            self._kick.clear()

    async def dispatch(self) -> int:
        """Give each queued job of this replica a free trainer; how many started."""
        started = 0
        for job_id, avoid in list(self._mine.items()):
            if job_id in self._runs:
                continue
            row = await self.store.attempt_row(job_id)
            if row is None or row.status in FINISHED:
                self.forget(job_id)
                continue
            if row.status != "queued":
                continue
            worker = self.choose(row.model, avoid.keys)
            if worker is None:
                continue
            run = Run(worker, AttemptProgress(row.bound_tokens))
            self._runs[job_id] = run
            task = asyncio.create_task(self._attempt(row, worker, run, avoid),
                                       name=f"training {job_id}")
            run.task = task
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            started += 1
        return started

    def has_memory(self, worker: Worker, model: str) -> bool:
        """Whether ``worker``'s owner lets it use the memory training ``model`` takes
        (``train_memory_mb`` of the queen's own parameter count, else the worker's claim); a
        worker that names no budget is taken at its word."""
        budget = worker.memory_budget_mb
        if budget is None:
            return True
        parameters = self.parameters_of(model) if self.parameters_of is not None else None
        if parameters is None:
            held = worker.models.get(model)
            parameters = held.parameter_count if held is not None else None
        return parameters is None or budget >= train_memory_mb(parameters)

    def choose(self, model: str, avoid: set[str]) -> Worker | None:
        """A free trainer of ``model`` here, one that has not failed the job first; never one
        whose adapters failed the held-out check ``finetune_max_not_learned`` times."""
        limit = self.settings.finetune_max_not_learned
        able = [worker for worker in self.registry.holders(model)
                if TRAIN in worker.capabilities and not (
                    worker.flagged or worker.paused or worker.closed or worker.held_by)
                and self.not_learned.get(worker.key, 0) < limit
                and self.has_memory(worker, model)
                and worker.free_slots > 0 and self.registry.connection(worker.key) is not None]
        able.sort(key=lambda worker: (worker.key in avoid, worker.active_jobs))
        return able[0] if able else None

    # --- one attempt ------------------------------------------------------------------------------

    async def _attempt(self, row: Any, worker: Worker, run: Run, avoid: _Avoid) -> None:
        job_id = row.id
        attempt = row.attempt + 1
        outcome: Outcome = Gone()
        try:
            outcome = await self._run(row, attempt, worker, run)
        except asyncio.CancelledError:
            outcome = Gone()
            raise
        except Exception as exc:
            log.exception("training attempt %s failed on the queen's side", job_id)
            outcome = Retry(f"the queen could not run the attempt: {exc}")
        finally:
            self._runs.pop(job_id, None)
            if run.handle is not None:
                await self.dispatcher.end(run.handle, "training ended")
            if not isinstance(outcome, Gone):
                await self._conclude(job_id, attempt, outcome, run, avoid)

    async def _conclude(self, job_id: str, attempt: int, outcome: Outcome, run: Run,
                        avoid: _Avoid) -> None:
        if isinstance(outcome, Succeeded):
            outcome = await self._checked(job_id, attempt, outcome, run.worker)
        if isinstance(outcome, Succeeded):
            await self.ender.succeed(job_id, attempt, outcome,
                                     self.credits(job_id, run, outcome.trained_tokens))
            self._credits.pop(job_id, None)
        elif isinstance(outcome, Failed):
            self._credits.pop(job_id, None)
            await self.ender.fail(job_id, attempt, outcome.code, outcome.message)
        elif isinstance(outcome, Retry):
            avoid.keys.add(run.worker.key)
            log.info("training attempt %d of %s stopped: %s", attempt, job_id, outcome.reason)
            if attempt >= self.settings.finetune_max_attempts:
                await self.ender.fail(job_id, attempt, "training_failed",
                                      f"Training failed after {attempt} attempt(s); the last "
                                      f"stopped because {outcome.reason}")
                return
            last = await self.store.last_checkpoint(job_id)
            if run.kept is not None and last is not None and last.step == run.kept[0]:
                # the next attempt goes on from this one's checkpoint: its work up to there
                # is this worker's, credited when the job is paid
                self._credits.setdefault(job_id, []).append(
                    (run.worker.earnings_key, max(0, run.kept[1] - run.start_tokens)))
            where = f"step {last.step}" if last is not None else "the start"
            await self.store.change(
                job_id, {"status": "queued", "worker_key": None, "estimated_finish": None},
                ("warn", f"Training attempt {attempt} stopped ({outcome.reason}); the job "
                         f"will resume from {where}."),
                only_from=("running",), attempt=attempt)
            self._kick.set()

    async def _run(self, row: Any, attempt: int, worker: Worker, run: Run) -> Outcome:
        job_id = row.id
        secret = self.secret()
        if secret is None:
            return Gone()
        wire_id = train_job_id(job_id, attempt)
        try:
            record = await self.files.get(row.owner, row.training_file)
        except Exception as exc:
            return Failed(f"The training file {row.training_file} can no longer be read: {exc}")
        split = await split_of(self.files, record, held_of(row, record, self.holdout))
        checkpoint = await self.store.last_checkpoint(job_id)
        resume = None
        if checkpoint is not None and checkpoint.sha256 is not None:
            resume = ResumeFrom(url=resume_url(wire_id), sha256=checkpoint.sha256,
                                size_bytes=checkpoint.size_bytes, step=checkpoint.step,
                                trained_tokens=checkpoint.trained_tokens or 0)
        held = worker.models.get(row.model)
        settings = self.settings
        limit = upload_limit_bytes(held.size_bytes if held is not None else 0,
                                   settings.finetune_upload_factor,
                                   settings.finetune_upload_min_bytes)
        facts = OrderFacts(
            job_id=job_id, model=row.model, n_epochs=row.n_epochs, batch_size=row.batch_size,
            learning_rate_multiplier=row.learning_rate_multiplier, seed=row.seed,
            bound_tokens=row.bound_tokens, examples=split.examples,
            file_sha256=split.sha256, file_bytes=split.size_bytes,
            longest_example_bytes=split.longest_line_bytes,
            model_context=held.context_length if held is not None else None,
            attempt=attempt, resume=resume)
        order = train_order(facts, token=transfer_token(secret, wire_id, worker.key),
                            base_learning_rate=settings.finetune_base_learning_rate,
                            progress_every_steps=settings.finetune_progress_every_steps,
                            checkpoint_every_steps=settings.finetune_checkpoint_every_steps)
        event = (("info", "Fine-tuning job started") if resume is None and attempt == 1 else
                 ("info", f"Fine-tuning job resumed (attempt {attempt}) from "
                          f"{f'step {resume.step}' if resume else 'the start'}"))
        if not await self.store.change(job_id, {"status": "running", "attempt": attempt,
                                                "worker_key": worker.key,
                                                "upload_limit_bytes": limit}, event,
                                       only_from=("queued",)):
            return Gone()
        loop = asyncio.get_running_loop()
        run.start_tokens = resume.trained_tokens if resume else 0
        run.progress = AttemptProgress(row.bound_tokens,
                                       step=resume.step if resume else 0,
                                       trained_tokens=resume.trained_tokens if resume else 0,
                                       started_s=loop.time())
        connection = self.registry.connection(worker.key)
        if connection is None or worker.free_slots <= 0:
            return Retry("the worker left before it was given the job")
        handle = JobHandle(wire_id, row.model, worker.key, loop.time(),
                           worker_id=worker.public_id, cancel=connection.send_cancel)
        self.registry.lease(worker, handle)
        run.handle = handle
        log.info("training attempt %s on %s: %d examples, window %d, at most %d tokens",
                 wire_id, worker.public_id, order.examples, order.n_ctx, order.max_trained_tokens)
        try:
            await connection.send_job(wire_id, TRAIN_URL, order.model_dump(mode="json"), None,
                                      None)
        except Exception as exc:
            return Retry(f"sending the job failed: {exc}")
        return await self._follow(job_id, attempt, handle, run)

    async def _follow(self, job_id: str, attempt: int, handle: JobHandle,
                      run: Run) -> Outcome:
        loop = asyncio.get_running_loop()
        timeout_s = self.settings.finetune_progress_timeout_s
        progress = run.progress
        while True:
            try:
                event = await handle.next(loop.time() + timeout_s)
            except TimeoutError:
                return Retry(f"the worker sent no progress for {timeout_s:g} s")
            try:
                if isinstance(event, TrainReport):
                    if not await self._report(job_id, attempt, event, progress, loop.time(),
                                              run):
                        return Gone()
                    continue
                run.finishing = True
                return await self._end_event(job_id, attempt, event, progress)
            except Lie as lie:
                log.warning("training attempt %d of %s: %s", attempt, job_id, lie)
                return Retry(str(lie))

    async def _report(self, job_id: str, attempt: int, report: TrainReport,
                      progress: AttemptProgress, now_s: float, run: Run) -> bool:
        accepted = progress.report(report)
        if accepted.checkpoint is not None:
            assert report.checkpoint is not None
            upload = await self.store.upload(job_id, attempt, accepted.checkpoint)
            if (upload is None or upload.sha256 != report.checkpoint.sha256
                    or upload.size_bytes != report.checkpoint.size_bytes):
                raise Lie(f"the worker reported checkpoint {accepted.checkpoint} that the queen "
                          "did not receive whole with that hash")
            await self.store.add_checkpoint(
                job_id, step=report.step, train_loss=report.loss,
                trained_tokens=report.trained_tokens, sha256=upload.sha256,
                size_bytes=upload.size_bytes, location=upload.location)
            run.kept = (report.step, report.trained_tokens)
        finish_s = progress.finish_s(now_s)
        values: dict[str, Any] = {"trained_tokens": progress.trained_tokens}
        if finish_s is not None:
            values["estimated_finish"] = _wall(finish_s, now_s)
        return await self.store.change(job_id, values, ("info", accepted.message, accepted.data),
                                       only_from=("running",), attempt=attempt)

    async def _end_event(self, job_id: str, attempt: int, event: object,
                         progress: AttemptProgress) -> Outcome:
        if isinstance(event, WorkerLost):
            return Retry(f"its worker was lost: {event.reason}")
        if isinstance(event, JobError):
            if event.retryable:
                return Retry(f"the worker failed: {event.message[:300]}")
            return Failed(f"The worker could not train this job: {event.message[:500]}")
        if isinstance(event, Chunk):
            raise Lie("the worker sent a chunk for a training job")
        assert isinstance(event, Result)
        try:
            data = TrainResultData.model_validate(event.data)
        except ValidationError as exc:
            raise Lie(f"the worker's result is no training result: "
                      f"{exc.errors(include_url=False)[0]['msg']}") from None
        upload = await self.store.upload(job_id, attempt, ADAPTER_NAME)
        if (upload is None or data.adapter.name != ADAPTER_NAME
                or upload.sha256 != data.adapter.sha256
                or upload.size_bytes != data.adapter.size_bytes):
            raise Lie("the worker's adapter is not the upload the queen received and hashed")
        tokens = progress.final_tokens(event.usage.prompt_tokens)
        return Succeeded(tokens, data.steps, upload.location, upload.sha256, upload.size_bytes)

    # --- the held-out check -------------------------------------------------------------------

    async def _checked(self, job_id: str, attempt: int, outcome: Succeeded,
                       trainer: Worker) -> Outcome:
        """The attempt's adapter checked on the held-out examples (``evaluation``): succeeded
        with both losses when it learned, failed when it did not (counted against its
        trainer) or when no scorer could check it, as it was when there is nothing to score
        or the check is off; ``Gone`` when the job ended meanwhile."""
        if self.settings.finetune_check_examples <= 0:
            return outcome
        row = await self.store.attempt_row(job_id)
        adapter = {"adapter_location": outcome.adapter_location,
                   "adapter_sha256": outcome.adapter_sha256,
                   "adapter_size_bytes": outcome.adapter_size_bytes}
        if row is None or not await self.store.change(job_id, adapter, only_from=("running",),
                                                      attempt=attempt):
            return Gone()

        async def note(message: str, level: str = "info",
                       data: dict[str, Any] | None = None) -> None:
            event = (level, message) if data is None else (level, message, data)
            await self.store.change(job_id, {"estimated_finish": None}, event,
                                    only_from=("running",), attempt=attempt)

        checked = await self.checker.check(
            row, trainer, Candidate(outcome.adapter_sha256, outcome.adapter_size_bytes), note)
        if isinstance(checked, Unchecked):
            await note(f"The adapter was not checked: {checked.reason}.", "warn")
            return outcome
        if not isinstance(checked, Checked):
            log.warning("fine-tuning job %s: its adapter could not be checked: %s", job_id,
                        checked.reason)
            return Failed(f"The adapter could not be checked on the held-out examples: "
                          f"{checked.reason}.", code="adapter_unchecked")
        verdict = checked.verdict
        if not verdict.learned:
            count = self.not_learned[trainer.key] = self.not_learned.get(trainer.key, 0) + 1
            log.warning("fine-tuning job %s: the adapter trained by worker %s did not learn "
                        "(held-out loss %.4f vs base %.4f, scored on %s); %d such adapter(s) "
                        "from that worker", job_id, trainer.public_id, verdict.adapter_loss,
                        verdict.base_loss, checked.scorer_id, count)
            if count >= self.settings.finetune_max_not_learned:
                log.warning("worker %s takes no more fine-tuning jobs: %d of its adapters did "
                            "not learn", trainer.public_id, count)
            return Failed(f"{verdict.message}.", code=NOT_LEARNED)
        await note(verdict.message, "info", verdict.data(outcome.steps))
        return replace(outcome, verdict=verdict)


def _wall(finish_s: float, now_s: float) -> datetime:
    """A loop-clock time as a wall-clock one."""
    return datetime.now(UTC) + timedelta(seconds=max(0.0, finish_s - now_s))
