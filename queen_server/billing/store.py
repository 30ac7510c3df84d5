"""The ledger in the database: a group-commit writer, balance reads, and the integrity check.

Postings queue up and one writer task commits everything waiting in a single transaction (one
fsync for many requests), then resolves each caller's future. A posting whose txn id is already
in the ledger is skipped, which makes every posting idempotent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime

from sqlalchemy import func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from queen_server.billing.ledger import Posting
from queen_server.errors import QueenError
from queen_server.storage.tables import Account, LedgerEntry, LedgerTxn, WorkerRecord

log = logging.getLogger(__name__)


class LedgerWriteError(QueenError):
    pass


@dataclass
class CheckReport:
    entries: int = 0
    txns: int = 0
    total_msat: int = 0
    unbalanced_txns: list[str] = field(default_factory=list)
    drift: dict[str, tuple[int, int]] = field(default_factory=dict)  # account: (cached, derived)
    negative: dict[str, int] = field(default_factory=dict)

    @property
    def clean(self) -> bool:
        return self.total_msat == 0 and not self.unbalanced_txns and not self.drift and not (
            self.negative
        )


# Accounts allowed below zero: the source of deposits.
MAY_GO_NEGATIVE = ("deposits",)


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
        """Commit a posting; True if it was new, False if its txn id was already there."""
        if self._writer is None:
            async with self.engine.begin() as conn:
                [applied] = await self._apply(conn, [posting])
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
        so that one bad posting (an amount the database cannot store) fails only itself. The
        writer never dies: every future gets a result or a ``LedgerWriteError``."""
        try:
            async with self.engine.begin() as conn:
                results = await self._apply(conn, [posting for posting, _ in batch])
        except Exception as exc:  # the database, or a value it cannot take
            if len(batch) > 1:
                for item in batch:
                    await self._commit([item])
                return
            [(posting, future)] = batch
            log.exception("the ledger could not commit posting %s", posting.txn)
            if not future.done():
                future.set_exception(LedgerWriteError(f"the ledger could not commit: {exc}"))
            return
        for (_, future), applied in zip(batch, results, strict=True):
            if not future.done():
                future.set_result(applied)

    async def apply_in(self, conn: AsyncConnection, postings: list[Posting]) -> list[bool]:
        """Apply postings inside the caller's transaction (to commit them with other rows)."""
        return await self._apply(conn, postings)

    async def _apply(self, conn: AsyncConnection, postings: list[Posting]) -> list[bool]:
        ids = [posting.txn for posting in postings]
        existing = set((await conn.scalars(select(LedgerTxn.id).where(LedgerTxn.id.in_(ids))))
                       .all())
        now = datetime.now(UTC)
        results: list[bool] = []
        txns: list[dict[str, object]] = []
        entries: list[dict[str, object]] = []
        deltas: dict[str, int] = defaultdict(int)
        for posting in postings:
            if posting.txn in existing:
                results.append(False)
                continue
            existing.add(posting.txn)
            txns.append({"id": posting.txn, "kind": posting.kind, "memo": posting.memo,
                         "created_at": now})
            for account, amount in posting.entries:
                entries.append({"txn_id": posting.txn, "account": account,
                                "amount_msat": amount})
                deltas[account] += amount
            results.append(True)
        jobs: dict[str, int] = defaultdict(int)
        for posting, applied in zip(postings, results, strict=True):
            if applied:
                for worker, count in posting.worker_jobs:
                    jobs[worker] += count
        if txns:
            await conn.execute(insert(LedgerTxn), txns)
        for worker, count in jobs.items():
            await conn.execute(update(WorkerRecord).where(WorkerRecord.key == worker)
                               .values(jobs_settled=WorkerRecord.jobs_settled + count))
        if entries:
            await conn.execute(insert(LedgerEntry), entries)
        if deltas:
            known = set((await conn.scalars(
                select(Account.name).where(Account.name.in_(list(deltas))))).all())
            new = [{"name": name, "balance_msat": 0, "is_liability": name not in MAY_GO_NEGATIVE}
                   for name in deltas if name not in known]
            if new:
                await conn.execute(insert(Account), new)
            for name, delta in deltas.items():
                if delta:
                    await conn.execute(update(Account).where(Account.name == name)
                                       .values(balance_msat=Account.balance_msat + delta))
        return results

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

    async def worker_jobs(self, pubkey: str) -> int:
        async with self.engine.connect() as conn:
            value = await conn.scalar(select(WorkerRecord.jobs_settled)
                                      .where(WorkerRecord.key == pubkey))
        return int(value or 0)

    async def worker_credits(self, pubkey: str, since: datetime) -> tuple[int, int]:
        """A worker's earnings credited by charges: in total, and since ``since``."""
        accounts = [f"worker:{pubkey}:pending", f"worker:{pubkey}:available"]
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
            if want < 0 and name not in MAY_GO_NEGATIVE:
                report.negative[name] = want
        return report
