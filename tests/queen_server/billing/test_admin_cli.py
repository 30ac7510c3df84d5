"""``apiary-queen db|keys|ledger`` as an operator runs them: real subprocesses, real databases."""

from __future__ import annotations

import sqlite3
import subprocess
import sys

from alembic.script import ScriptDirectory
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from queen_server.storage.engine import MIGRATIONS
from tests.support.processes import base_env


def queen_cli(tmp_path, db_url, *args):
    env = base_env(tmp_path)
    env["APIARY_DB"] = db_url
    return subprocess.run([sys.executable, "-m", "queen_server.cli", *args], env=env,
                          capture_output=True, text=True, timeout=60)


def test_keys_lifecycle_and_a_clean_ledger(tmp_path, db_url):
    created = queen_cli(tmp_path, db_url, "keys", "create", "--name", "alice",
                        "--credit-sats", "21")
    assert created.returncode == 0, created.stderr
    secret = next(line for line in created.stdout.splitlines()
                  if line.startswith("sk-apiary-"))
    assert "shown once" in created.stdout
    assert secret not in queen_cli(tmp_path, db_url, "keys", "list").stdout  # hash only
    credit = ["keys", "credit", "1", "2.5", "--ref", "invoice-7"]
    assert "available now 23.500 sats" in queen_cli(tmp_path, db_url, *credit).stdout
    again = queen_cli(tmp_path, db_url, *credit).stdout
    assert "already credited" in again
    assert "23.500" in again
    listing = queen_cli(tmp_path, db_url, "keys", "list").stdout
    assert "alice" in listing
    assert "active" in listing
    assert queen_cli(tmp_path, db_url, "keys", "revoke", "1").returncode == 0
    assert "revoked" in queen_cli(tmp_path, db_url, "keys", "list").stdout
    check = queen_cli(tmp_path, db_url, "ledger", "check")
    assert check.returncode == 0
    assert "ledger is clean" in check.stdout
    missing = queen_cli(tmp_path, db_url, "keys", "revoke", "99")
    assert missing.returncode == 1
    assert "no key match" in missing.stderr


async def test_ledger_check_reports_drift(tmp_path, db_url):
    assert queen_cli(tmp_path, db_url, "keys", "create", "--name", "bob",
                     "--credit-sats", "5").returncode == 0
    engine = create_async_engine(db_url)
    async with engine.begin() as conn:
        await conn.execute(text("UPDATE accounts SET balance_msat = balance_msat + 1 "
                                "WHERE name = 'key:1:available'"))
    await engine.dispose()
    check = queen_cli(tmp_path, db_url, "ledger", "check")
    assert check.returncode == 1
    assert "DRIFT key:1:available: cached 5001 msat, ledger says 5000 msat" in check.stdout


def test_db_upgrade_adopts_the_first_releases_workers_table(tmp_path):
    path = tmp_path / "old.sqlite3"
    with sqlite3.connect(path) as conn:  # what the first release's create_all made
        conn.execute("CREATE TABLE workers (key VARCHAR(64) PRIMARY KEY, public_id VARCHAR(16) "
                     "NOT NULL, ln_url VARCHAR(2048), worker_version VARCHAR(64) NOT NULL, "
                     "first_seen DATETIME NOT NULL, last_seen DATETIME NOT NULL)")
        conn.execute("INSERT INTO workers VALUES ('k', 'p', NULL, 'v', '2026-11-01', "
                     "'2026-11-01')")
    result = queen_cli(tmp_path, f"sqlite+aiosqlite:///{path}", "db", "upgrade")
    assert result.returncode == 0, result.stderr
    head = ScriptDirectory(str(MIGRATIONS)).get_current_head()
    assert f"at revision {head}" in result.stdout
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT key, jobs_settled FROM workers").fetchall() == [("k", 0)]
        assert conn.execute("SELECT count(*) FROM api_keys").fetchone() == (0,)


def test_amounts_past_every_bitcoin_are_refused(tmp_path, db_url):
    for amount in ("1e300", "nan", "inf", "-1", "lots"):
        result = queen_cli(tmp_path, db_url, "keys", "create", "--name", "x",
                           "--credit-sats", amount)
        assert result.returncode == 2, (amount, result.stdout)
        assert "--credit-sats" in result.stderr
    assert queen_cli(tmp_path, db_url, "keys", "list").returncode == 0
