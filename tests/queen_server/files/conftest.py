from __future__ import annotations

# The same fresh database per test as the billing tests: SQLite, and PostgreSQL under .ci/run.
from tests.queen_server.billing.conftest import db_url
from tests.support.s3_server import s3_server

__all__ = ["db_url", "s3_server"]
