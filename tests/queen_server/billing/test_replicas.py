"""Money and limits with several queen replicas: three ``Billing`` instances (three queens) on
one PostgreSQL database and one real ``redis-server``, each with its own engine, ledger writer
and Redis client, sprayed with concurrent requests from one key."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
import redis.asyncio as aioredis

from queen_server.billing import ledger
from queen_server.billing.limits import RedisKeyLimits
from queen_server.billing.pricing import PriceTable
from queen_server.billing.service import Billing, Hold, Principal
from queen_server.billing.store import LedgerStore, Refused
from queen_server.errors import LimitsUnavailable, PaymentRequired, RateLimited
from queen_server.settings import QueenSettings
from queen_server.storage.engine import Database

TINY = PriceTable().for_parameters(135_000_000)
PROMPT = ["hi there"]
TOKENS = 100
COST = TINY.cost_msat(len("hi there") + 8, TOKENS)  # what each request reserves


def postgres_only(db_url: str) -> None:
    if not db_url.startswith("postgresql"):
        pytest.skip("replicas share a PostgreSQL database (APIARY_TEST_POSTGRES_URL)")


class Replicas:
    """N queens' billing on one database and one Redis."""

    def __init__(self, db_url: str, redis_url: str, n: int = 3, lease_ttl_s: float = 30.0):
        self.db_url, self.redis_url, self.n, self.ttl = db_url, redis_url, n, lease_ttl_s
        self.dbs: list[Database] = []
        self.clients: list[aioredis.Redis] = []
        self.billings: list[Billing] = []

    async def __aenter__(self) -> Replicas:
        for _ in range(self.n):
            db = Database(self.db_url)
            await db.upgrade()
            client = aioredis.Redis.from_url(self.redis_url, socket_timeout=2,
                                             socket_connect_timeout=2)
            limits = RedisKeyLimits(client, lease_ttl_s=self.ttl, timeout_s=2)
            billing = Billing(QueenSettings(auth="keys"), db, client, limits=limits)
            await billing.start()
            self.dbs.append(db)
            self.clients.append(client)
            self.billings.append(billing)
        return self

    async def __aexit__(self, *exc: object) -> None:
        for billing, db, client in zip(self.billings, self.dbs, self.clients, strict=True):
            await billing.stop()
            await db.close()
            await client.aclose()

    async def key(self, msat: int, **limits: int) -> Principal:
        _, record = await self.billings[0].keys.create("sprayed", **limits)
        await self.billings[0].ledger.post(ledger.deposit(record.id, msat, f"deposit:{record.id}"))
        for billing in self.billings:
            await billing.refresh()
        return Principal(record.name, record)

    async def hold(self, i: int, who: Principal) -> Hold | None:
        return await self.billings[i % self.n].hold(who, f"job-{i}", TINY, PROMPT,
                                                    {"max_tokens": TOKENS})

    async def money(self, key_id: int) -> tuple[int, int]:
        balances = await self.billings[0].ledger.balances(f"key:{key_id}:")
        return (balances.get(ledger.key_available(key_id), 0),
                balances.get(ledger.key_reserved(key_id), 0))

    async def clean(self) -> bool:
        report = await self.billings[0].ledger.check()
        return report.clean


async def spray(replicas: Replicas, who: Principal, count: int) -> list[object]:
    return await asyncio.gather(*(replicas.hold(i, who) for i in range(count)),
                                return_exceptions=True)


@pytest.fixture
async def replicas(db_url, redis_server):
    postgres_only(db_url)
    async with Replicas(db_url, redis_server.url) as group:
        yield group


# --- the database is the truth ------------------------------------------------------------------


async def test_a_guarded_reservation_is_refused_with_the_balance(db_url):
    """The store itself refuses a reservation the balance cannot cover, and one batch takes
    its reservations in order until the money runs out (SQLite and PostgreSQL)."""
    database = Database(db_url)
    await database.upgrade()
    store = LedgerStore(database.engine)
    try:
        await store.post(ledger.deposit(1, 250, "deposit:1"))
        with pytest.raises(Refused) as caught:
            await store.post(ledger.reserve(1, 300, "too-big"))
        assert (caught.value.balance_msat, caught.value.amount_msat) == (250, 300)
        store.start()  # the group-commit writer: three reservations in one batch
        results = await asyncio.gather(*(store.post(ledger.reserve(1, 100, f"j{i}"))
                                         for i in range(3)), return_exceptions=True)
        await store.stop()
        assert results[:2] == [True, True]
        assert isinstance(results[2], Refused)
        assert results[2].balance_msat == 50
        balances = await store.balances("key:1:")
        assert balances == {"key:1:available": 50, "key:1:reserved": 200}
        assert (await store.check()).clean
        # Refused postings left no trace: the same job may be reserved again.
        assert await store.post(ledger.reserve(1, 50, "j2"))
    finally:
        await database.close()


async def test_a_stale_cache_never_admits_what_the_database_refuses(db_url):
    """Two queens on one database without a shared Redis: each caches the balance, and the
    second's cache is stale once the first has spent it."""
    postgres_only(db_url)
    dbs = [Database(db_url) for _ in range(2)]
    await dbs[0].upgrade()
    first, second = (Billing(QueenSettings(auth="keys"), db) for db in dbs)
    for billing in (first, second):
        await billing.start()
    try:
        _, record = await first.keys.create("k")
        await first.ledger.post(ledger.deposit(record.id, 3 * COST, "deposit:k"))
        who = Principal("k", record)
        for billing in (first, second):
            await billing.refresh()
            await billing.hold(who, f"warm-{id(billing)}", TINY, PROMPT, {"max_tokens": 1})
        for i in range(2):
            await first.hold(who, f"a{i}", TINY, PROMPT, {"max_tokens": TOKENS})
        assert second._states[record.id].available > COST  # stale: it thinks it has more
        with pytest.raises(PaymentRequired):
            await second.hold(who, "b", TINY, PROMPT, {"max_tokens": TOKENS})
        available = (await first.ledger.balances())[ledger.key_available(record.id)]
        assert second._states[record.id].available == available  # corrected by the refusal
        assert (await first.ledger.check()).clean
    finally:
        for billing, db in zip((first, second), dbs, strict=True):
            await billing.stop()
            await db.close()


async def test_concurrent_spend_across_three_replicas_never_overspends(replicas):
    n = 12
    who = await replicas.key(n * COST)
    outcomes = await spray(replicas, who, 5 * n)
    held = [o for o in outcomes if isinstance(o, Hold)]
    refused = [o for o in outcomes if isinstance(o, PaymentRequired)]
    assert len(held) == n
    assert len(refused) == 4 * n, [o for o in outcomes if not isinstance(o, Hold | PaymentRequired)]
    assert await replicas.money(who.key.id) == (0, n * COST)
    assert await replicas.clean()
    # Every replica settles its own: the money comes back and the ledger stays whole.
    for i, hold in enumerate(outcomes):
        if isinstance(hold, Hold):
            await replicas.billings[i % 3].finish(hold, prompt_tokens=4, completion_tokens=2)
    available, reserved = await replicas.money(who.key.id)
    assert reserved == 0
    assert available == n * (COST - TINY.cost_msat(4, 2))
    assert await replicas.clean()


# --- limits through Redis -----------------------------------------------------------------------


async def test_a_60_rpm_key_sprayed_across_three_replicas_admits_exactly_60(replicas):
    who = await replicas.key(1000 * COST, rpm_limit=60)
    outcomes = await spray(replicas, who, 200)
    admitted = [o for o in outcomes if isinstance(o, Hold)]
    limited = [o for o in outcomes if isinstance(o, RateLimited)]
    assert len(admitted) == 60
    assert len(limited) == 140
    assert {o.code for o in limited} == {"rate_limit_exceeded"}
    assert all(1 <= int(o.headers["Retry-After"]) <= 61 for o in limited)
    # Finishing frees no place in the minute.
    for i, hold in enumerate(outcomes):
        if isinstance(hold, Hold):
            await replicas.billings[i % 3].finish(hold, prompt_tokens=1, completion_tokens=1)
    with pytest.raises(RateLimited):
        await replicas.hold(999, who)


async def test_a_request_refused_for_money_takes_no_place_in_the_minute(replicas):
    who = await replicas.key(COST, rpm_limit=2)
    await replicas.hold(0, who)
    with pytest.raises(PaymentRequired):
        await replicas.hold(1, who)
    await replicas.billings[0].ledger.post(ledger.deposit(who.key.id, COST, "deposit:more"))
    await replicas.billings[2].refresh()
    assert isinstance(await replicas.hold(2, who), Hold)  # the second of two, not the third


async def test_concurrency_4_across_three_replicas_is_never_exceeded(replicas):
    who = await replicas.key(10_000 * COST, concurrency_limit=4)
    inflight = peak = admitted = limited = 0
    codes: set[tuple[str | None, str]] = set()
    # The first admitted requests hold their places until four are in flight at once, so the
    # limit is reached however slowly a loaded machine runs the holds (and passed if broken).
    full = asyncio.Event()

    async def client(i: int) -> None:
        nonlocal inflight, peak, admitted, limited
        for round_ in range(6):
            billing = replicas.billings[(i + round_) % 3]
            try:
                hold = await billing.hold(who, f"c{i}-{round_}", TINY, PROMPT,
                                          {"max_tokens": TOKENS})
            except RateLimited as exc:
                codes.add((exc.code, exc.headers["Retry-After"]))
                limited += 1
                await asyncio.sleep(0.005)
                continue
            inflight += 1
            admitted += 1
            peak = max(peak, inflight)
            if inflight >= 4:
                full.set()
            async with asyncio.timeout(10):
                await full.wait()
            await asyncio.sleep(0.01)  # the request's work
            inflight -= 1
            await billing.finish(hold, prompt_tokens=1, completion_tokens=1)

    await asyncio.gather(*(client(i) for i in range(16)))
    assert peak == 4  # reached, never passed
    assert codes == {("concurrency_limit_exceeded", "1")}
    assert admitted >= 4
    assert limited > 0
    assert await replicas.money(who.key.id) == (10_000 * COST - admitted * TINY.cost_msat(1, 1),
                                                0)


async def test_a_dead_replicas_slots_lapse_after_the_ttl(db_url, redis_server):
    postgres_only(db_url)
    async with Replicas(db_url, redis_server.url, n=2, lease_ttl_s=1.0) as group:
        who = await group.key(100 * COST, concurrency_limit=2)
        doomed, survivor = group.billings
        for i in range(2):
            await doomed.hold(who, f"dies-{i}", TINY, PROMPT, {"max_tokens": TOKENS})
        with pytest.raises(RateLimited):
            await survivor.hold(who, "early", TINY, PROMPT, {"max_tokens": TOKENS})
        # While alive, the owner keeps its slots past the TTL.
        await asyncio.sleep(2.0)
        with pytest.raises(RateLimited):
            await survivor.hold(who, "still-held", TINY, PROMPT, {"max_tokens": TOKENS})
        await doomed.limits.stop()  # the replica dies: nothing refreshes or releases
        died = time.monotonic()
        deadline = died + 5
        while True:
            with contextlib.suppress(RateLimited):
                await survivor.hold(who, "after", TINY, PROMPT, {"max_tokens": TOKENS})
                break
            assert time.monotonic() < deadline, "the dead replica's slots never lapsed"
            await asyncio.sleep(0.05)
        assert time.monotonic() - died <= 1.0 + 1.0  # within the TTL and one refresh


async def test_redis_down_fails_closed_only_for_limited_keys(replicas, redis_server):
    limited = await replicas.key(100 * COST, rpm_limit=100)
    free = await replicas.key(100 * COST)
    redis_server.stop(kill=True)
    with pytest.raises(LimitsUnavailable) as caught:
        await replicas.hold(0, limited)
    assert caught.value.status_code == 503
    assert caught.value.code == "limits_unavailable"
    assert caught.value.headers["Retry-After"] == "1"
    assert isinstance(await replicas.hold(1, free), Hold)  # no limit: no Redis needed
    assert await replicas.money(limited.key.id) == (100 * COST, 0)  # nothing held
    redis_server.start()
    assert isinstance(await replicas.hold(2, limited), Hold)  # back with Redis


async def test_a_redis_restart_mid_spray_never_overspends(replicas, redis_server):
    n = 30
    who = await replicas.key(n * COST, rpm_limit=1000, concurrency_limit=1000)
    first = spray(replicas, who, 2 * n)
    restart = asyncio.to_thread(redis_server.restart)
    outcomes = [*(await asyncio.gather(first, restart))[0]]
    outcomes += await asyncio.gather(*(replicas.hold(1000 + i, who) for i in range(2 * n)),
                                     return_exceptions=True)
    kinds = {type(o).__name__ for o in outcomes}
    assert kinds <= {"Hold", "PaymentRequired", "LimitsUnavailable"}, outcomes
    held = [o for o in outcomes if isinstance(o, Hold)]
    assert len(held) == n  # the money ran out at exactly n, whatever Redis did
    assert await replicas.money(who.key.id) == (0, n * COST)
    assert await replicas.clean()
    for i, hold in enumerate(outcomes):  # leases released or lapsed, either way harmless
        if isinstance(hold, Hold):
            await replicas.billings[i % 3].finish(hold)
    assert await replicas.money(who.key.id) == (n * COST, 0)
    assert await replicas.clean()


async def test_stale_reservations_of_a_dead_replica_are_released_job_by_job(replicas):
    who = await replicas.key(10 * COST)
    for i in range(2):  # a replica dies holding these
        assert await replicas.hold(i, who) is not None
    survivor = replicas.billings[2]
    assert await survivor.recover_stale_reservations() == 0  # young: maybe still served
    survivor.stale_reservation_s = 0
    await asyncio.sleep(0.01)  # strictly older than now
    released = await survivor.recover_stale_reservations()
    assert released == 2 * COST
    assert await replicas.money(who.key.id) == (10 * COST, 0)
    assert await replicas.billings[1].recover_stale_reservations() == 0  # idempotent
    assert await replicas.clean()


async def test_a_long_job_s_hold_outlives_the_stale_sweep_and_is_released_once_from_any_replica(
        replicas):
    """A fine-tuning job's hold (issue 37) waits and trains for hours: the sweep of a dead
    replica's reservations leaves the jobs whose ids the owning service claimed, and that
    service releases one from any replica, by its job id, once."""
    who = await replicas.key(10 * COST)
    for billing in replicas.billings:
        billing.own_reservations("ftjob-")
    maker = replicas.billings[0]
    long_hold = await maker.hold(who, "ftjob-1", TINY, PROMPT, {"max_tokens": TOKENS})
    assert long_hold is not None
    assert await replicas.hold(1, who) is not None  # a request's hold, left by a dead replica
    survivor = replicas.billings[2]
    survivor.stale_reservation_s = 0
    await asyncio.sleep(0.01)  # strictly older than now
    assert await survivor.recover_stale_reservations() == COST  # the request's only
    assert await replicas.money(who.key.id) == (9 * COST, COST)
    # The job ends on another replica than the one holding its Hold: released from the ledger.
    assert await survivor.release_job("ftjob-1") == COST
    assert await replicas.money(who.key.id) == (10 * COST, 0)
    assert await replicas.billings[1].release_job("ftjob-1") == 0  # once
    assert await survivor.release_job("ftjob-unknown") == 0
    assert await replicas.clean()
