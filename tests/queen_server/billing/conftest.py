from __future__ import annotations

import pytest

from tests.support.postgres import POSTGRES_URL, fresh_database


@pytest.fixture(params=["sqlite", *(["postgresql"] if POSTGRES_URL else [])])
async def db_url(request, tmp_path):
    """A fresh database: a SQLite file, and a throwaway PostgreSQL schema when
    APIARY_TEST_POSTGRES_URL is set (as .ci/run does)."""
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path / 'billing.sqlite3'}"
        return
    async with fresh_database() as url:
        yield url
