"""Payouts with several queen replicas on one PostgreSQL database: a pass runs on exactly one
replica at a time (an advisory lock), so every payout is paid exactly once."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import httpx
import pytest
from sqlalchemy import insert, select, text

from queen_server.billing import ledger
from queen_server.billing.store import LedgerStore
from queen_server.payouts.lightning import LnbitsBackend
from queen_server.payouts.runner import PAYOUT_LOCK, PassReport, PayoutRunner
from queen_server.settings import QueenSettings
from queen_server.storage.engine import Database
from queen_server.storage.tables import Payout, WorkerRecord
from tests.support.fake_lightning import FakeLnbits, FakeLnurlServer

WORKERS = [f"{i:02x}" * 32 for i in range(1, 6)]
EARNED = 2_000_000  # msat each, over the 1,000-sat threshold


@pytest.fixture
def lnurl():
    with FakeLnurlServer(names=tuple(f"w{i}" for i in range(len(WORKERS)))) as server:
        yield server


@pytest.fixture
def lnbits(lnurl):
    with FakeLnbits(network=lnurl) as wallet:
        yield wallet


@pytest.fixture
async def replicas(db_url, lnurl, lnbits):
    """Two replicas' payout runners, each with its own engine, on one database where five
    workers are due a payout."""
    if not db_url.startswith("postgresql"):
        pytest.skip("the payout lock is PostgreSQL's (APIARY_TEST_POSTGRES_URL)")
    dbs = [Database(db_url) for _ in range(2)]
    await dbs[0].upgrade()
    now = datetime.now(UTC)
    async with dbs[0].engine.begin() as conn:
        await conn.execute(insert(WorkerRecord), [
            {"key": key, "public_id": f"w{i}", "ln_url": lnurl.address(f"w{i}"),
             "worker_version": "t", "first_seen": now, "last_seen": now}
            for i, key in enumerate(WORKERS)])
    store = LedgerStore(dbs[0].engine)
    for key in WORKERS:
        await store.post(ledger.Posting(f"earned:{key}", "charge", (
            (ledger.DEPOSITS, -EARNED), (ledger.worker_available(key), EARNED))))
    settings = QueenSettings(lnurl_insecure_hosts="127.0.0.1", payout_threshold_sats=1000)
    async with httpx.AsyncClient(timeout=5, trust_env=False) as http:
        yield [PayoutRunner(settings, db.engine, LedgerStore(db.engine),
                            LnbitsBackend(lnbits.url, lnbits.admin_key, http), http)
               for db in dbs], store
    for db in dbs:
        await db.close()


async def test_two_replicas_passing_at_once_pay_every_payout_exactly_once(replicas, lnbits):
    runners, store = replicas
    reports: list[PassReport] = []
    for _ in range(3):
        reports += await asyncio.gather(*(runner.run_once() for runner in runners))
    assert sum(report.paid for report in reports) == len(WORKERS)
    assert len(lnbits.sent) == len(WORKERS)
    async with runners[0].engine.connect() as conn:
        rows = (await conn.execute(select(Payout.worker_key, Payout.state))).all()
    assert sorted(rows) == sorted((key, "paid") for key in WORKERS)
    balances = await store.balances()
    for key in WORKERS:
        assert balances[ledger.worker_available(key)] == 0
        assert balances[ledger.worker_paid(key)] == EARNED
    assert balances.get(ledger.PAYOUTS_IN_FLIGHT, 0) == 0
    assert (await store.check()).clean


async def test_a_pass_is_skipped_while_another_replica_holds_the_lock(replicas, lnbits):
    runners, store = replicas
    async with runners[1].engine.connect() as other:  # another replica, mid-pass
        assert await other.scalar(text("SELECT pg_try_advisory_lock(:k)"), {"k": PAYOUT_LOCK})
        assert await runners[0].run_once() == PassReport()
        assert lnbits.sent == []
        assert (await store.balances())[ledger.worker_available(WORKERS[0])] == EARNED
        await other.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": PAYOUT_LOCK})
    assert (await runners[0].run_once()).paid == len(WORKERS)
    # The lock was given back at the end of the pass: the other replica can take it.
    async with runners[1].engine.connect() as other:
        assert await other.scalar(text("SELECT pg_try_advisory_lock(:k)"), {"k": PAYOUT_LOCK})
        await other.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": PAYOUT_LOCK})
