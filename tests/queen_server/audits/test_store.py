"""The audit store's part in independent auditors (issue 39), on SQLite and on PostgreSQL when
the tests have one: the outvoted count survives with the standing (migration 0008), and a
worker's first connection is read back in UTC and never moves when it reconnects."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest

from queen_server.audits.decision import Standing
from queen_server.audits.store import AuditStore, Record
from queen_server.storage.engine import Database
from tests.support.postgres import POSTGRES_URL, fresh_database

KEY = "a" * 64


@pytest.fixture(params=["sqlite", *(["postgresql"] if POSTGRES_URL else [])])
async def database(request: pytest.FixtureRequest, tmp_path) -> AsyncIterator[Database]:
    async def made(url: str) -> Database:
        db = Database(url)
        await db.upgrade()
        return db

    if request.param == "sqlite":
        db = await made(f"sqlite+aiosqlite:///{tmp_path / 'audits.sqlite3'}")
        yield db
        await db.close()
        return
    async with fresh_database("apiary_audits") as url:
        db = await made(url)
        yield db
        await db.close()


async def test_the_outvoted_count_is_kept_with_the_standing(database: Database) -> None:
    store = AuditStore(database.engine)
    assert (await store.record(KEY)).outvoted == 0  # no row yet
    await store.save(KEY, Record(Standing(audited=3, state="good"), outvoted=2))
    record = await store.record(KEY)
    assert (record.outvoted, record.standing.state, record.standing.audited) == (2, "good", 3)
    await store.save(KEY, Record(record.standing, outvoted=3))
    assert (await store.standings())[KEY].outvoted == 3


async def test_first_seen_is_the_first_connection_in_utc(database: Database) -> None:
    store = AuditStore(database.engine)
    assert await store.first_seen(KEY) is None  # never connected
    before = datetime.now(UTC)
    await database.record_worker(KEY, "w1", None, "1.0")
    first = await store.first_seen(KEY)
    assert first is not None
    assert first.tzinfo is not None
    assert before - timedelta(seconds=1) <= first <= datetime.now(UTC)
    await database.record_worker(KEY, "w1", None, "1.1")  # it reconnects later
    assert await store.first_seen(KEY) == first
