"""The Files API's records in the queen's database (table ``files``): one row per upload, read
only through its owner, so that no query can hand one caller another's file. A delete marks the
row; a list page follows ``seq`` (the order of upload), which a cursor's id finds even once its
file is deleted."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from sqlalchemy import insert, select, update
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine

from queen_server.files.errors import FileStorageError
from queen_server.storage.tables import StoredFile

Order = Literal["asc", "desc"]


@dataclass(frozen=True, slots=True)
class FileRecord:
    id: str
    owner: str
    filename: str
    purpose: str
    bytes: int
    examples: int
    sha256: str
    location: str
    created_at: datetime

    @classmethod
    def of(cls, row: Any) -> FileRecord:
        """From a ``files`` row (SQLite gives its times back without their zone: UTC)."""
        created = row.created_at
        return cls(row.id, row.owner, row.filename, row.purpose, row.bytes, row.examples,
                   row.sha256, row.location,
                   created if created.tzinfo is not None else created.replace(tzinfo=UTC))


@dataclass(frozen=True, slots=True)
class FilePage:
    records: list[FileRecord]
    has_more: bool


class UnknownCursor(LookupError):
    """``after`` names no file of this owner (deleted ones count: their place is kept)."""


class FileRecords:
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def add(self, record: FileRecord) -> None:
        try:
            async with self.engine.begin() as conn:
                await conn.execute(insert(StoredFile).values(asdict(record)))
        except SQLAlchemyError as exc:
            raise _database_error(exc) from exc

    async def get(self, owner: str, file_id: str) -> FileRecord | None:
        """The owner's live file with this id; None for a deleted one, another owner's, or
        none at all (the caller cannot tell which)."""
        query = select(StoredFile).where(StoredFile.owner == owner, StoredFile.id == file_id,
                                         StoredFile.deleted_at.is_(None))
        try:
            async with self.engine.connect() as conn:
                row = (await conn.execute(query)).first()
        except SQLAlchemyError as exc:
            raise _database_error(exc) from exc
        return FileRecord.of(row) if row is not None else None

    async def page(self, owner: str, *, purpose: str | None = None, limit: int = 10_000,
                   order: Order = "desc", after: str | None = None) -> FilePage:
        """Up to ``limit`` of the owner's live files in upload order (``desc``: newest first),
        past the file ``after`` names; ``UnknownCursor`` if it names none of the owner's."""
        query = select(StoredFile).where(StoredFile.owner == owner,
                                         StoredFile.deleted_at.is_(None))
        if purpose is not None:
            query = query.where(StoredFile.purpose == purpose)
        try:
            async with self.engine.connect() as conn:
                if after is not None:
                    seq = await conn.scalar(select(StoredFile.seq).where(
                        StoredFile.owner == owner, StoredFile.id == after))
                    if seq is None:
                        raise UnknownCursor(after)
                    query = query.where(StoredFile.seq > seq if order == "asc"
                                        else StoredFile.seq < seq)
                query = query.order_by(StoredFile.seq.asc() if order == "asc"
                                       else StoredFile.seq.desc()).limit(limit + 1)
                rows = (await conn.execute(query)).all()
        except SQLAlchemyError as exc:
            raise _database_error(exc) from exc
        records = [FileRecord.of(row) for row in rows[:limit]]
        return FilePage(records, len(rows) > limit)

    async def mark_deleted(self, owner: str, file_id: str) -> FileRecord | None:
        """Mark the owner's live file deleted and answer it; None if there was none (or a
        concurrent delete marked it first)."""
        try:
            async with self.engine.begin() as conn:
                row = (await conn.execute(select(StoredFile).where(
                    StoredFile.owner == owner, StoredFile.id == file_id,
                    StoredFile.deleted_at.is_(None)))).first()
                if row is None:
                    return None
                marked = await conn.execute(
                    update(StoredFile)
                    .where(StoredFile.seq == row.seq, StoredFile.deleted_at.is_(None))
                    .values(deleted_at=datetime.now(UTC)))
        except SQLAlchemyError as exc:
            raise _database_error(exc) from exc
        return FileRecord.of(row) if marked.rowcount == 1 else None


def _database_error(exc: SQLAlchemyError) -> FileStorageError:
    return FileStorageError(f"The queen's database failed: {type(exc).__name__}.")
