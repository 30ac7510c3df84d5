"""The edges' reads (``storage/queries.py``) against a real, migrated database: what each
returns, in which order, and what it leaves out."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import insert
from sqlalchemy.ext.asyncio import AsyncEngine

from queen_server.storage.engine import Database
from queen_server.storage.queries import (
    LedgerCredit,
    PayoutRow,
    charges_credited,
    recent_payouts,
)
from queen_server.storage.tables import LedgerEntry, LedgerTxn, Payout

ALICE, BOB = "a" * 64, "b" * 64
NOON = datetime(2026, 3, 10, 12, 0, tzinfo=UTC)


@pytest.fixture
async def engine(db_url: str) -> AsyncIterator[AsyncEngine]:
    database = Database(db_url)
    await database.upgrade()
    try:
        yield database.engine
    finally:
        await database.close()


def as_utc(when: datetime) -> datetime:
    """SQLite hands back naive datetimes (UTC), PostgreSQL aware ones."""
    return when if when.tzinfo else when.replace(tzinfo=UTC)


async def add_payouts(engine: AsyncEngine, *payouts: tuple[str, int, str]) -> None:
    rows = [{"worker_key": key, "amount_msat": msat, "ln_url": "w@example.com", "state": state,
             "detail": f"payout {i}", "created_at": NOON, "updated_at": NOON + timedelta(i)}
            for i, (key, msat, state) in enumerate(payouts)]
    async with engine.begin() as conn:
        await conn.execute(insert(Payout), rows)


async def add_txn(engine: AsyncEngine, txn_id: str, kind: str, at: datetime,
                  entries: dict[str, int]) -> None:
    async with engine.begin() as conn:
        await conn.execute(insert(LedgerTxn).values(id=txn_id, kind=kind, memo="", created_at=at))
        await conn.execute(insert(LedgerEntry), [
            {"txn_id": txn_id, "account": account, "amount_msat": msat}
            for account, msat in entries.items()])


async def test_recent_payouts_newest_first_limited_and_by_worker(engine: AsyncEngine) -> None:
    assert await recent_payouts(engine, 10) == []
    await add_payouts(engine, (ALICE, 1000, "paid"), (BOB, 2000, "failed"),
                      (ALICE, 3000, "manual"), (BOB, 4000, "recorded"))
    latest = await recent_payouts(engine, 3)
    assert all(isinstance(row, PayoutRow) for row in latest)
    assert [(r.worker_key, r.amount_msat, r.state, r.detail) for r in latest] == [
        (BOB, 4000, "recorded", "payout 3"), (ALICE, 3000, "manual", "payout 2"),
        (BOB, 2000, "failed", "payout 1")]
    assert latest[0].id > latest[1].id > latest[2].id
    assert as_utc(latest[0].updated_at) == NOON + timedelta(3)
    alices = await recent_payouts(engine, 10, worker_key=ALICE)
    assert [(r.amount_msat, r.state) for r in alices] == [(3000, "manual"), (1000, "paid")]
    assert await recent_payouts(engine, 10, worker_key="c" * 64) == []


async def test_charges_credited_to_some_accounts_since_a_time(engine: AsyncEngine) -> None:
    pending, available = f"worker:{ALICE}:pending", f"worker:{ALICE}:available"
    await add_txn(engine, "settle:old", "charge", NOON - timedelta(days=2),
                  {"key:1:reserved": -30, available: 30})
    await add_txn(engine, "settle:one", "charge", NOON,
                  {"key:1:reserved": -100, pending: 60, available: 20, "queen:fees": 20})
    await add_txn(engine, "deposit:1:x", "deposit", NOON, {"queen:deposits": -500,
                                                             "key:1:available": 500})
    await add_txn(engine, "payout:1", "payout", NOON, {available: -20, "queen:paid": 20})
    await add_txn(engine, "settle:bob", "charge", NOON, {"key:1:reserved": -9,
                                                          f"worker:{BOB}:available": 9})
    await add_txn(engine, "settle:two", "charge", NOON + timedelta(hours=1),
                  {"key:1:reserved": -7, available: 7})

    credits = await charges_credited(engine, [pending, available], NOON - timedelta(days=1))
    assert all(isinstance(credit, LedgerCredit) for credit in credits)
    # Newest transaction first; both of settle:one's credits; no other account or kind.
    assert [c.txn_id for c in credits] == ["settle:two", "settle:one", "settle:one"]
    assert sorted(c.amount_msat for c in credits if c.txn_id == "settle:one") == [20, 60]
    assert as_utc(credits[0].created_at) == NOON + timedelta(hours=1)
    # ``since`` is inclusive, and an older one reaches further back.
    assert [c.txn_id for c in await charges_credited(engine, [available], NOON)] == [
        "settle:two", "settle:one"]
    everything = await charges_credited(engine, [available], NOON - timedelta(days=30))
    assert [c.txn_id for c in everything] == ["settle:two", "settle:one", "settle:old"]
    assert await charges_credited(engine, [], NOON - timedelta(days=30)) == []
