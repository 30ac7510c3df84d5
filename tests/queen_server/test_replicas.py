"""Two queen replicas in one process, on a real redis-server (issue 18): what one reports
is the whole swarm's, and the replica that holds a worker keeps its record.

Replica A holds the only worker; B holds none. B's ``/stats``, ``/health``, ``/metrics`` and
admin pages count A's worker; a stream asked of B and served by A's worker is recorded by A
(its speed there, where routing reads it), never by B, and shows on B's pages through A.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

import httpx
import pytest

from queen_server.cluster.remote import job_channel
from shared_schema.cluster import ClusterOutcome, encode_cluster
from tests.support.queen import QueenHarness, running_queen
from tests.support.redis_server import RedisServer
from tests.support.workers import ECHO_MODEL, ScriptedWorker

pytestmark = pytest.mark.timeout(120)

ADMIN = {"Authorization": "Bearer admin-secret"}
USER = [{"role": "user", "content": "one two three"}]


@pytest.fixture
async def pair(tmp_path, redis_server: RedisServer) -> AsyncIterator[tuple[QueenHarness, ...]]:
    async with AsyncExitStack() as stack:
        queens = []
        for name in "ab":
            (tmp_path / name).mkdir()
            queens.append(await stack.enter_async_context(running_queen(
                tmp_path / name, admin_token="admin-secret", redis_url=redis_server.url,
                replica_id=name)))
        yield tuple(queens)


async def test_a_replica_reports_the_whole_swarm_and_the_owner_keeps_the_record(pair) -> None:
    a, b = pair
    worker = await ScriptedWorker(a.ws_url, max_jobs=2).start()
    try:
        await b.wait_until(lambda: b.state.replicas.swarm().get("workers") == 1, 10,
                           "b to see a's worker in the directory")
        stream = await b.client().chat.completions.create(model=ECHO_MODEL, messages=USER,
                                                          stream=True)
        text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream
                        if chunk.choices])
        assert text
        assert len(worker.jobs) == 1  # a's worker served b's client
        # With the client's cache scope, derived by b, which holds the client (issue 36).
        assert worker.jobs[0].cache_scope == b.state.scopes.of("addr:127.0.0.1")
        # A keeps the worker's record, speed included, from B's count of the job.
        await a.wait_until(lambda: a.state.stats.workers[worker.pubkey].jobs == 1, 10,
                           "a to record the job b relayed")
        record = a.state.stats.workers[worker.pubkey]
        assert record.sec_per_token() is not None
        assert worker.pubkey in a.state.stats.speeds_for("tiny")
        assert worker.pubkey not in b.state.stats.workers  # b writes nothing of a's worker

        async with httpx.AsyncClient(base_url=b.base_url, timeout=20) as http:
            totals = (await http.get("/stats")).json()
            health = (await http.get("/health")).json()
            workers = (await http.get("/admin/api/workers", headers=ADMIN)).json()
            jobs = (await http.get("/admin/api/jobs", headers=ADMIN)).json()
            detail = await http.get(f"/admin/api/workers/{worker.welcome.worker_id}",
                                    headers=ADMIN)
            mine = await http.get("/worker/stats", params={"key": worker.pubkey})
            models = (await http.get("/admin/api/models", headers=ADMIN)).json()
            overview = (await http.get("/admin/api/overview", headers=ADMIN)).json()
            metrics = (await http.get("/metrics")).text
        assert totals["workers_online"] == 1
        assert totals["replicas"] == 2
        assert [(m["id"], m["workers"]) for m in totals["models"]] == [(ECHO_MODEL, 1)]
        assert totals["jobs_per_min"] == 1  # counted once, by a
        assert totals["ttft_p50_s"] is not None
        assert health["workers"] == 0
        assert health["swarm"]["workers"] == 1
        assert health["swarm"]["replicas"] == 2
        assert [(row["public_id"], row["online"], row["jobs"]) for row in workers] == [
            (worker.welcome.worker_id, True, 1)]
        assert [job["outcome"] for job in jobs] == ["ok"]
        assert detail.status_code == 200, detail.text
        assert detail.json()["worker"]["online"] is True
        assert len(detail.json()["recent_jobs"]) == 1
        assert mine.status_code == 200, mine.text
        assert mine.json()["jobs"] == 1
        assert models[0]["workers"] == 1
        assert sum(point["jobs"] for point in overview["series"]) == 1
        assert overview["series"][-1]["workers"] == 1
        assert "apiary_swarm_workers_connected 1.0" in metrics
        assert "apiary_swarm_replicas 2.0" in metrics
        assert "apiary_workers_connected 0.0" in metrics  # this process's own

        # Hostile or stale outcomes on A's job channel: a replay of the job's outcome, and one
        # for a job A never served, change nothing (each served job is recorded once). A
        # probe job A did serve goes last on the same channel: once it is recorded, the two
        # before it were read.
        job_id = a.state.stats.recent[0].id
        a.state.replicas._remember("probe.1", worker.pubkey, worker.welcome.worker_id,
                                   ECHO_MODEL, 1)
        for message in (ClusterOutcome(job_id=job_id, completion_tokens=10**6, total_s=0.001),
                        ClusterOutcome(job_id="never-served.1", completion_tokens=5),
                        ClusterOutcome(job_id="probe.1", completion_tokens=3, total_s=1.0)):
            assert await b.state.replicas.bus.publish(job_channel("a"),
                                                      encode_cluster(message)) == 1
        await a.wait_until(lambda: a.state.stats.workers[worker.pubkey].jobs >= 2, 10,
                           "a to record the probe")
        assert a.state.stats.workers[worker.pubkey].jobs == 2
        assert [job.id for job in a.state.stats.recent] == ["probe.1", job_id]
    finally:
        await worker.stop()


async def test_a_lone_queen_reports_itself_with_no_replica_fields(tmp_path) -> None:
    async with running_queen(tmp_path) as queen, \
            httpx.AsyncClient(base_url=queen.base_url) as http:
        totals = (await http.get("/stats")).json()
        health = (await http.get("/health")).json()
        metrics = (await http.get("/metrics")).text
    assert "replicas" not in totals
    assert "swarm" not in health
    assert "apiary_swarm_replicas 1.0" in metrics
