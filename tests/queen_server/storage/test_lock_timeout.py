"""On PostgreSQL a statement of the queen waits a bounded time on a lock (``db_lock_timeout_s``),
then fails with an error, instead of holding a client's request for as long as another session
holds the lock."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from queen_server.storage.engine import Database, DatabaseError, postgres_server_settings


def test_the_settings_every_session_gets() -> None:
    assert postgres_server_settings(30.0) == {"idle_in_transaction_session_timeout": "120s",
                                              "lock_timeout": "30000ms"}
    assert "lock_timeout" not in postgres_server_settings(0)  # 0: wait for ever, as before


async def test_a_statement_blocked_by_a_held_lock_fails_instead_of_hanging(db_url: str) -> None:
    if not db_url.startswith("postgresql"):
        pytest.skip("lock timeouts are PostgreSQL's")
    db = Database(db_url, lock_timeout_s=0.5)
    other = create_async_engine(db_url)
    try:
        await db.upgrade()
        async with db.engine.connect() as conn:
            assert (await conn.execute(text("SHOW lock_timeout"))).scalar() == "500ms"
        secret = await db.shared_secret("locked")
        async with other.connect() as holder:
            # Another session (a stuck replica, an operator's psql) holds the table.
            await holder.execute(text("BEGIN"))
            await holder.execute(text("LOCK TABLE queen_secrets IN ACCESS EXCLUSIVE MODE"))
            with pytest.raises(DatabaseError, match="lock timeout"):
                await asyncio.wait_for(db.shared_secret("locked"), 20)
            await holder.execute(text("ROLLBACK"))
        assert await db.shared_secret("locked") == secret  # nothing broken behind it
    finally:
        await db.close()
        await other.dispose()
