from __future__ import annotations

# The same fresh database per test as the billing tests: SQLite, and PostgreSQL under .ci/run.
from tests.queen_server.billing.conftest import db_url

__all__ = ["db_url"]
