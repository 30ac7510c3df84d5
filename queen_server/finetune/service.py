"""``FineTuning``: the fine-tuning jobs' work, between the HTTP edge and the stores (issue 37).

A job is created whole or not at all: its files are the caller's own and for fine-tuning
(``Files``: another's reads as none), its base model is one a connected worker with the
``train`` capability holds (else a 400 naming ``model``, before anything is held), its
hyperparameters are resolved from the data (``plan.resolve``), and the most it can cost (the
queen's own bound on its trained tokens, ``plan.bound_trained_tokens``, at the training rate:
the base model's completion rate times ``finetune_price_factor``) is held from the caller's
balance (402 when it cannot pay). Then it is ``queued`` with OpenAI's first events.

A job no worker takes within ``finetune_queue_timeout_s`` fails and its hold goes back; a
cancelled one is charged what was trained until then (nothing, before it ran); a queen that
restarts alone fails the jobs it left unfinished (its restart released every reservation), with
an event saying why. A job's hold outlives any request's, so the sweep of a dead replica's
stale reservations leaves it (``Billing.own_reservations``); beside replicas, a job ended on a
replica that does not hold its ``Hold`` (another's, or one that is gone) is released from the
ledger by its id (``Billing.release_job``).

A queued job goes to a worker through the ``TrainingRunner`` of the replica that took it (which
holds its ``Hold``); it ends through ``succeed`` (the hold settled at the trained tokens, the
worker credited its share through ``Billing.finish``, as any job) or ``fail`` (nothing charged).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from queen_server.errors import InvalidRequest, NotFound
from queen_server.files.errors import FileNotFound
from queen_server.finetune.heldout import holdout_of
from queen_server.finetune.models import FineTunedModels
from queen_server.finetune.plan import (
    TrainingData,
    bound_trained_tokens,
    fine_tuned_name,
    resolve,
)
from queen_server.finetune.runner import Run, Succeeded, TrainingRunner
from queen_server.finetune.store import JobStore, as_utc, checkpoint_of, event_of, job_of
from queen_server.finetune.transfers import Transfers
from queen_server.swarm.jobs import Part
from shared_schema.capabilities import TRAIN
from shared_schema.files import FINE_TUNE
from shared_schema.finetune import (
    FINISHED,
    FineTuningJob,
    FineTuningJobCreate,
    JobCheckpoint,
    JobEvent,
)

if TYPE_CHECKING:
    from queen_server.billing.pricing import Price
    from queen_server.billing.service import Billing, Hold, Principal
    from queen_server.files.service import Files
    from queen_server.settings import QueenSettings
    from queen_server.swarm.dispatch import Dispatcher
    from queen_server.swarm.registry import Registry
    from queen_server.swarm.worker import Worker

log = logging.getLogger(__name__)

JOB_PREFIX = "ftjob-"
# A running job with no event for this many progress timeouts, and no run on this replica, was
# left by a replica that is gone (its own runner fails a silent attempt after one).
ORPHAN_AFTER = 3
SWEEP_S = 30.0  # how often queued jobs are checked against their deadline


class JobNotFound(NotFound):
    code = "fine_tuning_job_not_found"

    def __init__(self, job_id: str) -> None:
        shown = job_id if len(job_id) <= 64 else job_id[:61] + "..."
        super().__init__(f"No such fine-tuning job: {shown}", param="fine_tuning_job_id")


class ModelNotTrainable(InvalidRequest):
    code = "model_not_available"


class JobNotCancellable(InvalidRequest):
    code = "job_not_cancellable"


def new_job_id() -> str:
    return JOB_PREFIX + secrets.token_hex(12)


def job_bound(run: Run) -> int:
    return run.progress.bound_tokens


class FineTuning:
    def __init__(self, settings: QueenSettings, store: JobStore, files: Files,
                 billing: Billing, holders: Callable[[str], Iterable[Worker]],
                 price_of: Callable[[str], Price], *, registry: Registry | None = None,
                 dispatcher: Dispatcher | None = None) -> None:
        self.settings = settings
        self.store = store
        self.files = files
        self.billing = billing
        self.holders = holders  # the connected workers holding a model
        self.price_of = price_of
        self._holds: dict[str, Hold] = {}  # this replica's jobs' holds, until they finish
        self._sweeper: asyncio.Task[None] | None = None
        # The workers' transfers and the runner (with a registry: not in tests of the API
        # alone); both use the secret the database shares between replicas, read at start.
        self.secret: bytes | None = None
        self.transfers = Transfers(store, files, holdout_of(settings))
        # The succeeded jobs' models, served to their owners (``models``).
        self.models = FineTunedModels(store, settings.finetune_models_refresh_s,
                                      lambda: self.secret)
        self.runner = (TrainingRunner(settings, store, files, registry, dispatcher, self,
                                      lambda: self.secret)
                       if registry is not None and dispatcher is not None else None)
        # A job's hold lasts as long as the job, hours past any request's: the ledger's sweep
        # of stale reservations leaves it to this service.
        billing.own_reservations(JOB_PREFIX)

    # --- lifecycle ------------------------------------------------------------------------------

    async def start(self, *, recover: bool = True, secret: bytes | None = None) -> None:
        """Fail the jobs a previous run left unfinished (their holds are gone; not beside
        replicas, whose jobs these may be), then watch the queue's deadline and run the
        queue. ``secret``: the transfers' shared secret (none: no job is dispatched)."""
        self.secret = self.transfers.secret = secret
        await self.models.start()
        for row in await self.store.unfinished() if recover else []:
            await self._end(row.id, "failed", ("error", "The queen restarted before this job "
                                               "finished; nothing was charged."),
                            error=("queen_restarted", "The queen restarted before this job "
                                   "finished.", None), only_from=(row.status,))
        self._sweeper = asyncio.create_task(self._sweep(), name="fine-tuning deadlines")
        if self.runner is not None and secret is not None:
            self.runner.start()

    async def stop(self) -> None:
        await self.models.stop()
        if self.runner is not None:
            await self.runner.stop()
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            try:
                await self.expire(datetime.now(UTC))
            except Exception:
                log.exception("the fine-tuning queue's deadline check failed")

    async def expire(self, now: datetime) -> int:
        """Fail every job queued longer than ``finetune_queue_timeout_s``, and every running
        job no replica runs any more (none here, and no event for ``ORPHAN_AFTER`` progress
        timeouts: the replica that ran it is gone, and its hold is released from the ledger);
        how many."""
        ended = 0
        for row in await self.store.unfinished():
            created = as_utc(row.created_at)
            assert created is not None
            if row.status == "running":
                ended += await self._orphaned(row.id, now)
                continue
            if row.status != "queued" or (
                    now - created).total_seconds() < self.settings.finetune_queue_timeout_s:
                continue
            waited = int(self.settings.finetune_queue_timeout_s)
            if await self._end(row.id, "failed", ("error", f"No worker took this job within "
                                                  f"{waited} s; nothing was charged."),
                               error=("no_worker", f"No worker that can train {row.model} took "
                                      f"this job within {waited} s.", "model"),
                               only_from=("queued",)):
                ended += 1
        return ended

    async def _orphaned(self, job_id: str, now: datetime) -> int:
        """Fail a running job that no replica runs (1), or leave it (0)."""
        if self.runner is not None and self.runner.running(job_id) is not None:
            return 0
        silent_s = ORPHAN_AFTER * self.settings.finetune_progress_timeout_s
        last = await self.store.last_event_at(job_id)
        if last is not None and (now - last).total_seconds() < silent_s:
            return 0
        message = (f"The queen replica running this job was lost: no progress for "
                   f"{int(silent_s)} s. Nothing was charged.")
        ended = await self._end(job_id, "failed", ("error", message),
                                error=("replica_lost", message, None), only_from=("running",))
        return 1 if ended else 0

    # --- the API ------------------------------------------------------------------------------

    async def create(self, principal: Principal, owner: str,
                     request: FineTuningJobCreate) -> FineTuningJob:
        training = await self._file(owner, request.training_file, "training_file")
        if request.validation_file is not None:
            await self._file(owner, request.validation_file, "validation_file")
        self._trainable(request.model)
        # The file's own bytes bound its text: every message's JSON (at least 30 bytes) more
        # than covers the template's per-message tokens, so none are counted again.
        data = TrainingData(examples=training.examples, messages=0, text_bytes=training.bytes)
        hyper = resolve(request.asked, data)
        bound = bound_trained_tokens(data, hyper.n_epochs)
        job_id = new_job_id()
        price = self.training_price(request.model)
        hold = await self.billing.hold(principal, job_id, price, [], {"max_tokens": bound},
                                       completion_limit="max_tokens")
        if hold is not None:  # a job may wait and train for hours: it takes no request slot
            await self.billing.limits.release(hold.lease)
            hold.lease = None
        try:
            values = {
                "id": job_id, "owner": owner,
                "key_id": principal.key.id if principal.key is not None else None,
                "created_at": datetime.now(UTC), "model": request.model,
                "training_file": request.training_file,
                "validation_file": request.validation_file, "suffix": request.suffix,
                "seed": request.seed if request.seed is not None else secrets.randbelow(2**31),
                "n_epochs": hyper.n_epochs, "batch_size": hyper.batch_size,
                "learning_rate_multiplier": hyper.learning_rate_multiplier,
                "status": "validating_files", "bound_tokens": bound,
                "held_msat": hold.reserved_msat if hold is not None else 0,
                "metadata_json": json.dumps(request.metadata) if request.metadata else None,
            }
            await self.store.add(values, [
                ("info", f"Validating training file: {request.training_file}"),
            ])
        except BaseException:
            await self.billing.finish(hold)  # nothing was made: the hold goes back whole
            raise
        if hold is not None:
            self._holds[job_id] = hold
        made = await self.get(owner, job_id)  # as OpenAI answers a create: validating_files
        # The files were checked whole at upload and found the caller's own just now: the job
        # moves on to the queue at once (a cancel may have come first).
        if await self.store.change(job_id, {"status": "queued"},
                                   ("info", "Files validated, moving job to queued state"),
                                   only_from=("validating_files",)):
            if self.runner is not None:
                self.runner.queued(job_id)
            log.info("fine-tuning job %s for %s queued: %s, %d examples, %d epochs, at most "
                     "%d tokens", job_id, owner, request.model, training.examples,
                     hyper.n_epochs, bound)
        return made

    async def get(self, owner: str, job_id: str) -> FineTuningJob:
        row = await self.store.get(owner, job_id)
        if row is None:
            raise JobNotFound(job_id)
        return job_of(row)

    async def page(self, owner: str, *, after: str | None,
                   limit: int) -> tuple[list[FineTuningJob], bool]:
        found = await self.store.page(owner, after=after, limit=limit)
        if found is None:
            raise InvalidRequest(f"Invalid value for 'after': no fine-tuning job {after} of "
                                 "yours to list after.", param="after")
        return [job_of(row) for row in found.rows], found.has_more

    async def events(self, owner: str, job_id: str, *, after: str | None,
                     limit: int) -> tuple[list[JobEvent], bool]:
        await self.get(owner, job_id)  # another's job reads as none
        found = await self.store.events(job_id, after=after, limit=limit)
        return [event_of(row) for row in found.rows], found.has_more

    async def cancel(self, owner: str, job_id: str) -> FineTuningJob:
        """Cancel a job that has not finished: a running attempt here is stopped (its worker
        sent a ``Cancel``) and charged what it reported trained until then (capped by the
        queen's bound); nothing before it ran. A finished one answers 400, as at OpenAI."""
        job = await self.get(owner, job_id)
        if job.status in FINISHED:
            raise JobNotCancellable(f"Job {job_id} has already {job.status} and cannot be "
                                    "cancelled.", param="fine_tuning_job_id")
        run = await self.runner.halt(job_id) if self.runner is not None else None
        tokens = min(run.progress.trained_tokens, job_bound(run)) if run is not None else 0
        message = (f"Job was cancelled; {tokens} trained tokens were charged." if tokens
                   else "Job was cancelled; nothing was charged.")
        parts = ([Part(key, 0, part_tokens, completed=False)
                  for key, part_tokens in self.runner.credits(job_id, run, tokens)]
                 if self.runner is not None and run is not None and tokens else None)
        if not await self._end(job_id, "cancelled", ("info", message),
                               only_from=("validating_files", "queued", "running"),
                               parts=parts, values={"trained_tokens": tokens} if run else None):
            return await self.cancel(owner, job_id)  # it changed meanwhile: read it again
        return await self.get(owner, job_id)

    async def checkpoints(self, owner: str, job_id: str, *, after: str | None,
                          limit: int) -> tuple[list[JobCheckpoint], bool]:
        job = await self.get(owner, job_id)  # another's job reads as none
        name = job.fine_tuned_model or self.model_name(job.model, job.user_provided_suffix,
                                                       job.id)
        found = await self.store.checkpoints(job_id, after=after, limit=limit)
        return [checkpoint_of(row, name) for row in found.rows], found.has_more

    @staticmethod
    def model_name(base: str, suffix: str | None, job_id: str) -> str:
        return fine_tuned_name(base, suffix, job_id)

    # --- the runner's ends (``runner.Ender``) ---------------------------------------------------

    async def succeed(self, job_id: str, attempt: int, outcome: Succeeded,
                      credits: Sequence[tuple[str | None, int]]) -> bool:
        """The attempt delivered its adapter: the job succeeds with its model named, the
        adapter's place kept, and the hold settled at the trained tokens, each worker credited
        its share of them (``credits``: earnings key, tokens; a resumed job's earlier workers
        for their work up to the checkpoint it went on from)."""
        row = await self.store.attempt_row(job_id)
        if row is None:
            return False
        name = fine_tuned_name(row.model, row.suffix, job_id)
        values = {"fine_tuned_model": name, "trained_tokens": outcome.trained_tokens,
                  "adapter_location": outcome.adapter_location,
                  "adapter_sha256": outcome.adapter_sha256,
                  "adapter_size_bytes": outcome.adapter_size_bytes, "estimated_finish": None}
        done = await self._end(job_id, "succeeded",
                               ("info", f"The job has successfully completed: new fine-tuned "
                                        f"model {name}, {outcome.trained_tokens} trained tokens"),
                               only_from=("running",), attempt=attempt, values=values,
                               parts=[Part(key, 0, tokens) for key, tokens in credits]
                               or [Part(None, 0, outcome.trained_tokens)])
        if done:
            await self.models.added(name)  # served at once
            log.info("fine-tuning job %s succeeded: %s, %d tokens", job_id, name,
                     outcome.trained_tokens)
        return done

    async def fail(self, job_id: str, attempt: int, code: str, message: str) -> bool:
        """The job failed on its worker(s): nothing is charged."""
        return await self._end(job_id, "failed", ("error", f"{message} Nothing was charged."),
                               error=(code, message, None), only_from=("running",),
                               attempt=attempt)


    async def check_deletable(self, owner: str, file_id: str) -> None:
        """A file an unfinished job of its owner needs cannot be deleted (400 naming the job):
        the job would lose its data mid-run."""
        job_id = await self.store.using(owner, file_id)
        if job_id is not None:
            raise InvalidRequest(f"File {file_id} is used by fine-tuning job {job_id}, which "
                                 "has not finished: cancel the job first, or wait for it.",
                                 param="file_id", code="file_in_use")

    # --- pieces -------------------------------------------------------------------------------

    def training_price(self, model: str) -> Price:
        """A trained token at the base model's completion rate times ``finetune_price_factor``
        (its prompt rate unused)."""
        price = self.price_of(model)
        rate = max(1, round(price.completion_msat_per_1k * self.settings.finetune_price_factor))
        return replace(price, prompt_msat_per_1k=0, completion_msat_per_1k=rate)

    def _trainable(self, model: str) -> None:
        if any(TRAIN in worker.capabilities and not worker.flagged and not worker.closed
               for worker in self.holders(model)):
            return
        held = any(True for _ in self.holders(model))
        why = ("no connected worker that trains holds it (workers opt in to training)" if held
               else "no connected worker holds it")
        raise ModelNotTrainable(f"The model {model!r} cannot be fine-tuned here now: {why}.",
                                param="model")

    async def _file(self, owner: str, file_id: str, param: str) -> Any:
        try:
            record = await self.files.get(owner, file_id)
        except FileNotFound:
            raise InvalidRequest(f"invalid {param}: no file {file_id} of yours",
                                 param=param, code="invalid_file") from None
        if record.purpose != FINE_TUNE:
            raise InvalidRequest(f"invalid {param}: file {file_id} has purpose "
                                 f"{record.purpose!r}, not 'fine-tune'", param=param,
                                 code="invalid_file")
        return record

    async def _end(self, job_id: str, status: str, event: tuple[str, str], *,
                   error: tuple[str, str, str | None] | None = None,
                   only_from: tuple[str, ...], attempt: int | None = None,
                   values: dict[str, Any] | None = None,
                   parts: list[Part] | None = None) -> bool:
        """Finish a job: its status, error, event and ``values`` in one step (only from
        ``only_from``, and only while ``attempt`` is its current one when given), then its
        hold settled: at ``parts``' trained tokens, each worker credited its share through
        billing; nothing trained, nothing charged."""
        changes: dict[str, Any] = {**(values or {}), "status": status,
                                   "finished_at": datetime.now(UTC)}
        if error is not None:
            changes.update(error_code=error[0], error_message=error[1], error_param=error[2])
        changed = await self.store.change(job_id, changes, event, only_from=only_from,
                                          attempt=attempt)
        if changed:
            if self.runner is not None:
                self.runner.forget(job_id)
            hold = self._holds.pop(job_id, None)
            if hold is not None:
                await self.billing.finish(hold, parts=parts)
                if hold.charged_msat:
                    await self.store.change(job_id, {"charged_msat": hold.charged_msat})
            else:  # another replica's job, or one whose replica is gone: from the ledger
                await self.billing.release_job(job_id)
        return changed

