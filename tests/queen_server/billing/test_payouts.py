"""Payouts over Lightning against a fake LNURL service and a fake LNbits speaking the real
formats: paid once, never twice, and nothing lost when the queen dies half-way."""

from __future__ import annotations

from datetime import UTC, datetime

import httpx
import pytest
from sqlalchemy import insert, select

from queen_server.billing import ledger
from queen_server.billing.store import LedgerStore
from queen_server.payouts.lightning import LnbitsBackend, NoneBackend
from queen_server.payouts.runner import PayoutRunner
from queen_server.settings import QueenSettings
from queen_server.storage.engine import Database
from queen_server.storage.tables import Payout, WorkerRecord
from tests.support.fake_lightning import FakeLnbits, FakeLnurlServer

WORKER = "ab" * 32
EARNED = 5_000_000  # msat: 5,000 sats, over the 1,000-sat threshold


@pytest.fixture
def lnurl():
    with FakeLnurlServer() as server:
        yield server


@pytest.fixture
def lnbits(lnurl):
    with FakeLnbits(network=lnurl) as wallet:
        yield wallet


@pytest.fixture
async def world(tmp_path, db_url, lnurl):
    """A queen database with one worker who earned 5,000 sats and has a payout address."""
    database = Database(db_url)
    await database.upgrade()
    store = LedgerStore(database.engine)
    now = datetime.now(UTC)
    async with database.engine.begin() as conn:
        await conn.execute(insert(WorkerRecord).values(
            key=WORKER, public_id="w1", ln_url=lnurl.address("alice"), worker_version="t",
            first_seen=now, last_seen=now))
    await store.post(ledger.Posting("earned:1", "charge", (
        (ledger.DEPOSITS, -EARNED), (ledger.worker_available(WORKER), EARNED))))
    async with httpx.AsyncClient(timeout=5, trust_env=False) as http:
        yield database, store, http
    await database.close()


def runner(world, backend=None, lnbits=None):
    database, store, http = world
    settings = QueenSettings(lnurl_insecure_hosts="127.0.0.1", payout_threshold_sats=1000)
    if backend is None:
        backend = LnbitsBackend(lnbits.url, lnbits.admin_key, http)
    return PayoutRunner(settings, database.engine, store, backend, http)


async def payouts(world) -> list:
    async with world[0].engine.connect() as conn:
        return (await conn.execute(select(Payout).order_by(Payout.id))).all()


async def assert_money(world, *, available: int, paid: int) -> None:
    store = world[1]
    balances = await store.balances()
    assert balances.get(ledger.worker_available(WORKER), 0) == available
    assert balances.get(ledger.worker_paid(WORKER), 0) == paid
    assert balances.get(ledger.PAYOUTS_IN_FLIGHT, 0) == 0
    report = await store.check()
    assert report.clean, report


async def test_a_worker_over_the_threshold_is_paid_once(world, lnbits):
    report = await runner(world, lnbits=lnbits).run_once()
    assert report.paid == 1
    assert len(lnbits.sent) == 1
    [payout] = await payouts(world)
    assert (payout.state, payout.amount_msat) == ("paid", EARNED)
    assert payout.payment_hash
    await assert_money(world, available=0, paid=EARNED)
    again = await runner(world, lnbits=lnbits).run_once()  # nothing left to pay
    assert again.paid == 0
    assert len(lnbits.sent) == 1


async def test_a_crash_after_paying_is_reconciled_without_paying_twice(world, lnbits):
    # The payment goes through, then LNbits drops off, so not even the backend's own status
    # check can tell: the pass ends not knowing.
    lnbits.crash_next_payment("drop", stay_down=True)
    first = await runner(world, lnbits=lnbits).run_once()
    assert first.paid == 0
    assert first.waiting == 1
    [payout] = await payouts(world)
    assert payout.state == "invoiced"
    # "Restart": LNbits is back, and a new runner reconciles from the database alone.
    lnbits.come_back()
    second = await runner(world, lnbits=lnbits).run_once()
    assert second.paid == 1
    assert len(lnbits.sent) == 1
    await assert_money(world, available=0, paid=EARNED)


async def test_a_crash_before_the_invoice_returns_the_money_then_pays_once(world, lnbits):
    await runner(world, lnbits=lnbits)._record(WORKER, EARNED, "ignored")  # then the crash
    balances = await world[1].balances()
    assert balances[ledger.PAYOUTS_IN_FLIGHT] == EARNED
    report = await runner(world, lnbits=lnbits).run_once()
    assert (report.failed, report.paid) == (1, 1)  # the stale record, then a fresh payout
    assert len(lnbits.sent) == 1
    assert [p.state for p in await payouts(world)] == ["failed", "paid"]
    await assert_money(world, available=0, paid=EARNED)


async def test_a_wrong_invoice_is_never_paid(world, lnbits, lnurl):
    lnurl.next_invoice(amount_delta_msat=1)
    report = await runner(world, lnbits=lnbits).run_once()
    assert report.failed == 1
    assert lnbits.sent == []
    [payout] = await payouts(world)
    assert "asks for 5000001 msat" in payout.detail
    await assert_money(world, available=EARNED, paid=0)


async def test_a_failed_payment_returns_the_money(world, lnbits):
    lnbits.fail_next_payment("no route found")
    report = await runner(world, lnbits=lnbits).run_once()
    assert report.failed == 1
    await assert_money(world, available=EARNED, paid=0)


async def test_without_a_backend_payouts_are_recorded_for_an_admin(world, lnurl):
    report = await runner(world, backend=NoneBackend()).run_once()
    assert report.manual == 1
    [payout] = await payouts(world)
    assert payout.state == "manual"
    assert lnurl.requests == []  # nothing asked of any Lightning service
    balances = await world[1].balances()
    assert balances[ledger.PAYOUTS_IN_FLIGHT] == EARNED


async def test_a_worker_without_an_address_is_not_paid(world, lnbits):
    from sqlalchemy import update

    async with world[0].engine.begin() as conn:
        await conn.execute(update(WorkerRecord).values(ln_url=None))
    report = await runner(world, lnbits=lnbits).run_once()
    assert report == type(report)()
    await assert_money(world, available=EARNED, paid=0)
