"""The audits' records in the queen's database: each audited job (the evidence) and each
worker's standing, written together so that a standing never runs ahead of its evidence; and
when a worker first connected (``workers.first_seen``), which auditors' independence reads."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.ext.asyncio import AsyncEngine

from queen_server.audits.decision import Standing
from queen_server.storage.tables import AuditRecord, AuditStandingRow, WorkerRecord


@dataclass(frozen=True, slots=True)
class Record:
    """A worker's standing as stored: the test's state, how often it was flagged, and how
    often, as an auditor, a second opinion contradicted its failing verdict (``outvoted``)."""

    standing: Standing
    flags: int = 0
    flagged_at: datetime | None = None
    cleared_at: datetime | None = None
    outvoted: int = 0


@dataclass(frozen=True, slots=True)
class AuditRow:
    """One audited job as the admin pages show it."""

    id: int
    created_at: datetime
    request_id: str
    worker_key: str
    auditor_key: str
    auditor_trusted: bool
    model: str
    temperature: float
    answer_tokens: int
    claimed_tokens: int
    positions: int
    mismatches: int
    z: float
    suspicion: float | None
    failed: bool
    reason: str
    charged_msat: int
    refunded: bool
    audit_tokens: int
    audit_s: float
    claimed_prompt_tokens: int | None  # None on rows written before prompts were counted
    prompt_tokens: int | None


def _record(row: Any) -> Record:
    standing = Standing(row.llr, row.audited, row.failed, row.state,
                        tuple(json.loads(row.reasons or "[]")))
    return Record(standing, row.flags, row.flagged_at, row.cleared_at, row.outvoted or 0)


class AuditStore:
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def record(self, worker_key: str) -> Record:
        async with self.engine.connect() as conn:
            row = (await conn.execute(select(AuditStandingRow)
                                      .where(AuditStandingRow.worker_key == worker_key))).first()
        return Record(Standing()) if row is None else _record(row)

    async def save(self, worker_key: str, record: Record,
                   audit: dict[str, Any] | None = None) -> None:
        """Write a worker's standing, and the audit that moved it, in one transaction."""
        now = datetime.now(UTC)
        standing = record.standing
        values = {"state": standing.state, "llr": standing.llr, "audited": standing.audited,
                  "failed": standing.failed, "reasons": json.dumps(list(standing.reasons)),
                  "flags": record.flags, "flagged_at": record.flagged_at,
                  "cleared_at": record.cleared_at, "outvoted": record.outvoted,
                  "updated_at": now}
        insert = pg_insert if self.engine.dialect.name == "postgresql" else sqlite_insert
        statement = insert(AuditStandingRow).values(worker_key=worker_key, **values)
        async with self.engine.begin() as conn:
            if audit is not None:
                await conn.execute(AuditRecord.__table__.insert().values(
                    created_at=now, worker_key=worker_key, **audit))
            await conn.execute(statement.on_conflict_do_update(
                index_elements=["worker_key"], set_=values))

    async def first_seen(self, worker_key: str) -> datetime | None:
        """When the worker first connected to this queen (None: never recorded). UTC."""
        async with self.engine.connect() as conn:
            moment = (await conn.execute(select(WorkerRecord.first_seen)
                                         .where(WorkerRecord.key == worker_key))).scalar()
        if moment is None:
            return None
        return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)

    async def failed_unrefunded(self, worker_key: str) -> list[tuple[int, str]]:
        """``(audit id, request id)`` of the worker's failed audited jobs not refunded yet."""
        async with self.engine.connect() as conn:
            rows = await conn.execute(
                select(AuditRecord.id, AuditRecord.request_id)
                .where(AuditRecord.worker_key == worker_key, AuditRecord.failed.is_(True),
                       AuditRecord.refunded.is_(False))
                .order_by(AuditRecord.id))
            return [(int(audit_id), request_id) for audit_id, request_id in rows]

    async def mark_refunded(self, audit_id: int) -> None:
        async with self.engine.begin() as conn:
            await conn.execute(update(AuditRecord).where(AuditRecord.id == audit_id)
                               .values(refunded=True))

    async def recent(self, limit: int, worker_key: str | None = None) -> list[AuditRow]:
        query = select(*(getattr(AuditRecord, name) for name in AuditRow.__slots__))
        if worker_key is not None:
            query = query.where(AuditRecord.worker_key == worker_key)
        async with self.engine.connect() as conn:
            rows = await conn.execute(query.order_by(AuditRecord.id.desc()).limit(limit))
            return [AuditRow(*row) for row in rows]

    async def standings(self) -> dict[str, Record]:
        async with self.engine.connect() as conn:
            rows = await conn.execute(select(AuditStandingRow))
            return {row.worker_key: _record(row) for row in rows}

    async def totals(self) -> tuple[int, int, float]:
        """Audits run, tokens auditors evaluated, and their seconds, in all."""
        async with self.engine.connect() as conn:
            row = (await conn.execute(select(
                func.count(AuditRecord.id), func.coalesce(func.sum(AuditRecord.audit_tokens), 0),
                func.coalesce(func.sum(AuditRecord.audit_s), 0.0)))).one()
        return int(row[0]), int(row[1]), float(row[2])
