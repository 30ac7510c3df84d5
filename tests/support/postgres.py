"""Throwaway databases on the test PostgreSQL server (``APIARY_TEST_POSTGRES_URL``, which
``.ci/run`` starts: ``.ci/postgres.sh``)."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

POSTGRES_URL = os.environ.get("APIARY_TEST_POSTGRES_URL")


@asynccontextmanager
async def fresh_database(prefix: str = "apiary_test") -> AsyncIterator[str]:
    """A new, empty database on the test server (its ``postgresql+asyncpg://`` URL), dropped
    afterwards, whatever is still connected to it."""
    assert POSTGRES_URL, "APIARY_TEST_POSTGRES_URL is not set"
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    admin = create_async_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
    async with admin.connect() as conn:
        await conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield f"{POSTGRES_URL.rsplit('/', 1)[0]}/{name}"
    finally:
        async with admin.connect() as conn:
            await conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        await admin.dispose()
