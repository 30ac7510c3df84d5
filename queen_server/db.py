"""The queen's database: SQLite by default, PostgreSQL by URL, through SQLAlchemy's async API.

For now it remembers every worker identity that has connected (key, public id, payout address,
version, first and last seen). Writes happen on connect and disconnect, never per job.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from pathlib import Path

from sqlalchemy import DateTime, String, event, func, select
from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from queen_server.errors import QueenError

log = logging.getLogger(__name__)


class DatabaseError(QueenError):
    pass


class Base(DeclarativeBase):
    pass


class WorkerRecord(Base):
    __tablename__ = "workers"

    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    public_id: Mapped[str] = mapped_column(String(16), index=True)
    ln_url: Mapped[str | None] = mapped_column(String(2048))
    worker_version: Mapped[str] = mapped_column(String(64), default="")
    first_seen: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    last_seen: Mapped[datetime] = mapped_column(DateTime(timezone=True))


def _sqlite_pragmas(dbapi_connection, _record) -> None:  # type: ignore[no-untyped-def]
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


class Database:
    def __init__(self, url: str) -> None:
        try:
            parsed = make_url(url)
        except Exception as exc:
            raise DatabaseError(f"not a database URL: {url!r}") from exc
        self.url = parsed
        if parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
            Path(parsed.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
        try:
            self.engine: AsyncEngine = create_async_engine(parsed)
        except Exception as exc:  # unknown dialect or driver
            raise DatabaseError(f"cannot open database {parsed!r}: {exc}") from exc
        if parsed.get_backend_name() == "sqlite":
            event.listen(self.engine.sync_engine, "connect", _sqlite_pragmas)
        self.sessions = async_sessionmaker(self.engine, expire_on_commit=False)

    async def start(self) -> None:
        try:
            async with self.engine.begin() as conn:
                await conn.run_sync(Base.metadata.create_all)
        except (SQLAlchemyError, OSError) as exc:
            raise DatabaseError(f"cannot open database {self.url!r}: {exc}") from exc

    async def close(self) -> None:
        await self.engine.dispose()

    async def record_worker(
        self, key: str, public_id: str, ln_url: str | None, worker_version: str
    ) -> None:
        now = datetime.now(UTC)
        try:
            async with self.sessions.begin() as session:
                row = await session.get(WorkerRecord, key)
                if row is None:
                    session.add(
                        WorkerRecord(
                            key=key,
                            public_id=public_id,
                            ln_url=ln_url,
                            worker_version=worker_version,
                            first_seen=now,
                            last_seen=now,
                        )
                    )
                else:
                    row.ln_url = ln_url
                    row.worker_version = worker_version
                    row.last_seen = now
        except SQLAlchemyError:
            log.exception("could not record worker %s", public_id)

    async def count_workers(self) -> int:
        async with self.sessions() as session:
            return int(await session.scalar(select(func.count()).select_from(WorkerRecord)) or 0)
