from __future__ import annotations

import os
import uuid

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

POSTGRES_URL = os.environ.get("APIARY_TEST_POSTGRES_URL")


@pytest.fixture(params=["sqlite", *(["postgresql"] if POSTGRES_URL else [])])
async def db_url(request, tmp_path):
    """A fresh database: a SQLite file, and a throwaway PostgreSQL schema when
    APIARY_TEST_POSTGRES_URL is set (as .ci/run does)."""
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path / 'billing.sqlite3'}"
        return
    name = f"apiary_test_{uuid.uuid4().hex[:10]}"
    admin = create_async_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
    async with admin.connect() as conn:
        await conn.execute(text(f'CREATE DATABASE "{name}"'))
    base = POSTGRES_URL.rsplit("/", 1)[0]
    try:
        yield f"{base}/{name}"
    finally:
        async with admin.connect() as conn:
            await conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        await admin.dispose()
