"""Persisting worker performance: loaded at start, written every few seconds (only the workers
whose numbers changed) and at shutdown, so routing and pages survive a restart."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from datetime import UTC, datetime

from sqlalchemy import select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine

from queen_server.stats.ema import Speed
from queen_server.stats.swarm import SwarmStats
from queen_server.storage.tables import WorkerRecord, WorkerSpeed

log = logging.getLogger(__name__)


def _when(value: datetime | None) -> float | None:
    if value is None:
        return None
    return (value if value.tzinfo else value.replace(tzinfo=UTC)).timestamp()


class StatsStore:
    def __init__(self, engine: AsyncEngine, stats: SwarmStats, interval_s: float = 10.0) -> None:
        self.engine = engine
        self.stats = stats
        self.interval_s = interval_s
        self._task: asyncio.Task[None] | None = None

    async def load(self) -> None:
        async with self.engine.connect() as conn:
            workers = (await conn.execute(select(WorkerRecord))).all()
            speeds = (await conn.execute(select(WorkerSpeed))).all()
        for row in workers:
            stats = self.stats.worker(row.key, row.public_id)
            stats.version = row.worker_version
            stats.jobs, stats.failures, stats.timeouts = row.jobs_served, row.failures, row.timeouts
            stats.uptime_base_s = row.uptime_s
            stats.last_seen = _when(row.last_seen)
        for row in speeds:
            if row.worker_key in self.stats.workers:
                speed = Speed(row.prompt_s_per_token, row.completion_s_per_token, row.samples)
                self.stats.workers[row.worker_key].speeds[row.size_class] = speed
                self.stats.index_speed(row.worker_key, row.size_class, speed)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="stats writer")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.flush()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.flush()
            except SQLAlchemyError:
                log.exception("could not save worker stats; trying again in %s s",
                              self.interval_s)

    async def flush(self) -> int:
        """Write every changed worker; returns how many."""
        dirty = [stats for stats in self.stats.workers.values() if stats.dirty]
        if not dirty:
            return 0
        for stats in dirty:
            stats.dirty = False
        insert = pg_insert if self.engine.dialect.name == "postgresql" else sqlite_insert
        async with self.engine.begin() as conn:
            for stats in dirty:
                last_seen = (datetime.fromtimestamp(stats.last_seen, UTC)
                             if stats.last_seen is not None else None)
                values = {"jobs_served": stats.jobs, "failures": stats.failures,
                          "timeouts": stats.timeouts, "uptime_s": stats.uptime_base_s}
                if last_seen is not None:
                    values["last_seen"] = last_seen
                await conn.execute(update(WorkerRecord).where(WorkerRecord.key == stats.key)
                                   .values(**values))
                for size_class, speed in stats.speeds.items():
                    row = {"worker_key": stats.key, "size_class": size_class,
                           "prompt_s_per_token": speed.prompt_s_per_token,
                           "completion_s_per_token": speed.completion_s_per_token,
                           "samples": speed.samples}
                    statement = insert(WorkerSpeed).values(**row)
                    await conn.execute(statement.on_conflict_do_update(
                        index_elements=["worker_key", "size_class"],
                        set_={k: statement.excluded[k] for k in
                              ("prompt_s_per_token", "completion_s_per_token", "samples")}))
        return len(dirty)
