"""Several real queen processes sharing one PostgreSQL database and one real ``redis-server``
(issue 18), for the replica tests."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from tests.support.postgres import POSTGRES_URL, fresh_database
from tests.support.processes import Proc, base_env, free_port, health


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


# --- helpers shared by the replica tests (tests/e2e/test_replicas*.py) ---------------------------


async def start_replicas(tmp: Path, db_url: str, redis_url: str, names: str = "abc",
                         **settings: str) -> tuple[dict[str, int], dict[str, Proc]]:
    """One replica per letter of ``names``, each answering /health (the caller stops them;
    if one never answers, all are stopped here)."""
    settings.setdefault("heartbeat_interval_s", "1")
    ports = {name: free_port() for name in names}
    queens = {name: replica_process(tmp, port, name, db_url, redis_url, **settings)
              for name, port in ports.items()}
    try:
        for queen in queens.values():
            queen.start()
        await until(lambda: all(health(port) for port in ports.values()), 60,
                    f"{len(names)} queens")
    except BaseException:
        for queen in queens.values():
            queen.stop()
        raise
    return ports, queens


async def until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Wait for another process's state (read in a thread), with a deadline."""
    deadline = time.monotonic() + timeout_s
    # Other processes' state: nothing to await but their answers.
    while not await asyncio.to_thread(predicate):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.05)


def swarm_workers(port: int) -> int:
    """The whole swarm's worker count as replica ``port`` sees it (-1: no answer)."""
    return (health(port).get("swarm") or {}).get("workers", -1)


def local_workers(port: int) -> int:
    """The workers connected to replica ``port`` itself (-1: no answer)."""
    return health(port).get("workers", -1)


async def stream_text(port: int, secret: str, body: dict) -> tuple[int, str, str]:
    """(status, streamed text, the completion id) of a streamed chat completion."""
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http, \
            http.stream("POST", "/v1/chat/completions", json=body,
                        headers={"Authorization": f"Bearer {secret}"}) as response:
        if response.status_code != 200:
            await response.aread()
            return response.status_code, response.text, ""
        events = [line[6:] async for line in response.aiter_lines()
                  if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [orjson.loads(event) for event in events[:-1]]
    content = "".join(chunk["choices"][0]["delta"].get("content") or ""
                      for chunk in chunks if chunk.get("choices"))
    return 200, content, chunks[0]["id"]


async def settled_jobs(db_url: str) -> list[str]:
    """The ids of every ``settle:`` transaction in the shared ledger."""
    engine = create_async_engine(db_url)
    try:
        async with engine.connect() as conn:
            rows = await conn.execute(text("SELECT id FROM ledger_txns WHERE id LIKE 'settle:%'"))
            return [row[0] for row in rows]
    finally:
        await engine.dispose()


@dataclass(frozen=True)
class CreatedKey:
    id: int
    secret: str


def create_key(tmp: Path, db_url: str, name: str, *options: str) -> CreatedKey:
    """``apiary-queen keys create --name NAME OPTIONS`` on the shared database: the key's id
    and its secret, read from what the command prints."""
    created = replica_cli(tmp, db_url, "keys", "create", "--name", name, *options)
    assert created.returncode == 0, created.stdout + created.stderr
    found = re.search(r"created key (\d+) ", created.stdout)
    assert found is not None, created.stdout
    secret = next(line for line in created.stdout.splitlines() if line.startswith("sk-apiary-"))
    return CreatedKey(int(found.group(1)), secret)


def flat_prices(tmp: Path, model: str, completion_msat_per_token: int) -> Path:
    """A price file putting ``model`` in one class whose prompt is free and whose completion
    costs ``completion_msat_per_token`` a token, so a hold of ``max_tokens`` is known exactly."""
    path = tmp / "prices.json"
    path.write_text(json.dumps({
        "classes": [{"size_class": "flat", "max_params": None, "prompt_msat_per_1k": 0,
                     "completion_msat_per_1k": completion_msat_per_token * 1000}],
        "models": {model: "flat"}}))
    return path


class Balances:
    """Reads accounts' cached balances from the shared database (``accounts.balance_msat``,
    which ``ledger check`` compares with the entries), on one engine kept open."""

    def __init__(self, db_url: str) -> None:
        self.engine = create_async_engine(db_url)

    async def of(self, *accounts: str) -> dict[str, int]:
        async with self.engine.connect() as conn:
            rows = await conn.execute(
                text("SELECT name, balance_msat FROM accounts WHERE name = ANY(:names)"),
                {"names": list(accounts)})
            found = {name: int(balance) for name, balance in rows}
        return {account: found.get(account, 0) for account in accounts}

    async def close(self) -> None:
        await self.engine.dispose()


def ledger_is_clean(tmp: Path, db_url: str) -> None:
    """``apiary-queen ledger check`` on the shared database passes (it prints why not)."""
    check = replica_cli(tmp, db_url, "ledger", "check")
    assert check.returncode == 0, check.stdout + check.stderr
    assert "ledger is clean" in check.stdout, check.stdout


def stub_worker_process(tmp: Path, ws_urls: list[str], name: str,
                        token_delay_ms: float = 10.0, max_jobs: int = 4) -> Proc:
    """A worker process with the real link (``LinkClient`` and its ``QueenRotation`` over
    ``ws_urls``, tried in turn), job runner and identity, and a stub engine answering
    ``echo_words`` (``tests/support/stub_worker.py``)."""
    home = tmp / name
    home.mkdir(parents=True, exist_ok=True)
    args = [sys.executable, "-m", "tests.support.stub_worker", "--queen", ",".join(ws_urls),
            "--key", str(home / "worker-key.pem"), "--max-jobs", str(max_jobs),
            "--token-delay-ms", str(token_delay_ms)]
    return Proc(args, home / "worker.log", base_env(home))
