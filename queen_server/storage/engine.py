"""The queen's database: SQLite by default, PostgreSQL by URL, through SQLAlchemy's async API.

``start()`` brings the schema up to date with the Alembic migrations in ``migrations/`` (also
``apiary-queen db upgrade``). Worker identities are written on connect, never per job; the
ledger has its own batched writer (``billing/store.py``).
"""

from __future__ import annotations

import logging
import secrets
from datetime import UTC, datetime
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import event, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Connection, make_url
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker, create_async_engine

from queen_server.errors import QueenError
from queen_server.settings import async_database_url
from queen_server.storage.tables import QueenSecret, WorkerRecord

MIGRATIONS = Path(__file__).parent / "migrations"

log = logging.getLogger(__name__)


class DatabaseError(QueenError):
    pass


def _sqlite_pragmas(dbapi_connection, _record) -> None:  # type: ignore[no-untyped-def]
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def postgres_server_settings(lock_timeout_s: float) -> dict[str, str]:
    """What every PostgreSQL session of the queen sets: how long a statement may wait on a lock
    (then it fails with a clear error instead of holding a client's request for as long as the
    lock lasts; 0: for ever), and how long a session may sit idle inside a transaction before
    the server ends it (its locks with it: a queen that froze mid-transaction blocks no one)."""
    settings = {"idle_in_transaction_session_timeout": "120s"}
    if lock_timeout_s > 0:
        settings["lock_timeout"] = f"{round(lock_timeout_s * 1000)}ms"
    return settings


class Database:
    def __init__(self, url: str, *, lock_timeout_s: float = 30.0) -> None:
        """``url`` in any form ``settings.async_database_url`` takes (``sqlite:///queen.db``,
        ``postgresql://…``); a form the queen cannot open is a ``DatabaseError`` that names the
        one to write, without the password. On PostgreSQL a statement waits ``lock_timeout_s``
        at most on a lock (``postgres_server_settings``)."""
        try:
            parsed = make_url(async_database_url(url))
        except ValueError as exc:
            raise DatabaseError(str(exc)) from None
        self.url = parsed
        if parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
            Path(parsed.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
        try:
            connect_args = ({"server_settings": postgres_server_settings(lock_timeout_s)}
                            if parsed.get_backend_name() == "postgresql" else {})
            self.engine: AsyncEngine = create_async_engine(parsed, connect_args=connect_args)
        except Exception as exc:  # unknown dialect or driver
            raise DatabaseError(f"cannot open database {parsed!r}: {exc}") from exc
        if parsed.get_backend_name() == "sqlite":
            event.listen(self.engine.sync_engine, "connect", _sqlite_pragmas)
        self.sessions = async_sessionmaker(self.engine, expire_on_commit=False)

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    def _alembic(self, connection: Connection | None = None) -> Config:
        config = Config()
        config.set_main_option("script_location", str(MIGRATIONS))
        url = self.url.render_as_string(hide_password=False).replace("%", "%%")
        config.set_main_option("sqlalchemy.url", url)
        config.attributes["connection"] = connection
        return config

    async def start(self) -> None:
        """Open the database and apply any migrations it lacks."""
        await self.upgrade()

    async def upgrade(self) -> str | None:
        """Apply the migrations; returns the revision the database is now at."""

        def upgrade(connection: Connection) -> str | None:
            command.upgrade(self._alembic(connection), "head")
            row = connection.exec_driver_sql("SELECT version_num FROM alembic_version").first()
            return row[0] if row else None

        try:
            async with self.engine.begin() as conn:
                return await conn.run_sync(upgrade)
        except (SQLAlchemyError, OSError) as exc:
            raise DatabaseError(f"cannot open database {self.url!r}: {exc}") from exc

    async def close(self) -> None:
        await self.engine.dispose()

    async def shared_secret(self, name: str, size_bytes: int = 32) -> bytes:
        """The secret called ``name`` that every replica on this database shares: made at
        random by the first one to ask (a replica that loses the race to write it reads the
        winner's), the same ever after."""
        fresh = secrets.token_hex(size_bytes)
        insert = pg_insert if self.dialect == "postgresql" else sqlite_insert
        try:
            async with self.engine.begin() as conn:
                await conn.execute(insert(QueenSecret).values(name=name, value=fresh)
                                   .on_conflict_do_nothing(index_elements=["name"]))
                value = await conn.scalar(select(QueenSecret.value)
                                          .where(QueenSecret.name == name))
        except SQLAlchemyError as exc:
            raise DatabaseError(f"cannot read the shared secret {name!r}: {exc}") from exc
        if value is None:  # not reached: the row was just written or found
            raise DatabaseError(f"the shared secret {name!r} is missing")
        return bytes.fromhex(value)

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
