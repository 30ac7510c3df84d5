"""Several real queen processes sharing one PostgreSQL database and one real ``redis-server``
(issue 18), for the replica tests."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.support.postgres import POSTGRES_URL, fresh_database
from tests.support.processes import Proc, base_env


@pytest.fixture
async def shared_db() -> AsyncIterator[str]:
    """A fresh PostgreSQL database (the replicas' source of truth), migrated once, as the
    compose file's one-shot ``migrate`` does; skipped without APIARY_TEST_POSTGRES_URL."""
    if not POSTGRES_URL:
        pytest.skip("APIARY_TEST_POSTGRES_URL is not set (.ci/run sets it)")
    async with fresh_database("apiary_replicas") as url:
        migrated = replica_cli(Path("."), url, "db", "upgrade")
        assert migrated.returncode == 0, migrated.stderr
        yield url


def replica_cli(tmp: Path, db_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = base_env(tmp)
    env["APIARY_DB"] = db_url
    return subprocess.run([sys.executable, "-m", "queen_server.cli", *args], env=env,
                          capture_output=True, text=True, timeout=60, check=False)


def replica_process(tmp: Path, port: int, replica_id: str, db_url: str, redis_url: str,
                    **settings: str) -> Proc:
    """One queen replica (keys required, unless ``auth`` says otherwise)."""
    env = base_env(tmp)
    env.update({"APIARY_AUTH": "keys", "APIARY_REPLICA_ID": replica_id, "APIARY_DB": db_url,
                "APIARY_REDIS_URL": redis_url})
    env.update({f"APIARY_{key.upper()}": value for key, value in settings.items()})
    args = [sys.executable, "-m", "queen_server.cli", "--port", str(port), "--log-level",
            "info"]
    return Proc(args, tmp / f"queen-{replica_id}.log", env)
