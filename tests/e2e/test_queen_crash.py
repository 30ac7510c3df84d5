"""SIGKILL the queen under load, then start it again.

A queen process (billing on, SQLite file) serves streams from three stub-engine worker processes
(the real link with its backoff). Mid-load the queen is SIGKILLed. Clients in flight must get a
clean transport error, never a hang; every ledger row committed before the kill must still be
there; while the queen is down the workers must retry with backoff (a counting listener on the
queen's port sees their attempts), and they must all be back within seconds of the restart.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import sys
import time
from pathlib import Path

import httpx
import orjson
import pytest

from desktop_worker.identity import WorkerIdentity
from tests.support.processes import Proc, base_env, free_port, health, queen_cli, queen_process
from tests.support.workers import ECHO_MODEL, echo_words

log = logging.getLogger(__name__)

pytestmark = pytest.mark.timeout(240)

WORKERS = 3
DOWN_S = 4.0


def ledger_rows(tmp: Path) -> set[tuple]:
    """Every committed ledger entry, read straight from the SQLite file."""
    with sqlite3.connect(tmp / "queen.sqlite3") as db:
        return set(db.execute(
            "SELECT t.id, t.kind, e.account, e.amount_msat FROM ledger_txns t "
            "JOIN ledger_entries e ON e.txn_id = t.id"))


async def wait_until(predicate, timeout_s: float) -> float:
    """Poll ``predicate`` (a blocking call, run in a thread); return the seconds it took."""
    started = time.monotonic()
    async with asyncio.timeout(timeout_s):
        # Another process's state: nothing to await but its answers.
        while not await asyncio.to_thread(predicate):  # noqa: ASYNC110
            await asyncio.sleep(0.05)
    return time.monotonic() - started


async def test_a_queen_killed_under_load_loses_no_ledger_row_and_workers_come_back(tmp_path):
    created = queen_cli(tmp_path, "keys", "create", "--name", "crash", "--credit-sats", "100000")
    assert created.returncode == 0, created.stderr
    secret = next(line for line in created.stdout.splitlines() if line.startswith("sk-apiary-"))
    port = free_port()

    def queen() -> Proc:
        return queen_process(tmp_path, port, auth="keys", heartbeat_interval_s="1")

    workers = []
    for i in range(WORKERS):
        home = tmp_path / f"stub{i}"
        home.mkdir()
        WorkerIdentity.load_or_create(home / "worker-key.pem")
        workers.append(Proc([sys.executable, "-m", "tests.support.stub_worker", "--queen",
                             f"ws://127.0.0.1:{port}/worker", "--key",
                             str(home / "worker-key.pem"), "--token-delay-ms", "20"],
                            home / "worker.log", base_env(home)))
    first = queen().start()
    procs = [first, *workers]
    try:
        # Workers start once the queen listens, so their backoff starts from its first step.
        await wait_until(lambda: bool(health(port)), 60)
        for worker in workers:
            worker.start()
        await wait_until(lambda: health(port).get("workers") == WORKERS, 60)

        done: list[str] = []  # completion ids that got [DONE]
        broken: list[BaseException] = []  # what clients in flight at the kill got
        stop = asyncio.Event()
        headers = {"Authorization": f"Bearer {secret}"}

        async def client(n: int) -> None:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}",
                                         timeout=httpx.Timeout(30, connect=5)) as http:
                i = 0
                while not stop.is_set():
                    i += 1
                    body = {"model": ECHO_MODEL, "stream": True, "messages": [
                        {"role": "user", "content": " ".join(f"c{n}r{i}w{k}" for k in range(12))}]}
                    events = []
                    try:
                        async with http.stream("POST", "/v1/chat/completions", json=body,
                                               headers=headers) as response:
                            assert response.status_code == 200
                            async for line in response.aiter_lines():
                                if line.startswith("data: "):
                                    events.append(line[6:])
                    except httpx.TransportError as exc:
                        broken.append(exc)
                        return
                    assert events[-1] == "[DONE]"
                    chunks = [orjson.loads(e) for e in events[:-1]]
                    text = "".join(c["choices"][0]["delta"].get("content") or ""
                                   for c in chunks if c.get("choices"))
                    assert text == "".join(echo_words(body))
                    done.append(chunks[0]["id"])

        clients = [asyncio.create_task(client(n)) for n in range(6)]
        async with asyncio.timeout(60):
            while len(done) < 30:  # noqa: ASYNC110 (load is under way; count its answers)
                await asyncio.sleep(0.05)
        before = await asyncio.to_thread(ledger_rows, tmp_path)
        answered = list(done)
        stop.set()
        first.popen.kill()  # SIGKILL, mid-stream for the clients in flight
        first.popen.wait()
        # While the queen is down, count the workers' reconnection attempts on its port.
        attempts: list[float] = []

        async def count(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            attempts.append(time.monotonic())
            writer.close()

        listener = await asyncio.start_server(count, "127.0.0.1", port, reuse_address=True)
        down = time.monotonic()
        async with asyncio.timeout(20):  # nobody hangs: each in-flight client gets an error
            await asyncio.gather(*clients)
        assert broken, "no client was in flight at the kill"
        assert all(isinstance(exc, httpx.TransportError) for exc in broken)
        # The outage itself: a fixed length of time in which to count the attempts.
        await asyncio.sleep(max(0.0, DOWN_S - (time.monotonic() - down)))
        listener.close()
        await listener.wait_closed()
        # Backoff with jitter: about 1, 2, 4 s apart per worker, not a storm of retries.
        assert 1 <= len(attempts) <= WORKERS * 4, attempts

        second = queen().start()
        procs.append(second)
        back_s = await wait_until(lambda: health(port).get("workers") == WORKERS, 30)
        log.warning("queen crash: %d answers before the SIGKILL, %d clients cut off; %d "
                    "reconnection attempts from %d workers in %.0f s down; all back %.1f s "
                    "after the restart", len(answered), len(broken), len(attempts), WORKERS,
                    DOWN_S, back_s)
        assert back_s < 15

        after = await asyncio.to_thread(ledger_rows, tmp_path)
        assert before <= after  # no committed row lost
        txns = {row[0] for row in after}
        assert all(f"settle:{completion}" in txns for completion in answered)
        check = queen_cli(tmp_path, "ledger", "check")
        assert check.returncode == 0, check.stdout + check.stderr

        # The restarted swarm serves again.
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
            response = await http.post("/v1/chat/completions", headers=headers, json={
                "model": ECHO_MODEL, "messages": [{"role": "user", "content": "again"}]})
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"] == "echo: again"
    finally:
        for proc in reversed(procs):
            proc.stop(kill=True)
