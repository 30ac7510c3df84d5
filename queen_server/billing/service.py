"""Billing on the request path: who is calling, what a request may cost, and what it did cost.

Admission reserves the most a request can cost (a prompt estimate plus its token limit). The
in-memory balance is checked and debited with no ``await`` in between (the fast refusal, and the
affordable ``max_tokens``); then the reservation is written to the ledger as a conditional debit
that the database refuses if the key's ``available`` cannot cover it. The database is the truth:
several queen replicas on one database never overspend a key, and a replica whose cached balance
went stale (another replica spent) corrects it from the refusal. The end of the job settles the
real usage and releases the rest. A job that fails is charged nothing; a stream that breaks is
charged only the tokens it delivered.

Balances are loaded from the ledger on a key's first use. Deposits made by other processes (the
``apiary-queen keys credit`` command) are picked up by a poll every ``billing_refresh_s``. With
``shared`` (replicas: a Redis is given), the poll reloads cached balances whole, a refusal of
the cache is checked against the database before the client hears it, and reservations are
recovered per job once they are older than any request can last (another replica may still be
serving the younger ones). Rate and concurrency limits are ``limits.py``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from queen_server.billing import ledger, takeback
from queen_server.billing.clawback import Clawbacks
from queen_server.billing.keys import KeyRecord, KeyStore, hash_secret
from queen_server.billing.limits import InProcessKeyLimits, KeyLimits, Lease, RedisKeyLimits
from queen_server.billing.pricing import Price, PriceTable
from queen_server.billing.shares import split_parts
from queen_server.billing.store import LedgerStore, LedgerWriteError, Refused
from queen_server.errors import PaymentRequired, Unauthorized
from queen_server.swarm.jobs import Part
from queen_server.swarm.metering import estimate_prompt_tokens

if TYPE_CHECKING:
    import redis.asyncio as aioredis

    from queen_server.settings import QueenSettings
    from queen_server.storage.engine import Database

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: a billed key, or an unbilled development key or open access."""

    name: str
    key: KeyRecord | None = None
    digest: str | None = None  # a development key's hash (each is its own caller)

    @property
    def billed(self) -> bool:
        return self.key is not None


OPEN = Principal("open access")
DEV_NAME = "development key"


@dataclass(slots=True)
class Hold:
    """Money reserved for one request, until ``Billing.finish``."""

    key_id: int
    job_id: str
    reserved_msat: int
    price: Price
    closed: bool = False
    charged_msat: int = 0
    lease: Lease | None = None  # its place in the key's rate and concurrency limits
    model: str = ""  # what it was for (a model group's answer is credited to its members)


@dataclass
class _KeyState:
    available: int
    loaded_at_seq: int
    spent: int = 0  # charged so far, for the key's spend budget
    held: int = 0  # reserved by requests in flight
    inflight: int = 0
    unposted: int = 0  # debited here, its reservation not yet answered by the database


@dataclass
class _WorkerState:
    jobs: int  # settled jobs so far
    pending: int  # msat held in escrow


async def _load_once(
    cache: dict[Any, Any],
    loading: dict[object, asyncio.Future[Any]],
    key: Any,
    load: Callable[[], Awaitable[Any]],
) -> Any:
    """``cache[key]``, loaded by one ``load()`` even when many callers ask at once."""
    if key in cache:
        return cache[key]
    future = loading.get(key)
    if future is None:
        future = loading[key] = asyncio.get_running_loop().create_future()
        try:
            cache[key] = value = await load()
            future.set_result(value)
        except BaseException as exc:
            future.set_exception(exc)
            raise
        finally:
            del loading[key]
        return value
    return await future


class Billing:
    def __init__(
        self,
        settings: QueenSettings,
        db: Database | None,
        redis: aioredis.Redis | None = None,
        *,
        limits: KeyLimits | None = None,
        shared: bool | None = None,
    ) -> None:
        """``redis``: the replicas' shared Redis, for the keys' limits (``RedisKeyLimits``)
        and ``shared`` mode; None for one queen (in-process limits). ``limits`` overrides the
        limits' implementation. ``shared`` (default: whether ``redis`` is given) says other
        queen processes spend from this database too."""
        self.settings = settings
        if limits is None:
            limits = RedisKeyLimits(redis) if redis is not None else InProcessKeyLimits()
        self.limits = limits
        self.shared = redis is not None if shared is None else shared
        # No request lives longer than this: a reservation older is a dead replica's.
        self.stale_reservation_s = 2 * (settings.queue_timeout_s + settings.total_timeout_s) + 60
        self._owned_prefixes: set[str] = set()  # jobs whose holds the stale sweep leaves alone
        self._last_sweep = 0.0
        unverified = settings.unverified_price_class
        self.prices = (PriceTable.from_file(settings.prices_file, unverified)
                       if settings.prices_file else PriceTable(unverified_class=unverified))
        self.ledger = LedgerStore(db.engine) if db is not None else None
        self.clawbacks = Clawbacks(self.ledger) if self.ledger is not None else None
        self.keys = KeyStore(db.engine) if db is not None else None
        self._dev = {hashlib.sha256(key.encode()).hexdigest() for key in settings.api_keys}
        self._records: dict[str, KeyRecord] = {}
        self._states: dict[int, _KeyState] = {}
        self._workers: dict[str, _WorkerState] = {}
        self._loading: dict[object, asyncio.Future[Any]] = {}
        self._seq = 0
        self._poller: asyncio.Task[None] | None = None
        self._warned_dev = False

    @property
    def open(self) -> bool:
        return self.settings.auth == "open"

    async def start(self) -> None:
        if self._dev:
            log.warning("BILLING IS OFF for %d development key(s) (APIARY_API_KEYS): requests "
                        "made with them are free", len(self._dev))
        if self.open:
            log.warning("APIARY_AUTH=open: anyone who can reach this queen may use it for free")
        if self.ledger is None or self.keys is None:
            return
        await self.limits.start()
        self.ledger.start()
        if self.shared:
            await self.recover_stale_reservations()
        else:
            await self._recover_reservations()
        self._records = await self.keys.all()
        self._seq = await self.ledger.last_seq()
        self._poller = asyncio.create_task(self._poll(), name="billing poller")

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        await self.limits.stop()
        if self.ledger is not None:
            await self.ledger.stop()

    async def _recover_reservations(self) -> None:
        """Release what a crash left reserved: no request survives a restart."""
        assert self.ledger is not None
        seq = await self.ledger.last_seq()
        for account, amount in (await self.ledger.balances("key:")).items():
            if account.endswith(":reserved") and amount > 0:
                key_id = int(account.split(":")[1])
                await self.ledger.post(ledger.release(key_id, amount, f"recovery-{seq}-{key_id}"))
                log.warning("released %d msat left reserved on key %d by an unclean stop",
                            amount, key_id)

    async def recover_stale_reservations(self) -> int:
        """Release, job by job, reservations older than any request can last: a replica died
        holding them. (The blanket release of one queen's restart would take money from
        requests other replicas are serving.) Idempotent across replicas: ``release:<job>``.
        Returns the msat released."""
        assert self.ledger is not None
        self._last_sweep = time.monotonic()
        before = datetime.now(UTC) - timedelta(seconds=self.stale_reservation_s)
        released = 0
        for job_id, key_id, amount in await self.ledger.open_reservations(
                before, skip_prefixes=self._owned_prefixes):
            if await self.ledger.post(ledger.release(key_id, amount, job_id)):
                released += amount
                log.warning("released %d msat reserved on key %d for job %s, which no replica "
                            "finished", amount, key_id, job_id)
        return released

    def own_reservations(self, prefix: str) -> None:
        """Holds of jobs whose ids start with ``prefix`` outlive any request (a fine-tuning
        job waits and trains for hours): the stale sweep leaves them to the service that made
        them, which ends each with ``finish`` or, from any replica, ``release_job``."""
        self._owned_prefixes.add(prefix)

    async def release_job(self, job_id: str) -> int:
        """Release what job ``job_id`` still has reserved, whichever replica reserved it (its
        ``Hold`` may be in another's memory, or lost with it); nothing if a settle or release
        closed it. Beside replicas only: a lone queen's restart released every reservation
        whole (``_recover_reservations``), which the ledger does not record per job. Returns
        the msat released."""
        if self.ledger is None or not self.shared:
            return 0
        released = 0
        for job, key_id, amount in await self.ledger.open_reservations(job_id=job_id):
            if await self.ledger.post(ledger.release(key_id, amount, job)):
                released += amount
                state = self._states.get(key_id)
                if state is not None:
                    state.available += amount
                log.info("released %d msat reserved on key %d for job %s", amount, key_id, job)
        return released

    # --- who is calling -----------------------------------------------------------------------

    async def authenticate(self, authorization: str | None) -> Principal:
        scheme, _, secret = (authorization or "").partition(" ")
        secret = secret.strip()
        if scheme.lower() != "bearer" or not secret:
            if self.open:
                return OPEN
            raise Unauthorized(
                "You didn't provide an API key. Send 'Authorization: Bearer YOUR_KEY'.",
                code="missing_api_key",
            )
        digest = hash_secret(secret)
        if digest in self._dev:
            return Principal(DEV_NAME, digest=digest)
        record = self._records.get(digest)
        if record is None and self.keys is not None:
            self._records = await self.keys.all()  # a key created since the last refresh
            record = self._records.get(digest)
        if record is not None and not record.revoked:
            return Principal(record.name, record)
        if self.open:
            return OPEN
        if record is not None:
            raise Unauthorized("This API key has been revoked.", code="revoked_api_key")
        raise Unauthorized("Incorrect API key provided.")

    # --- holds --------------------------------------------------------------------------------

    async def _state(self, key_id: int) -> _KeyState:
        async def load() -> _KeyState:
            assert self.ledger is not None
            account = ledger.key_available(key_id)
            seq, balances = await self.ledger.snapshot([account])
            return _KeyState(balances[account], seq, spent=await self.ledger.key_spent(key_id))

        return await _load_once(self._states, self._loading, key_id, load)

    async def _worker(self, pubkey: str) -> _WorkerState:
        async def load() -> _WorkerState:
            assert self.ledger is not None
            _, balances = await self.ledger.snapshot([ledger.worker_pending(pubkey)])
            jobs = await self.ledger.worker_jobs(pubkey)
            return _WorkerState(jobs, balances[ledger.worker_pending(pubkey)])

        return await _load_once(self._workers, self._loading, pubkey, load)

    async def hold(
        self,
        principal: Principal,
        job_id: str,
        price: Price,
        prompt_texts: list[str],
        request: dict[str, Any],
        *,
        completion_limit: str | None = "max_tokens",
        choices: int = 1,
    ) -> Hold | None:
        """Reserve the most this request can cost. Sets ``request[completion_limit]`` when the
        client gave none, to what the balance and ``default_max_tokens`` allow. ``choices``:
        answers made for the request (``n``, times the prompts of a text completion), each up
        to the completion limit."""
        if principal.key is None or self.ledger is None:
            return None
        key = principal.key
        state = await self._state(key.id)
        lease = await self.limits.admit(key)
        try:
            hold = await self._reserve(key, state, job_id, price, prompt_texts, request,
                                       completion_limit, choices)
        except BaseException:
            await self.limits.cancel(lease)  # refused: it counts against no limit
            raise
        hold.lease = lease
        return hold

    async def _reserve(self, key: KeyRecord, state: _KeyState, job_id: str, price: Price,
                       prompt_texts: list[str], request: dict[str, Any],
                       completion_limit: str | None, choices: int) -> Hold:
        assert self.ledger is not None
        prompt = estimate_prompt_tokens(prompt_texts)
        asked = None
        if completion_limit is not None:
            asked = request.get("max_completion_tokens") or request.get(completion_limit)
        for attempt in range(2):  # the second with a balance corrected from the database
            last = attempt == 1
            completion = 0
            if completion_limit is not None:
                if asked is None:
                    affordable = price.max_completion_tokens(state.available, prompt) // choices
                    completion = min(self.settings.default_max_tokens, affordable)
                    if completion >= 1:
                        request[completion_limit] = completion
                else:
                    completion = int(asked)
                completion *= choices
            amount = price.cost_msat(prompt, completion)
            # Check and debit with no await in between: this replica's requests never race.
            if amount > state.available or (completion_limit is not None and completion < 1):
                if self.shared and not last:  # the cache may be stale: ask the database
                    await self._resync(key.id, state)
                    continue
                raise _short_of_money(amount, price, state.available)
            if key.budget_msat is not None and state.spent + state.held + amount > key.budget_msat:
                left = max(0, key.budget_msat - state.spent - state.held)
                raise PaymentRequired(
                    f"This request may cost up to {_sats(amount)} sats, and the key's spend "
                    f"budget has {_sats(left)} sats left.", code="budget_exceeded")
            state.available -= amount
            state.held += amount
            state.inflight += 1
            state.unposted += amount
            hold = Hold(key.id, job_id, amount, price)
            try:
                await self.ledger.post(ledger.reserve(key.id, amount, job_id))
            except BaseException as exc:
                state.unposted -= amount
                self._undo(state, hold)
                if not isinstance(exc, Refused):
                    raise
                # Another process spent it: the database's balance is the truth.
                state.available = exc.balance_msat - state.unposted
                log.info("key %d: the database refused a reservation of %d msat (balance %d); "
                         "the cached balance was stale", key.id, amount, exc.balance_msat)
                if last:
                    raise _short_of_money(amount, price, exc.balance_msat) from None
                continue
            state.unposted -= amount
            return hold
        raise AssertionError("unreachable")

    async def _resync(self, key_id: int, state: _KeyState) -> None:
        """Reload a key's cached balance from the database (other replicas move it)."""
        assert self.ledger is not None
        account = ledger.key_available(key_id)
        _, balances = await self.ledger.snapshot([account])
        state.available = balances[account] - state.unposted

    def _undo(self, state: _KeyState, hold: Hold) -> None:
        state.available += hold.reserved_msat
        state.held -= hold.reserved_msat
        state.inflight -= 1
        hold.closed = True

    async def finish(
        self,
        hold: Hold | None,
        *,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
        worker_key: str | None = None,
        completed: bool = True,
        parts: Sequence[Part] | None = None,
    ) -> None:
        """Charge what was used (nothing for a failed job) and release the rest of the hold.

        ``parts`` says which worker did what when several served one answer (failover);
        otherwise the usage and ``worker_key`` make the one part. The developer is charged for
        the sum, capped at the hold; the charge is split between the workers in proportion to
        the cost of their parts. A worker's share depends on its record: its first completed
        job is its proof of work (unpaid); the next ``escrow_jobs`` are credited as pending;
        after that, as available, and the pending earnings are released. An incomplete part (a
        broken stream, a lost worker) is charged and credited for what it delivered, but does
        not count as a job.
        """
        if hold is None or hold.closed or self.ledger is None:
            return
        if parts is None:
            parts = [Part(worker_key, prompt_tokens, completion_tokens, completed)]
        parts = split_parts(parts)  # a group head's part, one per member by layers held
        hold.closed = True
        await self.limits.release(hold.lease)
        state = self._states[hold.key_id]
        price = hold.price
        costs = [price.cost_msat(part.prompt_tokens, part.completion_tokens) for part in parts]
        charge = min(price.cost_msat(sum(part.prompt_tokens for part in parts),
                                     sum(part.completion_tokens for part in parts)),
                     hold.reserved_msat)
        hold.charged_msat = charge
        state.available += hold.reserved_msat - charge
        state.held -= hold.reserved_msat
        state.spent += charge
        state.inflight -= 1
        if charge == 0:
            await self.ledger.post(ledger.release(hold.key_id, hold.reserved_msat, hold.job_id))
            return
        total_cost = sum(costs) or 1
        shares: list[tuple[str, int]] = []
        memos: list[str] = []
        counted: list[str] = []  # every worker that completed its part (a group's: each)
        escrow_over: list[tuple[str, _WorkerState]] = []
        for part, cost in zip(parts, costs, strict=True):
            if part.worker_key is None:
                continue
            worker = await self._worker(part.worker_key)
            stage = worker.jobs
            if part.completed:
                worker.jobs += 1
                counted.append(part.worker_key)
            share = int(charge * self.settings.worker_share * cost / total_cost)
            if stage == 0:
                memos.append("proof of work: a new worker's first job is unpaid")
                continue
            if stage <= self.settings.escrow_jobs:
                shares.append((ledger.worker_pending(part.worker_key), share))
                worker.pending += share
                if part.completed and stage == self.settings.escrow_jobs:
                    escrow_over.append((part.worker_key, worker))
            else:
                shares.append((ledger.worker_available(part.worker_key), share))
        usage = ledger.JobCharge(
            hold.job_id, hold.key_id, price.size_class, price.prompt_msat_per_1k,
            price.completion_msat_per_1k, sum(part.prompt_tokens for part in parts),
            sum(part.completion_tokens for part in parts), charge)
        await self.ledger.post(ledger.settle(
            hold.key_id, hold.reserved_msat, charge, hold.job_id, shares,
            count_job_for=counted, memo="; ".join(memos), charge=usage,
        ))
        for key, worker in escrow_over:
            try:
                released = await self.release_escrow(key)  # once: a replica's second is a no-op
            except LedgerWriteError:  # the database failed; the job is settled all the same
                log.exception("worker %s finished its escrow, but the release could not be "
                              "posted", key[:12])
                continue
            worker.pending = 0
            if released:
                log.info("worker %s finished its escrow: %d msat released", key[:12], released)

    # --- audits' consequences (issues 16 and 39): each one guarded step (``clawback.py``) ---

    async def refund(self, job_id: str, memo: str = "") -> int:
        """Give the developer back what job ``job_id`` was charged (less what a rebill gave
        back already), taken back from where the charge went: the queen's fee, and the
        worker's share from its pending earnings, then its available ones, then as its debt
        (``takeback``). Runs wholly before or after any payout of the same worker.
        Idempotent (``refund:<job>``); returns the msat refunded now."""
        if self.clawbacks is None:
            return 0
        return self._refunded(await self.clawbacks.refund(job_id, memo))

    async def rebill(self, job_id: str, prompt_tokens: int, completion_tokens: int,
                     memo: str = "") -> int:
        """Re-price an audited job at the auditor's exact counts and refund what it was
        charged above that (``Clawbacks.rebill``; a count above the billed one changes
        nothing). Once per job; nothing after a full refund. Returns the msat refunded now."""
        if self.clawbacks is None:
            return 0
        return self._refunded(await self.clawbacks.rebill(
            job_id, prompt_tokens, completion_tokens, memo))

    def _refunded(self, posting: ledger.Posting | None) -> int:
        """Correct the caches after a take-back; returns the msat the key got back."""
        if posting is None:
            return 0
        key_id, refunded = takeback.refunded(posting)
        state = self._states.get(key_id)
        if state is not None:
            state.available += refunded
            state.spent -= refunded
        for pubkey, taken in takeback.taken_from_pending(posting).items():
            worker = self._workers.get(pubkey)
            if worker is not None:
                worker.pending = max(0, worker.pending - taken)
        return refunded

    async def release_escrow(self, pubkey: str) -> int:
        """A worker's escrow is over: what ``pending`` holds becomes available, once."""
        if self.clawbacks is None:
            return 0
        return await self.clawbacks.release_escrow(pubkey)

    async def forfeit_escrow(self, pubkey: str, flag: int) -> int:
        """A flagged worker's pending earnings go to the queen; returns the msat forfeited."""
        if self.clawbacks is None:
            return 0
        amount = await self.clawbacks.forfeit_escrow(pubkey, flag)
        worker = self._workers.get(pubkey)
        if amount and worker is not None:
            worker.pending = 0
        return amount

    async def restore_escrow(self, pubkey: str, flag: int) -> int:
        """Undo flag ``flag``'s forfeit (an admin cleared it): paid into available."""
        if self.clawbacks is None:
            return 0
        return await self.clawbacks.restore_escrow(pubkey, flag)

    def in_escrow(self, pubkey: str) -> bool:
        """Whether the worker is still in escrow, as far as the queen knows without a read: a
        worker it has settled billed jobs for, and not yet ``escrow_jobs`` of them (a queen
        that bills nothing has no escrow)."""
        worker = self._workers.get(pubkey)
        return worker is not None and worker.jobs <= self.settings.escrow_jobs

    # --- deposits from other processes ---------------------------------------------------------

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.settings.billing_refresh_s)
            try:
                await self.refresh()
                if self.shared and (time.monotonic() - self._last_sweep
                                    > self.stale_reservation_s / 4):
                    await self.recover_stale_reservations()
            except Exception:
                log.exception("billing refresh failed")

    async def refresh(self) -> None:
        """Apply deposits committed by other processes, and reload the keys. Shared: reload
        the cached balances whole (other replicas spend and release), and what each budgeted
        key has spent."""
        if self.ledger is None or self.keys is None:
            return
        if self.shared:
            await self._reload_states()
            self._records = await self.keys.all()
            return
        self._seq, deposits = await self.ledger.deposits_since(self._seq)
        for seq, account, amount in deposits:
            if not account.startswith("key:"):
                continue
            state = self._states.get(int(account.split(":")[1]))
            if state is not None and seq > state.loaded_at_seq:
                state.available += amount
        self._records = await self.keys.all()


    async def _reload_states(self) -> None:
        assert self.ledger is not None
        if not self._states:
            return
        budgeted = {record.id for record in self._records.values()
                    if record.budget_msat is not None}
        names = {key_id: ledger.key_available(key_id) for key_id in self._states}
        _, balances = await self.ledger.snapshot(list(names.values()))
        for key_id, name in names.items():
            state = self._states[key_id]
            state.available = balances[name] - state.unposted
            if key_id in budgeted:
                state.spent = await self.ledger.key_spent(key_id)


def _short_of_money(amount: int, price: Price, available: int) -> PaymentRequired:
    return PaymentRequired(
        f"This request may cost up to {_sats(amount)} sats "
        f"({price.size_class} model: {price.prompt_msat_per_1k} msat per 1k prompt "
        f"tokens, {price.completion_msat_per_1k} per 1k completion tokens); the key has "
        f"{_sats(max(0, available))} sats available.",
    )


def _sats(msat: int) -> str:
    return f"{msat / 1000:,.3f}".rstrip("0").rstrip(".")
