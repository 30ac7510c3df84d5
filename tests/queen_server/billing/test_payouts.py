"""Payouts over Lightning against a fake LNURL service and a fake LNbits speaking the real
formats: paid once, never twice, and nothing lost when the queen dies half-way."""

from __future__ import annotations

from datetime import UTC, datetime

import httpx
import pytest
from sqlalchemy import insert, select, update

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


# --- hostile LNURL services: one fails only its own payout ------------------------------------

HONEST_1, HOSTILE, HONEST_2 = "a1" * 32, "b2" * 32, "c3" * 32

HOSTILE_SERVICES = {
    "minSendable 1e999": lambda evil: evil.answer_next(
        evil.pay_request_text("alice", minSendable="1e999")),
    "minSendable NaN": lambda evil: evil.answer_next(
        evil.pay_request_text("alice", minSendable="NaN")),
    "maxSendable Infinity": lambda evil: evil.answer_next(
        evil.pay_request_text("alice", maxSendable="Infinity")),
    "maxSendable a huge int": lambda evil: evil.answer_next(
        evil.pay_request_text("alice", maxSendable="1" + "0" * 40)),
    "minSendable 5000 digits": lambda evil: evil.answer_next(
        evil.pay_request_text("alice", minSendable="9" * 5000)),
    "malformed JSON": lambda evil: evil.answer_next('{"tag": "payRequest", "callback": '),
    "nested too deep": lambda evil: evil.answer_next("[" * 100_000),
    "metadata nested too deep": lambda evil: evil.answer_next(
        evil.pay_request_text("alice", metadata='"' + "[" * 100_000 + '"')),
    "callback not a URL": lambda evil: evil.answer_next(
        evil.pay_request_text("alice", callback='"http://[::1/cb"')),
    "no answer (timeout)": lambda evil: evil.hang_next(),
    "callback never answers": lambda evil: evil.hang_next(at="callback"),
    "invoice expiring in 2**40 s": lambda evil: evil.next_invoice(expiry_s=2**40),
    "invoice not JSON": lambda evil: evil.answer_next("<html>", at="callback"),
}


@pytest.fixture
def honest_2():
    with FakeLnurlServer(("bob",)) as server:
        yield server


@pytest.fixture
def evil():
    with FakeLnurlServer(("alice",)) as server:
        yield server


@pytest.fixture
def crowd_lnbits(lnurl, honest_2):
    with FakeLnbits(network=(lnurl, honest_2)) as wallet:
        yield wallet


@pytest.fixture
async def crowd(world, lnurl, honest_2, evil):
    """Three workers due a payout, the middle one (by key) on a hostile LNURL service."""
    database, store, _ = world
    now = datetime.now(UTC)
    addresses = {HONEST_1: lnurl.address("alice"), HOSTILE: evil.address("alice"),
                 HONEST_2: honest_2.address("bob")}
    async with database.engine.begin() as conn:
        await conn.execute(update(WorkerRecord).values(ln_url=None))  # world's own worker
        for n, (key, ln_url) in enumerate(addresses.items()):
            await conn.execute(insert(WorkerRecord).values(
                key=key, public_id=f"c{n}", ln_url=ln_url, worker_version="t",
                first_seen=now, last_seen=now))
    for key in addresses:
        await store.post(ledger.Posting(f"earned:{key}", "charge", (
            (ledger.DEPOSITS, -EARNED), (ledger.worker_available(key), EARNED))))
    return world


# The honest services must answer inside the LNURL timeout even on a loaded CI machine (0.5 s
# once timed out an honest one there); only the plays that hang wait it out, with a short one.
HANGING = {"no answer (timeout)", "callback never answers"}


def crowd_runner(world, lnbits, **settings):
    database, store, http = world
    settings.setdefault("lnurl_timeout_s", 30.0)
    queen = QueenSettings(lnurl_insecure_hosts="127.0.0.1", payout_threshold_sats=1000,
                          **settings)
    return PayoutRunner(queen, database.engine, store,
                        LnbitsBackend(lnbits.url, lnbits.admin_key, http), http)


async def balance(world, account: str) -> int:
    return (await world[1].balances()).get(account, 0)


@pytest.mark.parametrize("name", HOSTILE_SERVICES)
async def test_a_hostile_service_fails_only_its_own_payout(crowd, crowd_lnbits, evil, name):
    HOSTILE_SERVICES[name](evil)
    timeout = {"lnurl_timeout_s": 2.0} if name in HANGING else {}
    report = await crowd_runner(crowd, crowd_lnbits, **timeout).run_once()

    assert (report.paid, report.failed) == (2, 1)
    assert len(crowd_lnbits.sent) == 2
    rows = {row.worker_key: row for row in await payouts(crowd)}
    assert rows[HONEST_1].state == rows[HONEST_2].state == "paid"
    assert rows[HOSTILE].state == "failed"
    assert rows[HOSTILE].detail  # the reason, for the worker's earnings page
    assert rows[HOSTILE].bolt11 is None  # nothing from it was ever stored to pay
    for key in (HONEST_1, HONEST_2):
        assert await balance(crowd, ledger.worker_paid(key)) == EARNED
    assert await balance(crowd, ledger.worker_available(HOSTILE)) == EARNED
    assert await balance(crowd, ledger.PAYOUTS_IN_FLIGHT) == 0
    assert (await crowd[1].check()).clean

    # The next pass leaves the hostile service alone until its backoff has passed.
    asked = len(evil.requests)
    again = await crowd_runner(crowd, crowd_lnbits).run_once()
    assert again == type(again)()
    assert len(evil.requests) == asked
    assert len(await payouts(crowd)) == 3


async def test_a_failed_worker_is_tried_again_once_its_backoff_has_passed(
        crowd, crowd_lnbits, evil):
    evil.answer_next(evil.pay_request_text("alice", minSendable="1e999"))
    first = await crowd_runner(crowd, crowd_lnbits, payout_retry_base_s=0).run_once()
    assert (first.paid, first.failed) == (2, 1)
    # The service mends its ways; with no backoff left the worker is paid on the next pass.
    # (Its invoices come from a service the fake LNbits cannot route to: that fails too, as a
    # payment, but only after the LNURL side worked.)
    second = await crowd_runner(crowd, crowd_lnbits, payout_retry_base_s=0).run_once()
    assert second.failed == 1
    assert evil.count(contains="/callback") == 1
    rows = [row for row in await payouts(crowd) if row.worker_key == HOSTILE]
    assert [row.state for row in rows] == ["failed", "failed"]
    assert rows[1].bolt11 is not None


async def test_a_bug_in_the_queen_fails_only_that_payout_loudly(
        crowd, crowd_lnbits, evil, monkeypatch, caplog):
    from queen_server.payouts import runner as runner_module

    real = runner_module.fetch_invoice

    async def buggy(address, amount_msat, client, **kwargs):
        if address.original == evil.address("alice"):
            raise KeyError("a queen bug")
        return await real(address, amount_msat, client, **kwargs)

    monkeypatch.setattr(runner_module, "fetch_invoice", buggy)
    with caplog.at_level("ERROR", logger="queen_server.payouts.runner"):
        report = await crowd_runner(crowd, crowd_lnbits).run_once()
    assert (report.paid, report.failed) == (2, 1)
    [record] = [r for r in caplog.records if r.levelname == "ERROR"]
    assert "BUG" in record.getMessage()
    assert record.exc_info is not None
    rows = {row.worker_key: row for row in await payouts(crowd)}
    assert rows[HOSTILE].detail == "an internal error in the queen; it will be tried again"
    assert await balance(crowd, ledger.worker_available(HOSTILE)) == EARNED
    assert (await crowd[1].check()).clean


async def test_a_payout_address_resolving_to_loopback_is_refused(world, lnbits, lnurl):
    """The worker's address names a public-looking host that resolves to 127.0.0.1, where the
    fake LNURL service listens: nothing is asked of it, the payout fails saying why, and the
    detail on the worker's earnings page names no address."""
    async with world[0].engine.begin() as conn:
        await conn.execute(update(WorkerRecord).values(ln_url="alice@pay.evil.example"))

    async def dns(host, port):
        return ["127.0.0.1"]

    database, store, http = world
    settings = QueenSettings(lnurl_insecure_hosts="127.0.0.1", payout_threshold_sats=1000)
    report = await PayoutRunner(settings, database.engine, store,
                                LnbitsBackend(lnbits.url, lnbits.admin_key, http), http,
                                resolver=dns).run_once()
    assert report.failed == 1
    [payout] = await payouts(world)
    assert "resolves to a loopback address, so it was refused" in payout.detail
    assert "127.0.0.1" not in payout.detail
    assert lnurl.requests == []
    assert lnbits.sent == []
    await assert_money(world, available=EARNED, paid=0)
