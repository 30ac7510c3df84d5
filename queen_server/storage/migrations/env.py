"""Alembic environment: runs migrations on the queen's async engine (SQLite or PostgreSQL)."""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine

from queen_server.storage.tables import Base

config = context.config
target_metadata = Base.metadata


def run(connection: Connection) -> None:
    context.configure(connection=connection, target_metadata=target_metadata,
                      render_as_batch=connection.dialect.name == "sqlite")
    with context.begin_transaction():
        context.run_migrations()


async def run_async(url: str) -> None:
    engine = create_async_engine(url)
    async with engine.begin() as conn:
        await conn.run_sync(run)
    await engine.dispose()


connection = config.attributes.get("connection")
if context.is_offline_mode():
    context.configure(url=config.get_main_option("sqlalchemy.url"),
                      target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
elif connection is not None:  # handed in by storage.engine.Database.upgrade (the usual path)
    run(connection)
else:  # the plain `alembic` command line
    asyncio.run(run_async(config.get_main_option("sqlalchemy.url")))
