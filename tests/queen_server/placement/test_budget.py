"""Placements per caller (issue 34): ``HourlyBudget`` on its own, then ``PlacementService``
charging each caller for what its requests make the queen do (a hub read, a fetch), failed and
refused resolutions included, and nothing for what the queen already knows."""

from __future__ import annotations

import asyncio

import pytest

from queen_server.errors import ApiError, ModelLoading, ModelNotFound, NoCapacity, RateLimited
from queen_server.placement.budget import HourlyBudget
from shared_schema.fitting import MB
from tests.queen_server.placement.harness import BIG, MODEL, WAIT, Settings, Swarm

# --- the budget ------------------------------------------------------------------------------


def test_a_key_may_start_its_limit_in_any_hour():
    budget = HourlyBudget()
    for minute in range(3):
        assert budget.wait_s("a", 3, minute * 60.0) is None
        budget.spend("a", minute * 60.0)
    assert budget.wait_s("a", 3, 180.0) == pytest.approx(3600 - 180)
    assert budget.wait_s("b", 3, 180.0) is None  # per key
    assert budget.wait_s("a", 3, 3600.0) is None  # the first start left the window
    assert budget.used("a", 3600.0) == 2
    assert budget.wait_s("a", 5, 180.0) is None  # the limit is the caller's to give


def test_a_refund_takes_back_one_start():
    budget = HourlyBudget()
    at = budget.spend("a", 10.0)
    budget.spend("a", 20.0)
    budget.refund("a", at)
    assert budget.used("a", 30.0) == 1
    budget.refund("a", 20.0)
    budget.refund("a", 20.0)  # twice: nothing more
    budget.refund("nobody", 1.0)
    assert len(budget) == 0


def test_memory_is_bounded_by_the_keys_kept_and_the_window():
    budget = HourlyBudget(max_keys=100)
    for i in range(1000):  # a flood from a thousand addresses
        budget.spend(f"addr:{i}", 0.0)
    assert len(budget) == 100
    assert budget.used("addr:999", 1.0) == 1  # the most recent are kept
    assert budget.used("addr:0", 1.0) == 0
    assert budget.used("addr:999", 3600.0) == 0  # and every start leaves after an hour
    assert len(budget) == 99


# --- what a caller is charged for ------------------------------------------------------------


async def test_each_new_placement_a_caller_starts_counts_whatever_comes_of_it(header: bytes):
    swarm = Swarm(header, Settings(placements_per_key_per_hour=4, model_wait_s=0))
    swarm.add("a", room_mb=500, memory_mb=8000)  # too small for BIG
    outcomes: list[str] = []
    for name in [MODEL, "org/missing-GGUF:Q4_K_M", BIG, "org/other-missing-GGUF:Q4_K_M",
                 "org/third-missing-GGUF:Q4_K_M"]:
        with pytest.raises(ApiError) as caught:
            await swarm.service.prepare(name, "key:1")
        outcomes.append(caught.value.code or "")
    # A fetch sent, a name the hub lacks, a model no worker fits, another name the hub lacks:
    # four starts; the fifth is refused before the hub is read.
    assert outcomes == ["model_loading", "model_not_found", "no_worker_fits", "model_not_found",
                        "placement_limit_per_key"]
    assert swarm.reader.listings == 4
    assert swarm.service.limits.callers.used("key:1", swarm.clock()) == 4
    # Another caller is not limited by it.
    with pytest.raises(ModelNotFound):
        await swarm.service.prepare("org/third-missing-GGUF:Q4_K_M", "key:2")
    assert swarm.reader.listings == 5


async def test_what_the_queen_already_knows_costs_the_caller_nothing(header: bytes):
    swarm = Swarm(header, Settings(placements_per_key_per_hour=1, model_wait_s=0,
                                   model_deny=["denied/*"]))
    swarm.add("a", room_mb=500, memory_mb=8000)
    with pytest.raises(ModelNotFound):  # the one start: the hub says it lacks the name
        await swarm.service.prepare("org/missing-GGUF:Q4_K_M", "key:1")
    with pytest.raises(RateLimited):
        await swarm.service.prepare("org/missing-too-GGUF:Q4_K_M", "key:1")
    for _ in range(20):  # asked again and again: the same 404 from the negative cache
        with pytest.raises(ModelNotFound):
            await swarm.service.prepare("org/missing-GGUF:Q4_K_M", "key:1")
    with pytest.raises(ApiError) as caught:  # the operator's deny-list: never counted
        await swarm.service.prepare("denied/x-GGUF:Q4_K_M", "key:1")
    assert caught.value.status_code == 403
    assert swarm.reader.listings == 1
    # No worker fits BIG: known for a moment after another caller found out.
    with pytest.raises(NoCapacity):
        await swarm.service.prepare(BIG, "key:2")
    with pytest.raises(NoCapacity) as unfit:
        await swarm.service.prepare(BIG, "key:1")
    assert unfit.value.code == "no_worker_fits"
    assert swarm.service.limits.callers.used("key:1", swarm.clock()) == 1


async def test_a_negative_answer_is_read_again_once_it_expires(header: bytes):
    """A flood of made-up names costs one hub request per name per window: after the window
    the name is read again (a repo may have been made since)."""
    swarm = Swarm(header, Settings(model_wait_s=0))
    swarm.catalog.clock = swarm.clock
    swarm.add("a")
    name = "org/later-GGUF:Q4_K_M"
    for _ in range(5):
        with pytest.raises(ModelNotFound):
            await swarm.service.prepare(name)
    assert swarm.reader.listings == 1
    swarm.reader.add(name, 100 * MB)  # the repo appears
    swarm.clock.now += swarm.catalog.ttl_s + 1
    task = asyncio.create_task(swarm.service.prepare(name))
    await swarm.next_frame()
    with pytest.raises(ModelLoading):
        await asyncio.wait_for(task, WAIT)
    assert swarm.reader.listings == 2


async def test_joining_a_placement_under_way_is_free(header: bytes):
    swarm = Swarm(header, Settings(placements_per_key_per_hour=1, model_wait_s=20))
    swarm.add("a")
    first = asyncio.create_task(swarm.service.prepare(MODEL, "key:1"))
    name, _fetch = await swarm.next_frame()
    joiners = [asyncio.create_task(swarm.service.prepare(MODEL, "key:1")) for _ in range(5)]
    swarm.holds(swarm.workers[name], MODEL)
    await asyncio.wait_for(asyncio.gather(first, *joiners), WAIT)
    assert swarm.service.limits.callers.used("key:1", swarm.clock()) == 1
    assert len(swarm.all_fetches()) == 1
