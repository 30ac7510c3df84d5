"""Stats through HTTP: a real queen, scripted workers, traffic from the SDK."""

from __future__ import annotations

import httpx
import pytest

from tests.support.queen import running_queen
from tests.support.workers import ECHO_MODEL, ScriptedWorker

USER = [{"role": "user", "content": "one two three"}]
ADMIN = {"Authorization": "Bearer admin-secret"}


async def traffic(queen, n: int = 3) -> None:
    client = queen.client()
    for _ in range(n):
        stream = await client.chat.completions.create(model=ECHO_MODEL, messages=USER,
                                                      stream=True)
        [chunk async for chunk in stream]


async def test_stats_totals_after_traffic(tmp_path):
    async with running_queen(tmp_path, admin_token="admin-secret") as queen:
        worker = await ScriptedWorker(queen.ws_url, max_jobs=2).start()
        try:
            await traffic(queen)
            async with httpx.AsyncClient(base_url=queen.base_url) as http:
                totals = (await http.get("/stats")).json()
                mine = (await http.get("/worker/stats", params={"key": worker.pubkey})).json()
                bad = await http.get("/worker/stats", params={"key": "nope"})
                unknown = await http.get("/worker/stats", params={"key": "cd" * 32})
                workers = await http.get("/admin/api/workers", headers=ADMIN)
                jobs = (await http.get("/admin/api/jobs", headers=ADMIN)).json()
                overview = (await http.get("/admin/api/overview", headers=ADMIN)).json()
                detail = (await http.get(f"/admin/api/workers/{worker.welcome.worker_id}",
                                         headers=ADMIN)).json()
                metrics = (await http.get("/metrics")).text
            assert totals["workers_online"] == 1
            assert totals["models"][0]["id"] == ECHO_MODEL
            assert totals["models"][0]["workers"] == 1
            assert totals["jobs_per_min"] == 3
            assert totals["tokens_per_s"] == pytest.approx(3 * 4 / 60)  # "echo:" and 3 words
            assert totals["ttft_p50_s"] is not None
            assert mine["jobs"] == 3
            assert mine["public_id"] == worker.welcome.worker_id
            assert mine["sec_per_token"] is not None
            assert bad.status_code == 400
            assert unknown.status_code == 404
            assert worker.pubkey not in workers.text  # never the full key
            assert workers.json()[0]["online"] is True
            assert [job["outcome"] for job in jobs] == ["ok", "ok", "ok"]
            assert sum(point["jobs"] for point in overview["series"]) == 3
            assert len(detail["recent_jobs"]) == 3
            assert 'apiary_tokens_total{direction="out"}' in metrics
            assert "apiary_workers_connected 1.0" in metrics
            assert 'route="/v1/chat/completions"' in metrics
            assert "apiary_time_to_first_token_seconds_count 3.0" in metrics
        finally:
            await worker.stop()


async def test_admin_json_needs_the_admin_token(tmp_path):
    async with running_queen(tmp_path, admin_token="admin-secret") as queen, \
            httpx.AsyncClient(base_url=queen.base_url) as http:
        assert (await http.get("/admin/api/workers")).status_code == 401
        assert (await http.get("/admin/api/workers",
                               headers={"Authorization": "Bearer wrong"})).status_code == 401
    async with running_queen(tmp_path) as queen, \
            httpx.AsyncClient(base_url=queen.base_url) as http:
        assert (await http.get("/admin/api/workers", headers=ADMIN)).status_code == 404


async def test_errors_are_counted_by_code(queen):
    async with httpx.AsyncClient(base_url=queen.base_url) as http:
        await http.post("/v1/chat/completions", json={"model": "nobody/has:this",
                                                     "messages": USER})
        metrics = (await http.get("/metrics")).text
    assert 'apiary_errors_total{code="model_not_found"} 1.0' in metrics
    assert 'status="404"' in metrics


async def test_stats_and_speeds_survive_a_restart(tmp_path):
    async with running_queen(tmp_path) as queen:
        worker = await ScriptedWorker(queen.ws_url).start()
        key = worker.pubkey
        await traffic(queen, 2)
        await worker.stop()
        await queen.wait_until(lambda: queen.state.stats.online == 0)
    async with running_queen(tmp_path) as queen:
        stats = queen.state.stats.workers[key]
        assert stats.jobs == 2
        assert stats.connected_at is None
        assert stats.uptime_s(queen.state.stats.clock()) > 0
        assert queen.state.stats.speeds_for("tiny")[key] > 0  # routing starts with the record
