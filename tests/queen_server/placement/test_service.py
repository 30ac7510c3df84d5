"""``PlacementService`` driven directly (see ``harness.py``): one placement per model, what it
sends, waits and estimates, and what moves it to another worker. No HTTP, no sleeping: every
wait is on an event with a timeout."""

from __future__ import annotations

import asyncio

import pytest

from queen_server.errors import (
    ModelLoading,
    WorkerFailed,
)
from shared_schema import (
    DownloadProgress,
    Fetch,
    FetchFailed,
)
from shared_schema.fitting import MB
from tests.queen_server.placement.harness import (
    BIG,
    GB,
    MODEL,
    WAIT,
    Settings,
    Swarm,
    settle,
)

# --- one placement, one download ---------------------------------------------------------


async def test_two_concurrent_requests_share_one_placement(swarm: Swarm):
    swarm.add("a")
    swarm.add("b")
    first = asyncio.create_task(swarm.service.prepare(MODEL))
    second = asyncio.create_task(swarm.service.prepare(MODEL))
    name, _fetch = await swarm.next_frame()
    await settle(first)
    await settle(second)
    assert swarm.no_frame()  # one fetch, to one worker
    assert not first.done()
    assert not second.done()
    assert swarm.service.book.rows()[0].queued == 2
    swarm.holds(swarm.workers[name], MODEL)
    await asyncio.wait_for(asyncio.gather(first, second), WAIT)
    assert len(swarm.all_fetches()) == 1
    assert swarm.reader.listings == 1  # one resolution
    assert swarm.service.loading == {}
    assert swarm.service.book.rows() == []  # none waits now (``started`` counts them next)


async def test_the_fetch_names_the_pinned_commit_paths_and_sha256(swarm: Swarm):
    swarm.add("a")
    task = asyncio.create_task(swarm.service.prepare(MODEL))
    name, fetch = await swarm.next_frame()
    assert isinstance(fetch, Fetch)
    repo = "org/small-GGUF"
    assert fetch.name == MODEL
    assert fetch.repo_id == repo
    assert fetch.revision == swarm.reader.commit(repo)
    assert fetch.paths == ["model-Q4_K_M.gguf"]
    assert fetch.sha256 == swarm.reader.sha256(repo, "model-Q4_K_M.gguf")
    assert fetch.size_bytes == 100 * MB
    assert swarm.service.pinned(MODEL) == {fetch.sha256, None}  # or a worker naming none
    swarm.holds(swarm.workers[name], MODEL)
    await asyncio.wait_for(task, WAIT)


async def test_a_worker_holding_another_file_does_not_end_the_wait(swarm: Swarm):
    worker = swarm.add("a")
    task = asyncio.create_task(swarm.service.prepare(MODEL))
    await swarm.next_frame()
    swarm.holds(worker, MODEL, sha256="f" * 64)  # the name, but not the pinned file
    await settle(task)
    assert not task.done()
    swarm.holds(worker, MODEL)
    await asyncio.wait_for(task, WAIT)


async def test_a_model_that_will_take_too_long_answers_model_loading(swarm: Swarm):
    swarm.add("a")
    with pytest.raises(ModelLoading) as caught:
        await swarm.service.prepare(BIG)
    error = caught.value
    assert (error.status_code, error.code) == (503, "model_loading")
    # 4 GB at the assumed 20 MB/s, then loading: about 211 s.
    estimate = error.extra["estimated_time"]
    assert isinstance(estimate, float)
    assert 205 < estimate < 215
    assert error.headers["Retry-After"] == str(round(estimate))
    assert "ready in about" in error.message
    assert len(swarm.all_fetches()) == 1  # the fetch went out all the same
    assert swarm.service.book.rows()[0].unmet_per_min > 0
    # Asking again joins the placement: no second fetch.
    with pytest.raises(ModelLoading):
        await swarm.service.prepare(BIG)
    assert len(swarm.all_fetches()) == 1


async def test_the_estimate_falls_with_reported_progress(swarm: Swarm):
    worker = swarm.add("a")
    with pytest.raises(ModelLoading):
        await swarm.service.prepare(BIG)
    loading = swarm.service.loading[BIG]
    before = swarm.service.estimate_s(loading)
    swarm.report(worker, downloads=[DownloadProgress(
        name=BIG, downloaded_bytes=2 * GB, total_bytes=4 * GB, bytes_per_s=200 * MB)])
    after = swarm.service.estimate_s(loading)
    assert after == pytest.approx(2048 / 200 + 4 + 2, abs=0.1)
    assert after < before
    rows = swarm.service.placements()
    assert rows[0]["downloaded_bytes"] == 2 * GB
    assert rows[0]["progress"] == 0.5
    # Now it will be ready within model_wait_s: the next request waits for it.
    task = asyncio.create_task(swarm.service.prepare(BIG))
    await settle(task)
    assert not task.done()
    swarm.holds(worker, BIG)
    await asyncio.wait_for(task, WAIT)


async def test_a_request_that_waits_in_vain_gets_model_loading(header: bytes):
    swarm = Swarm(header, Settings(model_wait_s=0.05, assumed_download_mb_s=1000))
    swarm.add("a")
    with pytest.raises(ModelLoading):  # the estimate (2 s) is past 0.05 s: no wait at all
        await swarm.service.prepare(MODEL)


# --- failures, departures and stalls -----------------------------------------------------


async def test_a_failed_fetch_moves_to_the_next_worker_then_gives_up(header: bytes):
    swarm = Swarm(header, Settings(max_fetch_attempts=2))
    for name in ("a", "b", "c"):
        swarm.add(name)
    task = asyncio.create_task(swarm.service.prepare(MODEL))
    first, _ = await swarm.next_frame()
    swarm.service.fetch_failed(swarm.workers[first], FetchFailed(
        name=MODEL, code="disk_full", message="no room"))
    second, fetch = await swarm.next_frame()
    assert second != first
    assert fetch.name == MODEL
    assert not task.done()
    swarm.service.fetch_failed(swarm.workers[second], FetchFailed(
        name=MODEL, code="sha256_mismatch", message="not the file named"))
    with pytest.raises(WorkerFailed) as caught:
        await asyncio.wait_for(task, WAIT)
    assert caught.value.code == "fetch_failed"
    assert "disk_full" in caught.value.message
    assert "sha256_mismatch" in caught.value.message
    assert len(swarm.all_fetches()) == 2  # the third worker was never asked
    assert MODEL not in swarm.service.loading


async def test_a_worker_that_left_is_replaced(swarm: Swarm):
    swarm.add("a")
    swarm.add("b")
    task = asyncio.create_task(swarm.service.prepare(MODEL))
    first, _ = await swarm.next_frame()
    worker = swarm.workers[first]
    swarm.service.left(worker)  # as http.worker_ws does: placement first, then the registry
    swarm.registry.remove(worker, "gone")
    second, _ = await swarm.next_frame()
    assert second != first
    swarm.holds(swarm.workers[second], MODEL)
    await asyncio.wait_for(task, WAIT)


async def test_a_fetch_that_cannot_be_sent_goes_to_the_next_worker(swarm: Swarm):
    swarm.add("broken", broken=True, room_mb=900_000)  # the most room: asked first
    swarm.add("b")
    task = asyncio.create_task(swarm.service.prepare(MODEL))
    name, _ = await swarm.next_frame()
    assert name == "b"
    await settle(task)
    assert not task.done()  # it waits for b (before the fix: 503 no_worker_fits at once, and
    # b fetched for a placement the queen had already forgotten)
    assert set(swarm.service.loading[MODEL].asked) == {swarm.workers["b"].key}
    assert "sending the fetch failed" in swarm.service.loading[MODEL].failed[
        swarm.workers["broken"].key]
    swarm.holds(swarm.workers["b"], MODEL)
    await asyncio.wait_for(task, WAIT)
    assert swarm.service.loading == {}


async def test_a_fetch_no_worker_can_be_sent_fails_the_request(swarm: Swarm):
    swarm.add("broken", broken=True)
    swarm.add("also-broken", broken=True)
    with pytest.raises(WorkerFailed) as caught:
        await swarm.service.prepare(MODEL)
    assert caught.value.code == "fetch_failed"
    assert "2 tried" in caught.value.message
    assert swarm.service.loading == {}


async def test_a_stalled_fetch_is_moved_after_fetch_stall_s(swarm: Swarm):
    swarm.add("a")
    swarm.add("b")
    with pytest.raises(ModelLoading):
        await swarm.service.prepare(BIG)
    first, _ = await swarm.next_frame()
    worker = swarm.workers[first]
    swarm.clock.now += 100
    swarm.report(worker, downloads=[DownloadProgress(name=BIG, downloaded_bytes=1 * MB)])
    swarm.clock.now += 100  # 200 s since the fetch, 100 since its progress
    swarm.service.check_stalls()
    assert swarm.no_frame()
    swarm.report(worker, downloads=[DownloadProgress(name=BIG, downloaded_bytes=1 * MB)])
    swarm.clock.now += 21  # the same bytes again are no progress: 121 s without any
    swarm.service.check_stalls()
    second, fetch = await swarm.next_frame()
    assert second != first
    assert fetch.name == BIG
    assert "stalled" in swarm.service.loading[BIG].failed[worker.key]
