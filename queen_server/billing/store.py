"""The ledger in the database: a group-commit writer, balance reads, and the integrity check.

Postings queue up and one writer task commits everything waiting in a single transaction (one
fsync for many requests), then resolves each caller's future. A posting whose txn id is already
in the ledger is skipped, which makes every posting idempotent: the check runs after its
accounts are locked, so two replicas posting one txn id at once post it once (the second waits
for the first and then finds it).

A posting whose amounts depend on balances (a refund, a payout's reservation, an escrow's
release) is decided and applied in one transaction under its accounts' locks
(``post_locked``, or ``read_locked`` and ``apply_in`` inside the caller's transaction): on
PostgreSQL the rows are locked ``FOR UPDATE`` in name order, on SQLite the first statement takes
the file's write lock. Whichever of two such steps on one worker runs second sees the first's
effect, whichever replica runs it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime

from sqlalchemy import String, exists, func, insert, literal, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.orm import aliased

from queen_server.billing.ledger import JobCharge, Posting, may_go_negative
from queen_server.errors import QueenError
from queen_server.storage.tables import (
    Account,
    JobChargeRow,
    LedgerEntry,
    LedgerTxn,
    WorkerRecord,
)

log = logging.getLogger(__name__)


class LedgerWriteError(QueenError):
    pass


class Refused(QueenError):
    """A guarded posting was not applied: its account holds less than it would take. Carries
    the balance the database had, so a replica's cached balance can be corrected."""

    def __init__(self, account: str, amount_msat: int, balance_msat: int) -> None:
        super().__init__(f"{account} holds {balance_msat} msat, less than {amount_msat}")
        self.account = account
        self.amount_msat = amount_msat
        self.balance_msat = balance_msat


@dataclass
class CheckReport:
    entries: int = 0
    txns: int = 0
    total_msat: int = 0
    unbalanced_txns: list[str] = field(default_factory=list)
    drift: dict[str, tuple[int, int]] = field(default_factory=dict)  # account: (cached, derived)
    negative: dict[str, int] = field(default_factory=dict)
    debts_above_zero: dict[str, int] = field(default_factory=dict)  # a debt is owed, never held

    @property
    def clean(self) -> bool:
        return self.total_msat == 0 and not self.unbalanced_txns and not self.drift and not (
            self.negative or self.debts_above_zero
        )


@dataclass(frozen=True, slots=True)
class Locked:
    """What a guarded step read under its accounts' locks: their balances, and the entries of
    the transactions it asked about (one that is not in the ledger is absent)."""

    balances: Mapping[str, int]
    txns: Mapping[str, list[tuple[str, int]]]


_ATTEMPTS = 4  # a lone posting's tries when it meets a deadlock or a busy database
# PostgreSQL's deadlock_detected and serialization_failure: the other transaction went first.
_TRANSIENT_SQLSTATES = ("40P01", "40001")


def _transient(exc: BaseException) -> bool:
    """Whether a failed write may succeed if tried again at once (a deadlock with another
    replica, a busy SQLite file), as opposed to a posting the database cannot take."""
    orig = getattr(exc, "orig", None)
    state = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    return state in _TRANSIENT_SQLSTATES or "database is locked" in str(exc)


class LedgerStore:
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self._queue: asyncio.Queue[tuple[Posting, asyncio.Future[bool]]] = asyncio.Queue()
        self._writer: asyncio.Task[None] | None = None

    # --- writing ------------------------------------------------------------------------------

    def start(self) -> None:
        if self._writer is None:
            self._writer = asyncio.create_task(self._write_loop(), name="ledger writer")

    async def stop(self) -> None:
        """Commit everything queued, then stop the writer."""
        if self._writer is None:
            return
        await self._queue.join()
        self._writer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._writer
        self._writer = None

    async def post(self, posting: Posting) -> bool:
        """Commit a posting; True if it was new, False if its txn id was already there.
        Raises ``Refused`` when a guarded posting's account cannot cover it."""
        if self._writer is None:
            async with self.engine.begin() as conn:
                [applied] = await self._apply(conn, [posting])
            if isinstance(applied, Refused):
                raise applied
            return applied
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((posting, future))
        return await future

    async def _write_loop(self) -> None:
        while True:
            batch = [await self._queue.get()]
            while not self._queue.empty():
                batch.append(self._queue.get_nowait())
            try:
                await self._commit(batch)
            finally:
                for _ in batch:
                    self._queue.task_done()

    async def _commit(self, batch: list[tuple[Posting, asyncio.Future[bool]]]) -> None:
        """Commit a batch in one transaction. If it fails, commit its postings one at a time,
        so that one bad posting (an amount the database cannot store) fails only itself; a lone
        posting that meets a deadlock or a lock timeout (another replica's transaction) is
        tried again. The writer never dies: every future gets a result, a ``Refused`` or a
        ``LedgerWriteError``."""
        for attempt in range(_ATTEMPTS):
            try:
                async with self.engine.begin() as conn:
                    results = await self._apply(conn, [posting for posting, _ in batch])
                break
            except Exception as exc:  # the database, or a value it cannot take
                if len(batch) > 1:
                    for item in batch:
                        await self._commit([item])
                    return
                if _transient(exc) and attempt + 1 < _ATTEMPTS:
                    log.info("ledger write met a concurrent transaction; trying again: %s", exc)
                    continue
                [(posting, future)] = batch
                log.exception("the ledger could not commit posting %s", posting.txn)
                if not future.done():
                    future.set_exception(LedgerWriteError(f"the ledger could not commit: {exc}"))
                return
        for (_, future), result in zip(batch, results, strict=True):
            if future.done():
                continue
            if isinstance(result, Refused):
                future.set_exception(result)
            else:
                future.set_result(result)

    async def apply_in(self, conn: AsyncConnection, postings: list[Posting]) -> list[bool]:
        """Apply postings inside the caller's transaction (to commit them with other rows).
        A guarded posting the balance cannot cover raises ``Refused`` (roll back the rest)."""
        results = await self._apply(conn, postings)
        for result in results:
            if isinstance(result, Refused):
                raise result
        return [bool(result) for result in results]

    async def read_locked(self, conn: AsyncConnection, accounts: Iterable[str],
                          txns: Iterable[str] = ()) -> Locked:
        """Lock ``accounts`` (creating those that do not exist) in the caller's transaction,
        then read their balances and the entries of ``txns``: no other transaction can move
        these accounts until the caller's commits. Lock every account the step may post to."""
        names = sorted(set(accounts))
        await self._lock_accounts(conn, names)
        rows = await conn.execute(select(Account.name, Account.balance_msat)
                                  .where(Account.name.in_(names)))
        balances = {name: 0 for name in names} | {name: int(b) for name, b in rows}
        found: dict[str, list[tuple[str, int]]] = {}
        wanted = list(dict.fromkeys(txns))
        if wanted:
            known = await conn.scalars(select(LedgerTxn.id).where(LedgerTxn.id.in_(wanted)))
            found = {txn: [] for txn in known}
            rows = await conn.execute(
                select(LedgerEntry.txn_id, LedgerEntry.account, LedgerEntry.amount_msat)
                .where(LedgerEntry.txn_id.in_(wanted)).order_by(LedgerEntry.id))
            for txn, account, amount in rows:
                found[txn].append((account, int(amount)))
        return Locked(balances, found)

    async def post_locked(self, accounts: Iterable[str],
                          build: Callable[[Locked], Posting | None],
                          txns: Iterable[str] = ()) -> Posting | None:
        """One guarded step: lock ``accounts``, read them (and ``txns``), let ``build`` decide
        the posting from what it read, and apply it, all in one transaction. Returns the
        posting applied (None: ``build`` made none, or its txn id was there already). A
        deadlock or a busy database is tried again from the start, with fresh balances."""
        names = sorted(set(accounts))
        txns = list(txns)
        for attempt in range(_ATTEMPTS):
            try:
                async with self.engine.begin() as conn:
                    posting = build(await self.read_locked(conn, names, txns))
                    if posting is None:
                        return None
                    if stray := {a for a, _ in posting.entries} - set(names):
                        raise LedgerWriteError(f"posting {posting.txn} touches unlocked "
                                               f"accounts {sorted(stray)}")
                    [applied] = await self.apply_in(conn, [posting])
                return posting if applied else None
            except (LedgerWriteError, Refused):
                raise
            except Exception as exc:
                if _transient(exc) and attempt + 1 < _ATTEMPTS:
                    log.info("a guarded ledger step met a concurrent transaction; trying "
                             "again: %s", exc)
                    continue
                raise LedgerWriteError(f"the ledger could not commit: {exc}") from exc
        raise AssertionError("unreachable")

    async def _apply(self, conn: AsyncConnection,
                     postings: list[Posting]) -> list[bool | Refused]:
        """Apply postings in one transaction: True for each applied, False for a txn id already
        in the ledger, a ``Refused`` for a guarded posting its balance cannot cover.

        The account rows are locked first, in name order (on PostgreSQL; SQLite locks the whole
        file), so two replicas' batches never deadlock on each other. Guarded debits are taken
        with a conditional ``UPDATE ... WHERE balance >= amount`` under that lock
        (``_debit_guarded``): no other process can spend the same msat, so a guarded account
        never goes below zero."""
        names = sorted({account for posting in postings for account, _ in posting.entries})
        if names:  # before the check: a concurrent posting of one txn id is seen, not repeated
            await self._lock_accounts(conn, names)
        ids = [posting.txn for posting in postings]
        existing = set((await conn.scalars(select(LedgerTxn.id).where(LedgerTxn.id.in_(ids))))
                       .all())
        fresh: list[Posting] = []
        for posting in postings:
            if posting.txn not in existing:
                existing.add(posting.txn)
                fresh.append(posting)
        refused = await self._debit_guarded(conn, [p for p in fresh if p.guard is not None])
        applied = [posting for posting in fresh if posting.txn not in refused]
        results: list[bool | Refused] = []
        done = {posting.txn for posting in applied}
        for posting in postings:
            if posting.txn in refused:
                results.append(refused.pop(posting.txn))
            else:
                results.append(posting.txn in done)
                done.discard(posting.txn)  # a second posting of one txn id in a batch: False
        if not applied:
            return results
        now = datetime.now(UTC)
        await conn.execute(insert(LedgerTxn), [
            {"id": posting.txn, "kind": posting.kind, "memo": posting.memo, "created_at": now}
            for posting in applied])
        charges = [_charge_row(posting.charge, now) for posting in applied if posting.charge]
        if charges:
            await conn.execute(insert(JobChargeRow), charges)
        jobs: dict[str, int] = defaultdict(int)
        for posting in applied:
            for worker, count in posting.worker_jobs:
                jobs[worker] += count
        for worker in sorted(jobs):
            await conn.execute(update(WorkerRecord).where(WorkerRecord.key == worker)
                               .values(jobs_settled=WorkerRecord.jobs_settled + jobs[worker]))
        entries = [{"txn_id": posting.txn, "account": account, "amount_msat": amount}
                   for posting in applied for account, amount in posting.entries]
        if entries:
            await conn.execute(insert(LedgerEntry), entries)
        deltas: dict[str, int] = defaultdict(int)
        for posting in applied:
            for account, amount in posting.entries:
                if account != posting.guard:  # the guarded debit is applied already
                    deltas[account] += amount
        for name in sorted(deltas):
            if deltas[name]:
                await conn.execute(update(Account).where(Account.name == name)
                                   .values(balance_msat=Account.balance_msat + deltas[name]))
        return results

    async def _lock_accounts(self, conn: AsyncConnection, names: list[str]) -> None:
        """Create the accounts that do not exist yet, then lock all of them in name order."""
        rows = [{"name": name, "balance_msat": 0, "is_liability": not may_go_negative(name)}
                for name in names]
        dialect = conn.dialect.name
        if dialect in ("postgresql", "sqlite"):
            dialect_insert = pg_insert if dialect == "postgresql" else sqlite_insert
            await conn.execute(dialect_insert(Account).on_conflict_do_nothing(), rows)
        else:
            known = set((await conn.scalars(
                select(Account.name).where(Account.name.in_(names)))).all())
            if new := [row for row in rows if row["name"] not in known]:
                await conn.execute(insert(Account), new)
        if dialect == "postgresql":
            await conn.execute(select(Account.name).where(Account.name.in_(names))
                               .order_by(Account.name).with_for_update())

    @staticmethod
    async def _debit_guarded(conn: AsyncConnection,
                             postings: list[Posting]) -> dict[str, Refused]:
        """Take the guarded postings' debits, in order, while their accounts cover them; the
        rest are refused. One conditional ``UPDATE ... WHERE balance >= total`` per account
        (not per posting: this is the hot path of every request), under the lock taken by
        ``_lock_accounts``, so it cannot fail unless another writer broke that lock."""
        if not postings:
            return {}
        guards = sorted({posting.guard for posting in postings if posting.guard is not None})
        rows = await conn.execute(select(Account.name, Account.balance_msat)
                                  .where(Account.name.in_(guards)))
        left = {name: int(balance) for name, balance in rows}
        taken: dict[str, int] = defaultdict(int)
        refused: dict[str, Refused] = {}
        for posting in postings:
            guard, amount = posting.guard or "", posting.guarded_debit
            if left.get(guard, 0) >= amount:
                left[guard] -= amount
                taken[guard] += amount
            else:
                refused[posting.txn] = Refused(guard, amount, left.get(guard, 0))
        for name in sorted(taken):
            done = await conn.execute(
                update(Account)
                .where(Account.name == name, Account.balance_msat >= taken[name])
                .values(balance_msat=Account.balance_msat - taken[name]))
            if not done.rowcount:
                raise LedgerWriteError(f"{name} changed under the ledger's lock")
        return refused

    # --- reading ------------------------------------------------------------------------------

    async def balance(self, account: str) -> int:
        async with self.engine.connect() as conn:
            value = await conn.scalar(select(Account.balance_msat).where(Account.name == account))
        return int(value or 0)

    async def balances(self, prefix: str = "") -> dict[str, int]:
        async with self.engine.connect() as conn:
            rows = await conn.execute(select(Account.name, Account.balance_msat)
                                      .where(Account.name.startswith(prefix)))
            return {name: int(balance) for name, balance in rows}

    async def deposits_since(self, seq: int) -> tuple[int, list[tuple[int, str, int]]]:
        """Deposit entries committed after ``seq`` as (txn seq, account, amount), and the last
        seq looked at."""
        async with self.engine.connect() as conn, conn.begin():
            last = int(await conn.scalar(select(func.max(LedgerTxn.seq))) or 0)
            rows = await conn.execute(
                select(LedgerTxn.seq, LedgerEntry.account, LedgerEntry.amount_msat)
                .join(LedgerEntry, LedgerEntry.txn_id == LedgerTxn.id)
                .where(LedgerTxn.seq > seq, LedgerTxn.seq <= last, LedgerTxn.kind == "deposit")
            )
            return last, [(int(txn), account, int(amount)) for txn, account, amount in rows]

    async def snapshot(self, accounts: list[str]) -> tuple[int, dict[str, int]]:
        """Balances of ``accounts`` and the ledger seq they include, read in one transaction."""
        async with self.engine.connect() as conn, conn.begin():
            last = int(await conn.scalar(select(func.max(LedgerTxn.seq))) or 0)
            rows = await conn.execute(select(Account.name, Account.balance_msat)
                                      .where(Account.name.in_(accounts)))
            found = {name: int(balance) for name, balance in rows}
        return last, {name: found.get(name, 0) for name in accounts}

    async def open_reservations(self, before: datetime | None = None, *,
                                job_id: str | None = None,
                                skip_prefixes: Iterable[str] = ()) -> list[tuple[str, int, int]]:
        """``(job id, key id, msat)`` of each reservation made before ``before`` that neither
        a settle nor a release has closed: what a dead replica left held. ``job_id``: that
        job's only; ``skip_prefixes``: not the jobs whose ids start so (they have an owner)."""
        closing = aliased(LedgerTxn)
        job = func.substr(LedgerTxn.id, len("reserve:") + 1)
        query = (
            select(LedgerTxn.id, LedgerEntry.account, LedgerEntry.amount_msat)
            .join(LedgerEntry, LedgerEntry.txn_id == LedgerTxn.id)
            .where(LedgerTxn.kind == "reserve",
                   LedgerEntry.amount_msat > 0, LedgerEntry.account.endswith(":reserved"),
                   ~exists().where(closing.id.in_([literal("settle:", String).concat(job),
                                                   literal("release:", String).concat(job)])))
        )
        if before is not None:
            query = query.where(LedgerTxn.created_at < before)
        if job_id is not None:
            query = query.where(LedgerTxn.id == f"reserve:{job_id}")
        for prefix in skip_prefixes:
            query = query.where(~LedgerTxn.id.startswith(f"reserve:{prefix}", autoescape=True))
        async with self.engine.connect() as conn:
            rows = (await conn.execute(query)).all()
        return [(txn.removeprefix("reserve:"), int(account.split(":")[1]), int(amount))
                for txn, account, amount in rows]

    async def key_spent(self, key_id: int) -> int:
        """What a key has been charged, in total: its two accounts' net change by charges."""
        accounts = [f"key:{key_id}:available", f"key:{key_id}:reserved"]
        async with self.engine.connect() as conn:
            net = await conn.scalar(
                select(func.coalesce(func.sum(LedgerEntry.amount_msat), 0))
                .join(LedgerTxn, LedgerEntry.txn_id == LedgerTxn.id)
                .where(LedgerEntry.account.in_(accounts),
                       LedgerTxn.kind.in_(("charge", "refund"))))
        return -int(net)

    async def entries_of(self, txn: str) -> list[tuple[str, int]]:
        """The ``(account, msat)`` entries of one transaction (none if it is not there)."""
        async with self.engine.connect() as conn:
            rows = await conn.execute(select(LedgerEntry.account, LedgerEntry.amount_msat)
                                      .where(LedgerEntry.txn_id == txn)
                                      .order_by(LedgerEntry.id))
            return [(account, int(amount)) for account, amount in rows]

    async def job_charge(self, job_id: str) -> JobCharge | None:
        """What a settled job was billed (None: it was charged nothing, or never settled)."""
        async with self.engine.connect() as conn:
            row = (await conn.execute(select(JobChargeRow)
                                      .where(JobChargeRow.job_id == job_id))).first()
        if row is None:
            return None
        return JobCharge(row.job_id, row.key_id, row.size_class, row.prompt_msat_per_1k,
                         row.completion_msat_per_1k, row.prompt_tokens, row.completion_tokens,
                         row.charge_msat)

    async def worker_jobs(self, pubkey: str) -> int:
        async with self.engine.connect() as conn:
            value = await conn.scalar(select(WorkerRecord.jobs_settled)
                                      .where(WorkerRecord.key == pubkey))
        return int(value or 0)

    async def worker_credits(self, pubkey: str, since: datetime) -> tuple[int, int]:
        """A worker's earnings credited by charges: in total, and since ``since``."""
        accounts = [f"worker:{pubkey}:pending", f"worker:{pubkey}:available",
                    f"worker:{pubkey}:debt"]
        credited = (
            select(func.coalesce(func.sum(LedgerEntry.amount_msat), 0))
            .join(LedgerTxn, LedgerEntry.txn_id == LedgerTxn.id)
            .where(LedgerEntry.account.in_(accounts), LedgerTxn.kind.in_(("charge", "refund")))
        )
        async with self.engine.connect() as conn:
            total = int(await conn.scalar(credited))
            today = int(await conn.scalar(credited.where(LedgerTxn.created_at >= since)))
        return total, today

    async def last_seq(self) -> int:
        async with self.engine.connect() as conn:
            return int(await conn.scalar(select(func.max(LedgerTxn.seq))) or 0)

    async def check(self) -> CheckReport:
        """Verify the ledger: every txn and the whole ledger sum to zero, cached balances equal
        their entries, and no account but the deposit source is below zero."""
        report = CheckReport()
        async with self.engine.connect() as conn:
            report.entries = int(await conn.scalar(select(func.count(LedgerEntry.id))) or 0)
            report.txns = int(await conn.scalar(select(func.count(LedgerTxn.seq))) or 0)
            report.total_msat = int(
                await conn.scalar(select(func.coalesce(func.sum(LedgerEntry.amount_msat), 0))))
            unbalanced = await conn.execute(
                select(LedgerTxn.id)
                .join(LedgerEntry, LedgerEntry.txn_id == LedgerTxn.id)
                .group_by(LedgerTxn.id)
                .having(func.sum(LedgerEntry.amount_msat) != 0)
            )
            report.unbalanced_txns = [txn for (txn,) in unbalanced]
            derived = dict((await conn.execute(
                select(LedgerEntry.account, func.sum(LedgerEntry.amount_msat))
                .group_by(LedgerEntry.account))).all())
            cached = dict((await conn.execute(select(Account.name, Account.balance_msat))).all())
        for name in set(derived) | set(cached):
            have, want = int(cached.get(name, 0)), int(derived.get(name, 0))
            if have != want:
                report.drift[name] = (have, want)
            if want < 0 and not may_go_negative(name):
                report.negative[name] = want
            if want > 0 and name.endswith(":debt"):
                report.debts_above_zero[name] = want
        return report


def _charge_row(charge: JobCharge, now: datetime) -> dict[str, object]:
    return {"job_id": charge.job_id, "key_id": charge.key_id, "size_class": charge.size_class,
            "prompt_msat_per_1k": charge.prompt_msat_per_1k,
            "completion_msat_per_1k": charge.completion_msat_per_1k,
            "prompt_tokens": charge.prompt_tokens, "completion_tokens": charge.completion_tokens,
            "charge_msat": charge.charge_msat, "created_at": now}
