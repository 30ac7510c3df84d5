"""Fine-tuning jobs in the queen's database (tables ``fine_tuning_jobs``, ``_events``,
``_checkpoints`` and ``_uploads``): every read for a caller names the job's owner, so no query can
hand one caller another's job (another's id reads as no job at all). The runner's and the
transfers' reads (``attempt_row``, ``upload``, ``last_checkpoint``) name the job by its id alone:
they serve a worker, which proves its attempt with a token, never a caller."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import delete, func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from queen_server.storage.tables import (
    FineTuningCheckpointRow,
    FineTuningEventRow,
    FineTuningJobRow,
    FineTuningUploadRow,
)
from shared_schema.finetune import (
    CheckpointMetrics,
    FineTuningJob,
    JobCheckpoint,
    JobError,
    JobEvent,
    ResolvedHyperparameters,
    ResolvedMethod,
)

EVENT_PREFIX = "ftevent-"
CHECKPOINT_PREFIX = "ftckpt-"
# An event: (level, message), or (level, message, metrics data) for a step's "metrics" event.
Event = tuple[str, str] | tuple[str, str, dict[str, Any]]


def _event_values(job_id: str, event: Event) -> dict[str, Any]:
    data = event[2] if len(event) > 2 else None  # type: ignore[misc]
    return {"job_id": job_id, "created_at": datetime.now(UTC), "level": event[0],
            "type": "metrics" if data is not None else "message", "message": event[1],
            "data_json": json.dumps(data) if data is not None else None}


def as_utc(value: datetime | None) -> datetime | None:
    """SQLite gives times back without their zone: they are UTC."""
    if value is None:
        return None
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def _seconds(value: datetime | None) -> int | None:
    value = as_utc(value)
    return int(value.timestamp()) if value is not None else None


@dataclass(frozen=True, slots=True)
class JobPage:
    rows: list[Any]
    has_more: bool


# The error code of a job whose adapter did not beat the base on its held-out examples.
NOT_LEARNED = "adapter_not_learned"

class JobStore:
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def add(self, values: dict[str, Any], events: list[Event]) -> None:
        """A new job and its first events (level, message), in one transaction."""
        async with self.engine.begin() as conn:
            await conn.execute(insert(FineTuningJobRow).values(values))
            for event in events:
                await conn.execute(insert(FineTuningEventRow).values(
                    _event_values(values["id"], event)))

    async def get(self, owner: str, job_id: str) -> Any | None:
        async with self.engine.connect() as conn:
            return (await conn.execute(select(FineTuningJobRow).where(
                FineTuningJobRow.id == job_id, FineTuningJobRow.owner == owner))).first()

    async def unfinished(self) -> list[Any]:
        """Every job still validating, queued or running (at start, and for the queue's
        deadline)."""
        async with self.engine.connect() as conn:
            return list((await conn.execute(select(FineTuningJobRow).where(
                FineTuningJobRow.status.in_(("validating_files", "queued", "running")))))
                .all())

    async def not_learned_counts(self) -> dict[str, int]:
        """Per training worker's key, its jobs that failed because their adapter did not beat
        the base on the held-out examples (the worker of the job's last attempt)."""
        async with self.engine.connect() as conn:
            rows = (await conn.execute(
                select(FineTuningJobRow.worker_key, func.count()).where(
                    FineTuningJobRow.error_code == NOT_LEARNED,
                    FineTuningJobRow.worker_key.is_not(None))
                .group_by(FineTuningJobRow.worker_key))).all()
        return {key: int(count) for key, count in rows}

    async def using(self, owner: str, file_id: str) -> str | None:
        """An unfinished job of ``owner`` that trains on (or validates with) ``file_id``."""
        async with self.engine.connect() as conn:
            return (await conn.execute(select(FineTuningJobRow.id).where(
                FineTuningJobRow.owner == owner,
                FineTuningJobRow.status.in_(("validating_files", "queued", "running")),
                (FineTuningJobRow.training_file == file_id)
                | (FineTuningJobRow.validation_file == file_id)).limit(1))).scalar()

    async def page(self, owner: str, *, after: str | None, limit: int) -> JobPage | None:
        """The owner's jobs, newest first, after the job ``after`` (None: no such job of its)."""
        query = select(FineTuningJobRow).where(FineTuningJobRow.owner == owner)
        async with self.engine.connect() as conn:
            if after is not None:
                cursor = (await conn.execute(select(FineTuningJobRow.created_at,
                                                    FineTuningJobRow.id).where(
                    FineTuningJobRow.id == after, FineTuningJobRow.owner == owner))).first()
                if cursor is None:
                    return None
                query = query.where(
                    (FineTuningJobRow.created_at < cursor.created_at)
                    | ((FineTuningJobRow.created_at == cursor.created_at)
                       & (FineTuningJobRow.id < cursor.id)))
            rows = list((await conn.execute(query.order_by(
                FineTuningJobRow.created_at.desc(), FineTuningJobRow.id.desc())
                .limit(limit + 1))).all())
        return JobPage(rows[:limit], len(rows) > limit)

    async def change(self, job_id: str, values: dict[str, Any],
                     event: Event | None = None, *,
                     only_from: tuple[str, ...] = (), attempt: int | None = None) -> bool:
        """Update a job (only while its status is one of ``only_from``, when given, and its
        current attempt is ``attempt``, when given) and add an event, in one transaction; False
        if the job was not so."""
        async with self.engine.begin() as conn:
            query = update(FineTuningJobRow).where(FineTuningJobRow.id == job_id)
            if only_from:
                query = query.where(FineTuningJobRow.status.in_(only_from))
            if attempt is not None:
                query = query.where(FineTuningJobRow.attempt == attempt)
            changed = (await conn.execute(query.values(values))).rowcount
            if not changed:
                return False
            if event is not None:
                await conn.execute(insert(FineTuningEventRow).values(_event_values(job_id,
                                                                                   event)))
        return True

    # --- training on workers ------------------------------------------------------------------

    async def attempt_row(self, job_id: str) -> Any | None:
        """A job by its id alone (for the runner and a worker's transfers)."""
        async with self.engine.connect() as conn:
            return (await conn.execute(select(FineTuningJobRow).where(
                FineTuningJobRow.id == job_id))).first()

    async def add_upload(self, job_id: str, attempt: int, name: str, sha256: str,
                         size_bytes: int, location: str) -> None:
        """Record an upload, in place of the attempt's earlier one of that name (whose bytes
        stay: a checkpoint kept from them may point there)."""
        async with self.engine.begin() as conn:
            await conn.execute(delete(FineTuningUploadRow).where(
                FineTuningUploadRow.job_id == job_id,
                FineTuningUploadRow.attempt == attempt, FineTuningUploadRow.name == name))
            await conn.execute(insert(FineTuningUploadRow).values(
                job_id=job_id, attempt=attempt, name=name, sha256=sha256, size_bytes=size_bytes,
                location=location, created_at=datetime.now(UTC)))

    async def upload(self, job_id: str, attempt: int, name: str) -> Any | None:
        async with self.engine.connect() as conn:
            return (await conn.execute(select(FineTuningUploadRow).where(
                FineTuningUploadRow.job_id == job_id, FineTuningUploadRow.attempt == attempt,
                FineTuningUploadRow.name == name))).first()

    async def add_checkpoint(self, job_id: str, *, step: int, train_loss: float,
                             trained_tokens: int, sha256: str, size_bytes: int,
                             location: str) -> None:
        async with self.engine.begin() as conn:
            await conn.execute(insert(FineTuningCheckpointRow).values(
                id=f"{CHECKPOINT_PREFIX}{job_id.removeprefix('ftjob-')}-{step}",
                job_id=job_id, created_at=datetime.now(UTC), step=step, train_loss=train_loss,
                valid_loss=None, location=location, sha256=sha256, size_bytes=size_bytes,
                trained_tokens=trained_tokens))

    async def last_checkpoint(self, job_id: str) -> Any | None:
        async with self.engine.connect() as conn:
            return (await conn.execute(select(FineTuningCheckpointRow).where(
                FineTuningCheckpointRow.job_id == job_id).order_by(
                FineTuningCheckpointRow.step.desc()).limit(1))).first()

    async def checkpoints(self, job_id: str, *, after: str | None, limit: int) -> JobPage:
        """A job's checkpoints, newest (latest step) first, after the checkpoint ``after``."""
        query = select(FineTuningCheckpointRow).where(FineTuningCheckpointRow.job_id == job_id)
        async with self.engine.connect() as conn:
            if after is not None:
                step = (await conn.execute(select(FineTuningCheckpointRow.step).where(
                    FineTuningCheckpointRow.id == after,
                    FineTuningCheckpointRow.job_id == job_id))).scalar()
                if step is None:
                    return JobPage([], False)
                query = query.where(FineTuningCheckpointRow.step < step)
            rows = list((await conn.execute(query.order_by(
                FineTuningCheckpointRow.step.desc()).limit(limit + 1))).all())
        return JobPage(rows[:limit], len(rows) > limit)

    async def last_event_at(self, job_id: str) -> datetime | None:
        """When the job's newest event was written (a running job's runner writes one at least
        every report: an old one means no replica is running it)."""
        async with self.engine.connect() as conn:
            return as_utc(await conn.scalar(select(func.max(FineTuningEventRow.created_at))
                                            .where(FineTuningEventRow.job_id == job_id)))

    async def events(self, job_id: str, *, after: str | None, limit: int) -> JobPage:
        """A job's events, newest first (``after``: an event id, ``ftevent-<n>``)."""
        query = select(FineTuningEventRow).where(FineTuningEventRow.job_id == job_id)
        if after is not None:
            try:
                query = query.where(FineTuningEventRow.id < int(after.removeprefix(EVENT_PREFIX)))
            except ValueError:
                return JobPage([], False)
        async with self.engine.connect() as conn:
            rows = list((await conn.execute(query.order_by(FineTuningEventRow.id.desc())
                                            .limit(limit + 1))).all())
        return JobPage(rows[:limit], len(rows) > limit)

    # --- fine-tuned models (``finetune.models``) ------------------------------------------------

    async def served_models(self) -> list[Any]:
        """Every job whose model is served: succeeded, with an adapter, not deleted."""
        async with self.engine.connect() as conn:
            return list((await conn.execute(select(FineTuningJobRow).where(
                FineTuningJobRow.status == "succeeded",
                FineTuningJobRow.fine_tuned_model.is_not(None),
                FineTuningJobRow.model_deleted_at.is_(None)))).all())

    async def by_model(self, name: str) -> Any | None:
        """The job that made the model ``name`` (whoever owns it: the caller checks)."""
        async with self.engine.connect() as conn:
            return (await conn.execute(select(FineTuningJobRow).where(
                FineTuningJobRow.fine_tuned_model == name).limit(1))).first()

    async def delete_model(self, owner: str, job_id: str) -> bool:
        """Mark ``owner``'s job's model deleted; False if it was not its, or already was."""
        async with self.engine.begin() as conn:
            return bool((await conn.execute(update(FineTuningJobRow).where(
                FineTuningJobRow.id == job_id, FineTuningJobRow.owner == owner,
                FineTuningJobRow.model_deleted_at.is_(None)).values(
                model_deleted_at=datetime.now(UTC)))).rowcount)


def job_of(row: Any) -> FineTuningJob:
    """The ``fine_tuning.job`` object of a row."""
    hyper = ResolvedHyperparameters(batch_size=row.batch_size, n_epochs=row.n_epochs,
                                    learning_rate_multiplier=row.learning_rate_multiplier)
    error = (JobError(code=row.error_code, message=row.error_message or "",
                      param=row.error_param) if row.error_code else None)
    return FineTuningJob(
        id=row.id, created_at=_seconds(row.created_at) or 0, error=error,
        fine_tuned_model=row.fine_tuned_model, finished_at=_seconds(row.finished_at),
        hyperparameters=hyper,
        method=ResolvedMethod(supervised={"hyperparameters": hyper.model_dump()}),
        model=row.model, organization_id=row.owner.split(":", 1)[0], seed=row.seed,
        status=row.status, trained_tokens=row.trained_tokens,
        training_file=row.training_file, validation_file=row.validation_file,
        estimated_finish=_seconds(row.estimated_finish),
        metadata=json.loads(row.metadata_json) if row.metadata_json else None,
        user_provided_suffix=row.suffix)


def event_of(row: Any) -> JobEvent:
    return JobEvent(id=f"{EVENT_PREFIX}{row.id}", created_at=_seconds(row.created_at) or 0,
                    level=row.level, message=row.message, type=row.type,
                    data=json.loads(row.data_json) if row.data_json else None)


def checkpoint_of(row: Any, fine_tuned_model: str) -> JobCheckpoint:
    """The ``fine_tuning.job.checkpoint`` object of a row; ``fine_tuned_model``: the name the
    job's model has (or will have), of which the checkpoint is ``...:ckpt-step-N``."""
    return JobCheckpoint(
        id=row.id, created_at=_seconds(row.created_at) or 0,
        fine_tuned_model_checkpoint=f"{fine_tuned_model}:ckpt-step-{row.step}",
        fine_tuning_job_id=row.job_id,
        metrics=CheckpointMetrics(step=row.step, train_loss=row.train_loss,
                                  valid_loss=row.valid_loss),
        step_number=row.step)
