"""Persisting worker performance: loaded at start, written every few seconds (only the workers
whose numbers changed) and at shutdown, so routing and pages survive a restart.

Counts are written as differences (``jobs_served = jobs_served + n``), so queen replicas that
share the database never overwrite each other's: a worker that moved from one replica to
another keeps every job either counted. With replicas (``reload_s``), each one also reads the
rows back every few seconds, so its pages show what the others counted; speeds are written by
the replica that holds the worker (it serves its jobs: ``queen_server.replicas``) and read
back by the others only for workers they do not hold.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from queen_server.stats.ema import Speed
from queen_server.stats.swarm import SwarmStats, WorkerStats
from queen_server.storage.tables import WorkerRecord, WorkerSpeed

log = logging.getLogger(__name__)


def _when(value: datetime | None) -> float | None:
    if value is None:
        return None
    return (value if value.tzinfo else value.replace(tzinfo=UTC)).timestamp()


class StatsStore:
    def __init__(self, engine: AsyncEngine, stats: SwarmStats, interval_s: float = 10.0, *,
                 reload: bool = False) -> None:
        self.engine = engine
        self.stats = stats
        self.interval_s = interval_s
        self.reload = reload  # read the rows back after each write (replicas share them)
        self._task: asyncio.Task[None] | None = None

    async def load(self) -> None:
        """Read every worker's row: what this replica has not written yet stays added on top,
        and speeds are taken only for workers not connected here (this replica measures
        those itself)."""
        async with self.engine.connect() as conn:
            workers = (await conn.execute(select(WorkerRecord))).all()
            speeds = (await conn.execute(select(WorkerSpeed))).all()
        for row in workers:
            stats = self.stats.worker(row.key, row.public_id)
            jobs, failures, timeouts, uptime_s = stats.unsaved()
            stats.version = stats.version if stats.connected_at is not None else row.worker_version
            stats.jobs = row.jobs_served + jobs
            stats.failures = row.failures + failures
            stats.timeouts = row.timeouts + timeouts
            stats.uptime_base_s = row.uptime_s + uptime_s
            stats.saved = (row.jobs_served, row.failures, row.timeouts, row.uptime_s)
            seen = _when(row.last_seen)
            if seen is not None and (stats.last_seen is None or seen > stats.last_seen):
                stats.last_seen = seen
        for row in speeds:
            stats = self.stats.workers.get(row.worker_key)
            if stats is not None and stats.connected_at is None:
                speed = Speed(row.prompt_s_per_token, row.completion_s_per_token, row.samples)
                stats.speeds[row.size_class] = speed
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
                if self.reload:
                    await self.load()
            except SQLAlchemyError:
                log.exception("could not save worker stats; trying again in %s s",
                              self.interval_s)

    async def flush(self) -> int:
        """Write every changed worker; returns how many."""
        dirty = [stats for stats in self.stats.workers.values() if stats.dirty]
        if not dirty:
            return 0
        written = []
        for stats in dirty:
            stats.dirty = False
            written.append((stats, stats.unsaved(), (stats.jobs, stats.failures, stats.timeouts,
                                                     stats.uptime_base_s)))
        insert = pg_insert if self.engine.dialect.name == "postgresql" else sqlite_insert
        try:
            async with self.engine.begin() as conn:
                for stats, (jobs, failures, timeouts, uptime_s), _ in written:
                    await self._write(conn, insert, stats, jobs, failures, timeouts, uptime_s)
        except BaseException:
            for stats, _, _ in written:
                stats.dirty = True  # written next time, differences and all
            raise
        for stats, _, now_saved in written:
            stats.saved = now_saved
        return len(dirty)

    async def _write(self, conn: AsyncConnection, insert: Any, stats: WorkerStats, jobs: int,
                     failures: int, timeouts: int, uptime_s: float) -> None:
        last_seen = (datetime.fromtimestamp(stats.last_seen, UTC)
                     if stats.last_seen is not None else None)
        values: dict[str, Any] = {
            "jobs_served": WorkerRecord.jobs_served + jobs,
            "failures": WorkerRecord.failures + failures,
            "timeouts": WorkerRecord.timeouts + timeouts,
            "uptime_s": WorkerRecord.uptime_s + uptime_s}
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
