"""The ledger's group-commit writer: one bad posting fails alone, and the writer lives on."""

from __future__ import annotations

import asyncio

import pytest

from queen_server.billing import ledger
from queen_server.billing.store import LedgerStore, LedgerWriteError
from queen_server.storage.engine import Database


async def test_a_posting_the_database_cannot_store_fails_alone(db_url):
    database = Database(db_url)
    await database.upgrade()
    store = LedgerStore(database.engine)
    store.start()
    try:
        # Queued together, so the writer takes them in one batch.
        good = asyncio.ensure_future(store.post(ledger.deposit(1, 5000, "deposit:good")))
        bad = asyncio.ensure_future(store.post(ledger.deposit(2, 10**30, "deposit:huge")))
        also_good = asyncio.ensure_future(store.post(ledger.deposit(3, 7, "deposit:also")))
        assert await good is True
        with pytest.raises(LedgerWriteError):
            await bad
        assert await also_good is True
        # The writer is still alive for what comes next.
        assert await asyncio.wait_for(store.post(ledger.deposit(1, 1, "deposit:later")), 10)
        money = await store.balances()
        assert money[ledger.key_available(1)] == 5001
        assert ledger.key_available(2) not in money
        assert money[ledger.key_available(3)] == 7
        assert (await store.check()).clean
    finally:
        await store.stop()
        await database.close()
