"""The database and Redis URL forms through the real ``apiary-queen`` (a subprocess), as an
operator types them: accepted forms migrate the database, refused ones exit 2 with a message that
names the form to write and never the password. And ``--forwarded-allow-ips`` reaches uvicorn."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from alembic.script import ScriptDirectory

from queen_server.storage.engine import MIGRATIONS
from tests.support.postgres import POSTGRES_URL, fresh_database
from tests.support.processes import base_env, free_port, health, queen_process, running, wait_for

SECRET = "hunter2-secret"
HEAD = ScriptDirectory(str(MIGRATIONS)).get_current_head()


def apiary_queen(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environment = base_env(tmp_path)
    environment.pop("APIARY_DB", None)
    environment.update(env)
    return subprocess.run([sys.executable, "-m", "queen_server.cli", *args], env=environment,
                          cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)


def test_sqlite_relative_and_absolute_forms_migrate(tmp_path: Path) -> None:
    relative = apiary_queen(tmp_path, "--db", "sqlite:///relative.db", "db", "upgrade")
    assert relative.returncode == 0, relative.stderr
    assert f"database sqlite+aiosqlite:///relative.db is at revision {HEAD}" in relative.stdout
    assert (tmp_path / "relative.db").stat().st_size > 0  # relative to where it was run
    absolute = tmp_path / "deep" / "dir" / "queen.db"
    result = apiary_queen(tmp_path, "db", "upgrade", APIARY_DB=f"sqlite:///{absolute}")
    assert result.returncode == 0, result.stderr
    assert str(absolute).startswith("/")  # so the URL had four slashes
    assert absolute.stat().st_size > 0


@pytest.fixture
async def plain_postgres_url() -> str:
    """A fresh PostgreSQL database, as the plain ``postgresql://`` URL an operator writes."""
    if not POSTGRES_URL:
        pytest.skip("APIARY_TEST_POSTGRES_URL is not set (.ci/run sets it)")
    async with fresh_database() as url:
        yield "postgresql://" + url.split("://", 1)[1]


def test_postgresql_and_postgres_forms_migrate(tmp_path: Path, plain_postgres_url: str) -> None:
    for url in (plain_postgres_url, plain_postgres_url.replace("postgresql://", "postgres://")):
        result = apiary_queen(tmp_path, "--db", url, "db", "upgrade")
        assert result.returncode == 0, result.stderr
        assert "database postgresql+asyncpg://" in result.stdout
        assert f"is at revision {HEAD}" in result.stdout


@pytest.mark.parametrize(("args", "env", "says"), [
    (["--db", f"postgresql+psycopg2://apiary:{SECRET}@db/apiary"], {},
     "db: the queen needs an async database driver, and postgresql+psycopg2:// is not one: "
     "write postgresql://… (the queen then uses asyncpg) or postgresql+asyncpg://…"),
    ([], {"APIARY_DB": f"mysql://apiary:{SECRET}@db/apiary"},
     "db: the queen runs on SQLite or PostgreSQL, not 'mysql'"),
    (["--db", "queen.db"], {}, "db: not a database URL: write sqlite:///queen.db"),
    (["--redis-url", f"http://:{SECRET}@redis:6379"], {},
     "redis_url: the Redis URL must start with redis://, rediss:// (TLS) or unix://"),
    ([], {"APIARY_REDIS_URL": "redis:6379"}, "redis_url: the Redis URL must start with"),
    ([], {"APIARY_REPLICA_ID": "a b"}, "replica_id: a replica id is 1 to 64 letters"),
])
def test_bad_forms_exit_2_with_the_form_to_write(tmp_path: Path, args: list[str],
                                                 env: dict[str, str], says: str) -> None:
    env.setdefault("APIARY_DB", f"sqlite:///{tmp_path / 'ok.db'}")
    result = apiary_queen(tmp_path, *args, "db", "upgrade", **env)
    assert result.returncode == 2
    assert result.stderr.startswith("apiary-queen: bad setting: ")
    assert says in result.stderr
    assert SECRET not in result.stderr + result.stdout
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "ok.db").exists()  # nothing was opened


def test_a_bad_form_stops_the_server_before_it_listens(tmp_path: Path) -> None:
    port = free_port()
    result = apiary_queen(tmp_path, "--port", str(port), "--db",
                          f"postgresql+psycopg2://u:{SECRET}@127.0.0.1/x")
    assert result.returncode == 2
    assert "bad setting: db: the queen needs an async database driver" in result.stderr
    assert SECRET not in result.stderr


def test_forwarded_headers_are_believed_only_from_the_named_proxy(tmp_path: Path) -> None:
    """With ``--forwarded-allow-ips 127.0.0.2`` the landing page's worker URL follows the
    proxy's X-Forwarded-Proto from 127.0.0.2 and ignores it from 127.0.0.1 (uvicorn's default
    would trust 127.0.0.1 instead)."""
    port = free_port()
    queen = queen_process(tmp_path, port)
    queen.args += ["--forwarded-allow-ips", "127.0.0.2"]
    headers = {"x-forwarded-proto": "https", "host": "queen.example"}

    def page_from(address: str) -> str:
        transport = httpx.HTTPTransport(local_address=address)
        with httpx.Client(transport=transport, trust_env=False, timeout=10) as http:
            return http.get(f"http://127.0.0.1:{port}/", headers=headers).text

    with running(queen.start()):
        wait_for(lambda: health(port).get("status") == "ok" or not queen.alive(), 30,
                 "the queen to start")
        assert queen.alive(), queen.log()
        assert "wss://queen.example/worker" in page_from("127.0.0.2")
        from_elsewhere = page_from("127.0.0.1")
        assert "wss://queen.example/worker" not in from_elsewhere
        assert "ws://queen.example/worker" in from_elsewhere
