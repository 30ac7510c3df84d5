"""Queen replicas (issue 18): real queen processes on one PostgreSQL and one real redis-server.

A worker connected to replica A serves a request made on replica B: the job crosses the bus,
the answer comes back whole and in order, and it is billed once, in the shared ledger. When A is
SIGKILLed in the middle of a stream that B relays from A's worker, B continues it on a twin
held by replica C (mid-stream failover across replicas), and the client gets the whole answer.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.support.processes import health
from tests.support.replicas import (  # noqa: F401  (shared_db is a fixture)
    replica_cli,
    settled_jobs,
    shared_db,
    start_replicas,
    stream_text,
    swarm_workers,
    until,
)
from tests.support.workers import ECHO_MODEL, ScriptedWorker, echo_words

pytestmark = pytest.mark.timeout(180)


async def test_a_stream_asked_of_one_replica_is_served_through_another_and_billed_once(
        tmp_path, redis_server, shared_db):  # noqa: F811
    created = replica_cli(tmp_path, shared_db, "keys", "create", "--name", "replicas",
                          "--credit-sats", "100000")
    assert created.returncode == 0, created.stderr
    secret = next(line for line in created.stdout.splitlines() if line.startswith("sk-apiary-"))
    ports, queens = await start_replicas(tmp_path, shared_db, redis_server.url, names="ab")
    port_a, port_b = ports["a"], ports["b"]
    worker = None
    try:
        worker = await ScriptedWorker(f"ws://127.0.0.1:{port_a}/worker", max_jobs=2).start()
        await until(lambda: swarm_workers(port_b) == 1, 20, "replica b to see a's worker")
        assert health(port_b)["workers"] == 0  # b holds no worker itself

        body = {"model": ECHO_MODEL, "stream": True,
                "messages": [{"role": "user", "content": "one two three four five six"}]}
        status, content, completion_id = await stream_text(port_b, secret, body)
        assert status == 200, content
        assert content == "".join(echo_words(body))
        assert len(worker.jobs) == 1  # a's worker did the work

        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port_b}", timeout=30) as http:
            plain = await http.post("/v1/chat/completions", headers={
                "Authorization": f"Bearer {secret}"}, json={**body, "stream": False})
        assert plain.status_code == 200, plain.text
        assert plain.json()["choices"][0]["message"]["content"] == "".join(echo_words(body))

        settled = await settled_jobs(shared_db)
        assert len(settled) == 2  # each answer billed once, by the replica that held its client
        assert any(completion_id in job for job in settled)
        check = replica_cli(tmp_path, shared_db, "ledger", "check")
        assert check.returncode == 0, check.stdout + check.stderr
    finally:
        if worker is not None:
            await worker.stop()
        for queen in queens.values():
            queen.stop()


async def test_a_stream_relayed_from_a_killed_replica_continues_on_a_twin_elsewhere(
        tmp_path, redis_server, shared_db):  # noqa: F811
    ports, queens = await start_replicas(tmp_path, shared_db, redis_server.url, auth="open")
    workers: list[ScriptedWorker] = []
    try:
        # A's worker streams three tokens, then waits (``die_mid`` waits for ``release``).
        dying = await ScriptedWorker(f"ws://127.0.0.1:{ports['a']}/worker", continues=True,
                                     behaviour="die_mid", die_after=3).start()
        workers.append(dying)
        await until(lambda: swarm_workers(ports["b"]) == 1, 20, "b to see a's worker")
        body = {"model": ECHO_MODEL, "stream": True, "messages": [
            {"role": "user", "content": "alpha beta gamma delta epsilon zeta eta theta"}]}
        asking = asyncio.create_task(stream_text(ports["b"], "open", body))
        async with asyncio.timeout(20):
            await dying.job_arrived.wait()
        # Only now does C get a twin (same file, can continue): B's request was A's.
        twin = await ScriptedWorker(f"ws://127.0.0.1:{ports['c']}/worker",
                                    continues=True).start()
        workers.append(twin)
        await until(lambda: swarm_workers(ports["b"]) == 2, 20, "b to see c's twin")
        queens["a"].stop(kill=True)  # SIGKILL: no goodbye on the bus, the socket just dies
        killed_at = time.monotonic()
        status, content, _ = await asyncio.wait_for(asking, 30)
        assert status == 200, content
        assert content == "".join(echo_words(body))  # whole, the twin's part included
        assert time.monotonic() - killed_at < 10
        assert len(twin.jobs) == 1
        assert twin.jobs[0].continuation  # it continued the text, it did not start again
    finally:
        for worker in workers:
            await worker.stop()
        for queen in queens.values():
            queen.stop()
