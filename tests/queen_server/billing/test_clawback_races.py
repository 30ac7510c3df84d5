"""Refunds and rebills that cannot race payouts (issue 39, item 8), on SQLite and PostgreSQL.

Two "replicas" (a Billing and a PayoutRunner, each on its own engine: their own connections)
take back and pay out the same worker's earnings. One of them is stopped inside its guarded
step, holding the accounts' locks; the other is started and must wait for it (asserted: it is
not done, and on PostgreSQL its backend waits on a lock); then the first goes on. Whichever ran
second must see the first's effect, and the ledger must balance with no liability below zero.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest
from sqlalchemy import insert, text

from queen_server.billing import ledger
from queen_server.billing.admin import create_key
from queen_server.billing.pricing import Price
from queen_server.billing.service import Billing, Principal
from queen_server.billing.store import LedgerStore, Locked
from queen_server.payouts.lightning import NoneBackend
from queen_server.payouts.runner import PayoutRunner
from queen_server.settings import QueenSettings
from queen_server.storage.engine import Database
from queen_server.storage.tables import WorkerRecord

WORKER = "ab" * 32
PRICE = Price("test", None, 1_000_000, 2_000_000)  # msat per 1k tokens: easy sums
CHARGE = PRICE.cost_msat(100, 100)  # 300,000 msat
SHARE = int(CHARGE * 0.8)  # the worker's part, to its available earnings
EARNED = 60_000  # what the worker earned before the job
LN = "w0@example.com"
CREDIT = 10_000_000


class PausingStore(LedgerStore):
    """A real store whose guarded steps stop, once armed, right after taking their locks."""

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.armed = False
        self.inside = asyncio.Event()
        self.go = asyncio.Event()

    async def read_locked(self, conn, accounts, txns=()) -> Locked:
        locked = await super().read_locked(conn, accounts, txns)
        if self.armed:
            self.armed = False
            self.inside.set()
            await asyncio.wait_for(self.go.wait(), 10)
        return locked


class World:
    def __init__(self, db_url: str) -> None:
        self.url = db_url
        self.settings = QueenSettings(auth="keys", escrow_jobs=0, payout_threshold_sats=10)
        self.dbs = [Database(db_url), Database(db_url)]
        self.billing = Billing(self.settings, self.dbs[0])
        self.billing.ledger = PausingStore(self.dbs[0].engine)
        self.billing.clawbacks.store = self.billing.ledger
        self.runner = PayoutRunner(self.settings, self.dbs[1].engine,
                                   PausingStore(self.dbs[1].engine), NoneBackend(), None)
        self.key_id = 0

    @property
    def store(self) -> LedgerStore:
        return self.billing.ledger

    async def start(self) -> World:
        await self.dbs[0].upgrade()
        now = datetime.now(UTC)
        async with self.dbs[0].engine.begin() as conn:  # past its proof of work: paid at once
            await conn.execute(insert(WorkerRecord).values(
                key=WORKER, public_id="w0", ln_url=LN, worker_version="t", first_seen=now,
                last_seen=now, jobs_settled=5))
        _, record = await create_key(self.billing.keys, self.store, "dev",
                                     credit_msat=CREDIT)
        self.key_id, self.record = record.id, record
        await self.store.post(ledger.Posting("earned:before", "charge", (
            (ledger.DEPOSITS, -EARNED), (ledger.worker_available(WORKER), EARNED))))
        await self.billing.start()
        return self

    async def job(self, job_id: str, prompt: int = 100, completion: int = 100) -> None:
        hold = await self.billing.hold(Principal("dev", self.record), job_id, PRICE, ["hi"],
                                       {"max_tokens": 300})
        await self.billing.finish(hold, prompt_tokens=prompt, completion_tokens=completion,
                                  worker_key=WORKER)

    async def balances(self) -> dict[str, int]:
        return await self.store.balances()

    async def clean(self) -> None:
        report = await self.store.check()
        assert report.clean, report

    async def close(self) -> None:
        await self.billing.stop()
        for db in self.dbs:
            await db.close()


@pytest.fixture
async def world(db_url):
    world = await World(db_url).start()
    yield world
    await world.close()


async def assert_waits(world: World, task: asyncio.Task) -> None:
    """``task`` is blocked on the locks the paused step holds (not done; on PostgreSQL, its
    backend is seen waiting on a lock)."""
    if world.url.startswith("postgresql"):
        async with world.dbs[0].engine.connect() as conn:
            for _ in range(200):
                waiting = await conn.scalar(text(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                    "AND wait_event_type = 'Lock'"))
                if waiting:
                    break
                await conn.rollback()
                await asyncio.wait({task}, timeout=0.05)
            assert waiting, "the second step never waited on the first's locks"
    done, _ = await asyncio.wait({task}, timeout=0.5)
    assert not done, "the second step ran while the first held the worker's accounts"


async def take_back(world: World, kind: str, job_id: str) -> int:
    if kind == "refund":
        return await world.billing.refund(job_id, memo="audit failed")
    return await world.billing.rebill(job_id, 50, 50)  # half the counts it was billed for


# What a refund, and a rebill at half the counts, takes back from the worker (the rest from
# the queen's fee): a refund all of the job's share; a rebill the share's part of the cut.
GIVEN_BACK = {"refund": CHARGE, "rebill": CHARGE - PRICE.cost_msat(50, 50)}
FROM_WORKER = {"refund": SHARE, "rebill": (CHARGE - PRICE.cost_msat(50, 50)) * 8 // 10}


@pytest.mark.parametrize("kind", ["refund", "rebill"])
async def test_a_take_back_first_makes_the_payout_see_it(world, kind):
    """The refund holds the worker's accounts when the payout pass, which read the balance
    before, reserves: the payout waits, sees the money gone, and is skipped."""
    await world.job("job-1")
    held = EARNED + SHARE
    assert (await world.balances())[ledger.worker_available(WORKER)] == held
    due = await world.runner._due(world.settings.payout_threshold_sats * 1000)
    assert due == [(WORKER, held, LN)]
    world.store.armed = True
    clawback = asyncio.create_task(take_back(world, kind, "job-1"))
    await asyncio.wait_for(world.store.inside.wait(), 10)
    payout = asyncio.create_task(world.runner.pay(WORKER, held, LN))
    await assert_waits(world, payout)
    world.store.go.set()
    assert await clawback == GIVEN_BACK[kind]
    assert await payout == "skipped"
    money = await world.balances()
    assert money[ledger.worker_available(WORKER)] == held - FROM_WORKER[kind]
    assert money.get(ledger.worker_debt(WORKER), 0) == 0
    assert money.get(ledger.PAYOUTS_IN_FLIGHT, 0) == 0
    assert money[ledger.key_available(world.key_id)] == CREDIT - CHARGE + GIVEN_BACK[kind]
    await world.clean()
    # The next pass pays what is left.
    report = await world.runner.run_once()
    assert report.manual == 1
    assert (await world.balances())[ledger.worker_available(WORKER)] == 0


@pytest.mark.parametrize("kind", ["refund", "rebill"])
async def test_a_payout_first_leaves_a_debt_its_next_payout_repays(world, kind):
    """The payout reserves everything while the refund waits: the developer still gets all of
    it back, the worker's share becomes its debt (no account below zero but the debt), and
    its next payout repays the debt first."""
    await world.job("job-1")
    held = EARNED + SHARE
    world.runner.store.armed = True
    payout = asyncio.create_task(world.runner.pay(WORKER, held, LN))
    await asyncio.wait_for(world.runner.store.inside.wait(), 10)
    clawback = asyncio.create_task(take_back(world, kind, "job-1"))
    await assert_waits(world, clawback)
    world.runner.store.go.set()
    assert await payout == "manual"  # recorded for an admin to pay: the money left
    assert await clawback == GIVEN_BACK[kind]
    money = await world.balances()
    assert money[ledger.worker_available(WORKER)] == 0
    assert money[ledger.worker_debt(WORKER)] == -FROM_WORKER[kind]
    assert money[ledger.PAYOUTS_IN_FLIGHT] == held
    assert money[ledger.key_available(world.key_id)] == CREDIT - CHARGE + GIVEN_BACK[kind]
    await world.clean()
    # The worker earns again: what it owes comes out of its next payout first.
    await world.store.post(ledger.Posting("earned:after", "charge", (
        (ledger.DEPOSITS, -500_000), (ledger.worker_available(WORKER), 500_000))))
    due = await world.runner._due(world.settings.payout_threshold_sats * 1000)
    assert due == [(WORKER, 500_000 - FROM_WORKER[kind], LN)]
    assert await world.runner.pay(WORKER, 500_000 - FROM_WORKER[kind], LN) == "manual"
    money = await world.balances()
    assert money[ledger.worker_debt(WORKER)] == 0
    assert money[ledger.worker_available(WORKER)] == 0
    await world.clean()


async def test_a_payout_never_takes_more_than_the_debt_leaves(world):
    await world.store.post(ledger.Posting("owed", "refund", (
        (ledger.worker_debt(WORKER), -50_000), (ledger.QUEEN_FEES, 50_000))))
    assert await world.runner.pay(WORKER, EARNED, LN) == "skipped"  # 60,000 less 50,000 owed
    assert await world.runner._due(1) == [(WORKER, EARNED - 50_000, LN)]
    assert await world.runner.pay(WORKER, EARNED - 50_000, LN) == "manual"
    money = await world.balances()
    assert money[ledger.worker_available(WORKER)] == 0
    assert money[ledger.worker_debt(WORKER)] == 0
    await world.clean()


async def test_two_replicas_releasing_one_escrow_post_it_once(world):
    """Both replicas' counts of the worker's jobs reach the end of its escrow at once: the
    second waits for the first's release, finds it, and posts nothing (no error)."""
    await world.store.post(ledger.Posting("escrowed", "charge", (
        (ledger.DEPOSITS, -70_000), (ledger.worker_pending(WORKER), 70_000))))
    other = Billing(world.settings, world.dbs[1])
    world.store.armed = True
    first = asyncio.create_task(world.billing.release_escrow(WORKER))
    await asyncio.wait_for(world.store.inside.wait(), 10)
    second = asyncio.create_task(other.release_escrow(WORKER))
    await assert_waits(world, second)
    world.store.go.set()
    assert sorted([await first, await second]) == [0, 70_000]
    money = await world.balances()
    assert money[ledger.worker_pending(WORKER)] == 0
    assert money[ledger.worker_available(WORKER)] == EARNED + 70_000
    assert await world.store.entries_of(f"escrow-release:{WORKER}") != []
    await world.clean()


async def test_a_release_after_a_refund_took_pending_releases_only_what_is_left(world):
    """The escrow's amount is read under the lock, not from a cache: a refund that took from
    pending first leaves nothing negative behind."""
    world.billing.settings = world.settings.model_copy(update={"escrow_jobs": 10})
    await world.job("job-1")  # credited to pending: the worker is in escrow
    assert (await world.balances())[ledger.worker_pending(WORKER)] == SHARE
    assert await world.billing.refund("job-1") == CHARGE
    assert await world.billing.release_escrow(WORKER) == 0
    money = await world.balances()
    assert money[ledger.worker_pending(WORKER)] == 0
    assert money[ledger.worker_available(WORKER)] == EARNED
    await world.clean()


async def test_refund_rebill_and_release_are_each_posted_once(world):
    await world.job("job-1")
    await world.job("job-2")
    key = ledger.key_available(world.key_id)
    start = (await world.balances())[key]
    # A rebill gives back the difference once; a second, even at other counts, does nothing.
    assert await world.billing.rebill("job-1", 50, 100) == CHARGE - PRICE.cost_msat(50, 100)
    assert await world.billing.rebill("job-1", 1, 1) == 0
    # A refund after it gives back only what the job still holds; then nothing.
    assert await world.billing.refund("job-1") == PRICE.cost_msat(50, 100)
    assert await world.billing.refund("job-1") == 0
    assert await world.billing.rebill("job-1", 1, 1) == 0
    # Concurrently, from two replicas: one posting.
    other = Billing(world.settings, world.dbs[1])
    results = await asyncio.gather(world.billing.refund("job-2"), other.refund("job-2"),
                                   world.billing.refund("job-2"))
    assert sorted(results) == [0, 0, CHARGE]
    assert (await world.balances())[key] == start + 2 * CHARGE
    assert await world.billing.refund("no-such-job") == 0
    assert await world.billing.rebill("no-such-job", 1, 1) == 0
    await world.clean()


async def test_a_rebill_refunds_exactly_the_difference_and_never_charges_more(world):
    await world.job("job-1", prompt=400, completion=30)
    await world.job("job-2", prompt=400, completion=30)
    key = ledger.key_available(world.key_id)
    before = await world.balances()
    # The auditor counted fewer prompt tokens and more completion tokens (within its
    # allowance): the prompt is re-priced, the completion stays as billed.
    paid = PRICE.cost_msat(400, 30)
    cut = await world.billing.rebill("job-1", 120, 35)
    assert cut == paid - PRICE.cost_msat(120, 30)
    after = await world.balances()
    assert after[key] - before[key] == cut
    assert after[ledger.worker_available(WORKER)] == (
        before[ledger.worker_available(WORKER)] - cut * 8 // 10)
    assert after[ledger.QUEEN_FEES] == before[ledger.QUEEN_FEES] - (cut - cut * 8 // 10)
    # Counts at or above the claim change nothing, and mark the job rebilled.
    assert await world.billing.rebill("job-2", 400, 31) == 0
    assert await world.store.entries_of("rebill:job-2") == []
    assert await world.billing.rebill("job-2", 1, 1) == 0
    assert (await world.balances())[key] == after[key]
    # The key's spend counts the rebill back.
    assert await world.store.key_spent(world.key_id) == 2 * paid - cut
    await world.clean()
