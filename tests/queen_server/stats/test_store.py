"""Worker records in the database shared by queen replicas (issue 18): counts are written as
differences, so two replicas that both counted jobs of one worker (it moved from one to the
other) lose none of them; reading back gives each replica the others' counts, and speeds of
the workers it does not hold. SQLite, and PostgreSQL when the tests have one."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import create_async_engine

from queen_server.stats.store import StatsStore
from queen_server.stats.swarm import SwarmStats
from queen_server.storage.engine import Database
from queen_server.storage.tables import WorkerRecord
from tests.support.postgres import POSTGRES_URL, fresh_database

KEY = "w" * 64


@pytest.fixture(params=["sqlite", *(["postgresql"] if POSTGRES_URL else [])])
async def database(request: pytest.FixtureRequest, tmp_path) -> AsyncIterator[Database]:
    async def made(url: str) -> Database:
        db = Database(url)
        await db.upgrade()
        await db.record_worker(KEY, "w1", None, "1.0")
        return db

    if request.param == "sqlite":
        db = await made(f"sqlite+aiosqlite:///{tmp_path / 'stats.sqlite3'}")
        yield db
        await db.close()
        return
    async with fresh_database("apiary_stats") as url:
        db = await made(url)
        yield db
        await db.close()


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


async def stored(db: Database) -> tuple[int, int, int, float]:
    async with db.engine.connect() as conn:
        row = (await conn.execute(select(WorkerRecord).where(WorkerRecord.key == KEY))).one()
    return row.jobs_served, row.failures, row.timeouts, row.uptime_s


async def test_two_replicas_counting_one_worker_lose_no_job(database: Database) -> None:
    clock = Clock()
    a, b = SwarmStats(clock), SwarmStats(clock)
    store_a, store_b = StatsStore(database.engine, a), StatsStore(database.engine, b)
    await store_a.load()
    await store_b.load()  # both start with the worker's empty record
    # The worker serves three jobs on A, then moves to B and serves two there.
    a.connected(KEY, "w1", "1.0")
    for i in range(3):
        a.job_done(f"a{i}", KEY, "w1", "m", "tiny", 10, 20, 1.0, 0.1)
    clock.now += 60
    a.disconnected(KEY)
    b.connected(KEY, "w1", "1.0")
    for i in range(2):
        b.job_done(f"b{i}", KEY, "w1", "m", "tiny", 10, 20, 1.0, 0.1)
    b.job_failed("b-lost", KEY, "w1", "m", "worker_lost")
    # B writes first (its memory knew nothing of A's three), then A: neither overwrites.
    assert await store_b.flush() == 1
    assert await store_a.flush() == 1
    jobs, failures, timeouts, uptime_s = await stored(database)
    assert (jobs, failures, timeouts) == (5, 1, 0)
    assert uptime_s == pytest.approx(60)
    # Writing again without news writes nothing twice.
    assert await store_a.flush() == 0
    b.job_done("b2", KEY, "w1", "m", "tiny", 10, 20, 1.0, 0.1)
    await store_b.flush()
    assert (await stored(database))[0] == 6


async def test_reading_back_shows_the_other_replicas_counts_and_keeps_unwritten_ones(
        database: Database) -> None:
    clock = Clock()
    a, b = SwarmStats(clock), SwarmStats(clock)
    store_a = StatsStore(database.engine, a)
    store_b = StatsStore(database.engine, b, reload=True)
    await store_a.load()
    await store_b.load()
    a.connected(KEY, "w1", "1.0")
    for i in range(4):
        a.job_done(f"a{i}", KEY, "w1", "m", "tiny", 10, 20, 2.0, 0.5)
    await store_a.flush()
    b.job_failed("b0", KEY, "w1", "m", "timeout")  # B counted one it has not written yet
    await store_b.load()
    record = b.workers[KEY]
    assert (record.jobs, record.timeouts) == (4, 1)  # A's four, and B's own unwritten one
    # The speed A measured (it holds the worker); B does not, so it takes A's.
    assert record.speeds["tiny"].completion_s_per_token == pytest.approx(
        a.workers[KEY].speeds["tiny"].completion_s_per_token)
    assert KEY in b.speeds_for("tiny")
    await store_b.flush()
    assert (await stored(database))[:3] == (4, 0, 1)


async def test_a_failed_write_is_written_whole_next_time(database: Database, tmp_path) -> None:
    stats = SwarmStats(Clock())
    store = StatsStore(database.engine, stats)
    await store.load()
    stats.job_done("j1", KEY, "w1", "m", "tiny", 1, 2, 1.0, None)
    # The same records, written to a database that cannot be opened.
    unreachable = create_async_engine(f"sqlite+aiosqlite:///{tmp_path}/no/such/dir/x.db")
    with pytest.raises(SQLAlchemyError):
        await StatsStore(unreachable, stats).flush()
    await unreachable.dispose()
    assert stats.workers[KEY].dirty
    await store.flush()
    assert (await stored(database))[0] == 1
