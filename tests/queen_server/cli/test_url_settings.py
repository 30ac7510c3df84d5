"""The URL forms operators write (issue 18), read by the settings: database URLs mapped to the
async drivers, Redis URLs checked, the replica id and the proxy setting. Pure: no process."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from sqlalchemy.engine import make_url

from queen_server.cli.main import describe
from queen_server.settings import QueenSettings, async_database_url, default_replica_id
from queen_server.storage.engine import Database, DatabaseError

SECRET = "hunter2-secret"


@pytest.mark.parametrize(("written", "opened"), [
    ("sqlite:///queen.db", "sqlite+aiosqlite:///queen.db"),
    ("sqlite:////var/lib/apiary/queen.db", "sqlite+aiosqlite:////var/lib/apiary/queen.db"),
    ("sqlite:///:memory:", "sqlite+aiosqlite:///:memory:"),
    ("sqlite+aiosqlite:///queen.db", "sqlite+aiosqlite:///queen.db"),
    ("postgresql://apiary:pw@db/apiary", "postgresql+asyncpg://apiary:pw@db/apiary"),
    ("postgres://apiary:pw@db:5433/apiary", "postgresql+asyncpg://apiary:pw@db:5433/apiary"),
    ("POSTGRESQL://db/apiary", "postgresql+asyncpg://db/apiary"),
    ("postgresql+asyncpg://db/apiary?ssl=require", "postgresql+asyncpg://db/apiary?ssl=require"),
    # psycopg 3 has an async dialect: an explicit async driver stays as written.
    ("postgresql+psycopg://db/apiary", "postgresql+psycopg://db/apiary"),
    (" sqlite:///queen.db\n", "sqlite+aiosqlite:///queen.db"),
])
def test_the_usual_forms_open_with_the_async_drivers(written: str, opened: str) -> None:
    assert async_database_url(written) == opened
    assert QueenSettings(db=written).db == opened


def test_a_password_with_escapes_survives_the_mapping() -> None:
    url = make_url(QueenSettings(db="postgresql://u:p%40ss%2Fw@db/apiary").db)
    assert url.password == "p@ss/w"
    assert url.drivername == "postgresql+asyncpg"


@pytest.mark.parametrize(("written", "says"), [
    (f"postgresql+psycopg2://u:{SECRET}@db/apiary", "postgresql://… (the queen then uses "
     "asyncpg) or postgresql+asyncpg://…"),
    (f"postgresql+pg8000://u:{SECRET}@db/apiary", "needs an async database driver"),
    ("sqlite+pysqlite:///queen.db", "sqlite://… (the queen then uses aiosqlite)"),
    (f"postgresql+nosuch://u:{SECRET}@db/apiary", "no database driver is called 'nosuch'"),
    (f"mysql://u:{SECRET}@db/apiary", "SQLite or PostgreSQL, not 'mysql'"),
    ("queen.db", "not a database URL: write sqlite:///queen.db"),
    ("", "not a database URL"),
    (f"postgresql://u:{SECRET}@db:notaport/apiary", "not a database URL (postgresql://…)"),
])
def test_forms_the_queen_cannot_open_are_refused_by_name(written: str, says: str) -> None:
    with pytest.raises(ValidationError) as caught:
        QueenSettings(db=written)
    message = describe(caught.value)
    assert message.startswith("db: ")
    assert says in message
    assert SECRET not in message
    with pytest.raises(DatabaseError) as refused:  # the same at the Database boundary
        Database(written)
    assert says in str(refused.value)
    assert SECRET not in str(refused.value)


def test_the_database_boundary_maps_the_plain_forms_too(tmp_path) -> None:
    db = Database(f"sqlite:///{tmp_path / 'plain.db'}")
    assert db.url.drivername == "sqlite+aiosqlite"
    assert db.dialect == "sqlite"


@pytest.mark.parametrize("url", ["redis://redis:6379/0", "rediss://:pw@cache.example:6380",
                                 "unix:///run/redis/redis.sock?db=2", "REDIS://localhost"])
def test_redis_urls_the_client_opens_are_accepted(url: str) -> None:
    assert QueenSettings(redis_url=url).redis_url == url


def test_no_redis_is_the_default_and_an_empty_value_means_none(monkeypatch) -> None:
    assert QueenSettings().redis_url is None
    monkeypatch.setenv("APIARY_REDIS_URL", "")
    assert QueenSettings().redis_url is None
    monkeypatch.setenv("APIARY_REDIS_URL", "redis://127.0.0.1:6379")
    assert QueenSettings().redis_url == "redis://127.0.0.1:6379"


@pytest.mark.parametrize(("url", "says"), [
    (f"http://u:{SECRET}@redis:6379", "not http://"),
    (f"memcached://u:{SECRET}@cache", "not memcached://"),
    ("redis:6379", "not a URL without a scheme"),
    (f"redis://:{SECRET}@/0", "names no host"),
    ("unix://", "names no socket"),
])
def test_other_redis_urls_are_refused_clearly(url: str, says: str) -> None:
    with pytest.raises(ValidationError) as caught:
        QueenSettings(redis_url=url)
    message = describe(caught.value)
    assert message.startswith("redis_url: ")
    assert "redis://, rediss://" in message or says in message
    assert says in message
    assert SECRET not in message


def test_each_process_gets_its_own_replica_id_unless_one_is_named(monkeypatch) -> None:
    first, second = default_replica_id(), default_replica_id()
    assert first != second  # a restarted container (same host name and pid) is a new replica
    assert QueenSettings().replica_id != QueenSettings().replica_id
    monkeypatch.setenv("APIARY_REPLICA_ID", "queen-2")
    assert QueenSettings().replica_id == "queen-2"


@pytest.mark.parametrize("bad", ["", "has space", "a/b", "-leading", "x" * 65, "q\nnewline",
                                 "queen-1\n"])
def test_a_replica_id_that_would_break_redis_keys_is_refused(bad: str) -> None:
    with pytest.raises(ValidationError) as caught:
        QueenSettings(replica_id=bad)
    assert "replica_id: a replica id is 1 to 64 letters" in describe(caught.value)


def test_forwarded_allow_ips_defaults_to_uvicorns_own(monkeypatch) -> None:
    assert QueenSettings().forwarded_allow_ips is None
    monkeypatch.setenv("APIARY_FORWARDED_ALLOW_IPS", "172.28.0.0/16")
    assert QueenSettings().forwarded_allow_ips == "172.28.0.0/16"
