"""The reads the queen's edges make of the database, as plain functions returning plain rows.

Route modules, the pages and the ``apiary-queen`` commands call these instead of writing SQL,
so every statement they need lives here, beside the tables. Each function takes an
``AsyncEngine`` and plain arguments and returns frozen dataclasses. Values are as the database
holds them: SQLite gives naive datetimes (which are UTC), PostgreSQL aware ones; callers that
compare times normalise them. The services that own their tables (``billing/``, ``payouts/``)
keep their own SQL.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from queen_server.storage.tables import LedgerEntry, LedgerTxn, Payout, WorkerRecord


@dataclass(frozen=True)
class PayoutRow:
    """One payout to a worker, as the admin pages, the CLI and the worker's earnings show it."""

    id: int
    worker_key: str
    amount_msat: int
    state: str
    updated_at: datetime
    detail: str


@dataclass(frozen=True)
class LedgerCredit:
    """One ledger entry: ``amount_msat`` moved into an account by transaction ``txn_id``."""

    txn_id: str
    created_at: datetime
    amount_msat: int


async def recent_payouts(
    engine: AsyncEngine, limit: int, *, worker_key: str | None = None
) -> list[PayoutRow]:
    """The latest ``limit`` payouts, newest first; only one worker's when ``worker_key``."""
    query = select(Payout.id, Payout.worker_key, Payout.amount_msat, Payout.state,
                   Payout.updated_at, Payout.detail)
    if worker_key is not None:
        query = query.where(Payout.worker_key == worker_key)
    async with engine.connect() as conn:
        rows = (await conn.execute(query.order_by(Payout.id.desc()).limit(limit))).all()
    return [PayoutRow(*row) for row in rows]


async def charges_credited(
    engine: AsyncEngine, accounts: Sequence[str], since: datetime
) -> list[LedgerCredit]:
    """What ``charge`` transactions made at or after ``since`` put into ``accounts``, newest
    transaction first (one transaction may credit several of the accounts)."""
    query = (
        select(LedgerTxn.id, LedgerTxn.created_at, LedgerEntry.amount_msat)
        .join(LedgerEntry, LedgerEntry.txn_id == LedgerTxn.id)
        .where(LedgerEntry.account.in_(list(accounts)), LedgerTxn.kind == "charge",
               LedgerTxn.created_at >= since)
        .order_by(LedgerTxn.seq.desc())
    )
    async with engine.connect() as conn:
        rows = (await conn.execute(query)).all()
    return [LedgerCredit(*row) for row in rows]


async def payout_address(engine: AsyncEngine, worker_key: str) -> str | None:
    """The payout address the queen holds for a worker (its last hello's; None: none), which
    is where its payouts go."""
    async with engine.connect() as conn:
        return await conn.scalar(select(WorkerRecord.ln_url)
                                 .where(WorkerRecord.key == worker_key))
