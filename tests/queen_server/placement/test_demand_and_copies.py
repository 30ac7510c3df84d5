"""``PlacementService``'s demand to workers, its extra copies, and hostile or paused workers."""

from __future__ import annotations

import asyncio
import json

import pytest

from queen_server.errors import (
    ModelLoading,
    NoCapacity,
)
from queen_server.swarm.worker import Worker
from shared_schema import (
    Demand,
    Fetch,
    FetchFailed,
    ModelDescriptor,
)
from tests.queen_server.placement.harness import (
    BIG,
    GB,
    MODEL,
    WAIT,
    Settings,
    Swarm,
)

# --- demand ------------------------------------------------------------------------------


async def test_tell_demand_sends_one_frame_to_each_v1_worker(swarm: Swarm):
    v1 = [swarm.add("a"), swarm.add("b", fetch=False)]
    swarm.add("legacy", legacy=True)
    with pytest.raises(ModelLoading):
        await swarm.service.prepare(BIG)
    swarm.service.started(MODEL, 0.0)
    await swarm.service.tell_demand()
    for worker in v1:
        demands = [f for f in swarm.connections[worker.public_id].frames
                   if isinstance(f, Demand)]
        assert len(demands) == 1
    assert swarm.connections["legacy"].frames == []
    demand = swarm.service.demand
    rows = {row.name: row for row in demand.models}
    big = rows[BIG]
    assert big.unmet_per_min > 0
    assert big.loading == 1
    assert big.holders == 0
    facts = swarm.catalog.pin(BIG)
    assert facts is not None
    assert big.sha256 == facts.sha256
    assert big.revision == facts.commit
    assert big.size_bytes == 4 * GB
    assert big.memory_mb is not None
    assert big.memory_mb >= 4096
    assert big.earn_msat_per_1k_tokens == 7
    assert rows[MODEL].sha256 is None  # asked for, but never resolved: not pinned
    sent = swarm.connections["a"].frames[-1]
    assert json.loads(sent.model_dump_json()) == json.loads(demand.model_dump_json())


async def test_a_broken_socket_does_not_stop_the_demand(swarm: Swarm):
    swarm.add("broken", broken=True)
    swarm.add("b")
    await swarm.service.tell_demand()
    assert len(swarm.connections["b"].frames) == 1


async def placed(swarm: Swarm, model: str, holder: Worker) -> None:
    """``model`` resolved, pinned and held by ``holder``."""
    task = asyncio.create_task(swarm.service.prepare(model))
    name, _ = await swarm.next_frame()
    assert name == holder.public_id
    swarm.holds(holder, model)
    await asyncio.wait_for(task, WAIT)


async def test_add_copies_places_another_copy_only_under_unmet_demand(swarm: Swarm):
    first = swarm.add("first", room_mb=900_000)
    swarm.add("second")
    await placed(swarm, MODEL, first)
    # Demand met at once: no copy.
    swarm.service.started(MODEL, 0.0)
    await swarm.service.tell_demand()
    await swarm.service.add_copies()
    assert len(swarm.all_fetches()) == 1
    # Requests that waited for a busy holder: one more copy, on the other worker.
    swarm.service.started(MODEL, 3.0)
    await swarm.service.tell_demand()
    await swarm.service.add_copies()
    name, fetch = await swarm.next_frame()
    assert name == "second"
    assert isinstance(fetch, Fetch)
    assert fetch.name == MODEL
    # While that copy loads, no third one.
    await swarm.service.tell_demand()
    await swarm.service.add_copies()
    assert len(swarm.all_fetches()) == 2
    swarm.holds(swarm.workers["second"], MODEL)
    assert MODEL not in swarm.service.loading


async def test_add_copies_stops_at_max_copies_per_model(header: bytes):
    swarm = Swarm(header, Settings(max_copies_per_model=1))
    first = swarm.add("first", room_mb=900_000)
    swarm.add("second")
    await placed(swarm, MODEL, first)
    swarm.service.started(MODEL, 10.0)
    await swarm.service.tell_demand()
    await swarm.service.add_copies()
    assert len(swarm.all_fetches()) == 1


async def test_add_copies_does_nothing_when_placement_is_off(header: bytes):
    swarm = Swarm(header)
    first = swarm.add("first", room_mb=900_000)
    swarm.add("second")
    await placed(swarm, MODEL, first)
    swarm.settings.on_demand = False
    swarm.service.started(MODEL, 10.0)
    await swarm.service.tell_demand()
    await swarm.service.add_copies()
    assert len(swarm.all_fetches()) == 1


# --- hostile and paused workers ----------------------------------------------------------


async def test_a_fetch_failed_for_a_model_never_asked_for_changes_nothing(swarm: Swarm):
    swarm.add("a")
    hostile = swarm.add("hostile")
    with pytest.raises(ModelLoading):
        await swarm.service.prepare(BIG)
    name, _ = await swarm.next_frame()
    other = "a" if name == "hostile" else "hostile"
    loading = swarm.service.loading[BIG]
    before = (dict(loading.asked), dict(loading.failed))
    liar = swarm.workers[other]
    swarm.service.fetch_failed(liar, FetchFailed(name=BIG, code="disk_full"))
    swarm.service.fetch_failed(hostile, FetchFailed(name="org/never-GGUF:Q4", code="memory"))
    swarm.service.fetch_failed(hostile, FetchFailed(name=MODEL, code="memory"))
    assert (dict(loading.asked), dict(loading.failed)) == before
    assert swarm.service.loading == {BIG: loading}
    await asyncio.sleep(0)  # a retry, had one been spawned, would have sent by now
    assert swarm.no_frame()


async def test_a_paused_worker_leaves_routing_and_comes_back(swarm: Swarm):
    worker = swarm.add("a", models=[ModelDescriptor(name=MODEL, loaded=True)])
    assert swarm.registry.candidates(MODEL) == [worker]
    assert worker in swarm.registry.takers()
    swarm.report(worker, paused="on battery")
    assert worker.paused == "on battery"
    assert swarm.registry.candidates(MODEL) == []
    assert worker not in swarm.registry.takers()
    await swarm.service.prepare(BIG)  # no taker left: the caller's 404, no fetch
    assert swarm.all_fetches() == []
    swarm.report(worker, paused="the GPU is in use")  # another reason: still out
    assert swarm.registry.candidates(MODEL) == []
    swarm.report(worker)
    assert worker.paused is None
    assert swarm.registry.candidates(MODEL) == [worker]
    assert worker in swarm.registry.takers()


async def test_placements_report(swarm: Swarm):
    swarm.add("a")
    with pytest.raises(ModelLoading):
        await swarm.service.prepare(BIG)
    swarm.clock.now += 12
    (row,) = swarm.service.placements()
    assert row["model"] == BIG
    assert row["worker"] == "a"
    assert row["size_bytes"] == 4 * GB
    assert row["downloaded_bytes"] == 0
    assert row["since_s"] == 12.0
    assert row["failed"] == {}


async def test_a_placement_no_worker_takes_spends_no_placement(header: bytes):
    """Names too big for every worker must not use up the hour's placements."""
    swarm = Swarm(header, Settings(placements_per_hour=2, model_wait_s=0))
    swarm.add("a", room_mb=1000)
    for _ in range(5):
        with pytest.raises(NoCapacity) as caught:
            await swarm.service.prepare(BIG)
        assert caught.value.code == "no_worker_fits"
    with pytest.raises(ModelLoading):
        await swarm.service.prepare(MODEL)
    assert len(swarm.all_fetches()) == 1
