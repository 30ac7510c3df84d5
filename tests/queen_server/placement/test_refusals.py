"""What ``PlacementService`` answers for a name it will not or cannot place: the hub's
refusals, the operator's lists and limits, no worker that fits."""

from __future__ import annotations

import asyncio

import pytest

from queen_server.errors import (
    ApiError,
    InvalidRequest,
    ModelForbidden,
    ModelLoading,
    ModelNotFound,
    ModelUnverified,
    NoCapacity,
    RateLimited,
)
from queen_server.placement import service as service_module
from queen_server.placement.service import refusal
from shared_schema.fitting import MB
from tests.queen_server.placement.harness import (
    BIG,
    MODEL,
    WAIT,
    Settings,
    Swarm,
)

# --- refusals ----------------------------------------------------------------------------


async def test_no_worker_fits(swarm: Swarm):
    swarm.add("a", room_mb=500, memory_mb=8000)
    swarm.add("b", room_mb=3000, memory_mb=2000)
    with pytest.raises(NoCapacity) as caught:
        await swarm.service.prepare(BIG)
    error = caught.value
    assert (error.status_code, error.code) == (503, "no_worker_fits")
    assert "4,096 MB of disk" in error.message
    assert "3,000 MB of room" in error.message
    assert "8,000 MB memory budget" in error.message
    assert "2 workers" in error.message
    assert swarm.all_fetches() == []
    assert swarm.service.loading == {}


async def test_a_flood_for_a_model_no_worker_fits_scans_the_swarm_once(
        swarm: Swarm, monkeypatch: pytest.MonkeyPatch):
    """A hostile client asking again and again for a model too big for every worker: each
    request gets the same 503, but the workers are scanned once per ``UNFIT_RECHECK_S``, not
    once per request (a scan grows with the swarm)."""
    scans = []
    real_choose = service_module.choose

    def counting(*args, **kwargs):
        scans.append(1)
        return real_choose(*args, **kwargs)

    monkeypatch.setattr(service_module, "choose", counting)
    swarm.add("a", room_mb=500, memory_mb=8000)
    messages = set()
    for _ in range(50):
        with pytest.raises(NoCapacity) as caught:
            await swarm.service.prepare(BIG)
        assert caught.value.code == "no_worker_fits"
        messages.add(caught.value.message)
    assert len(messages) == 1  # the same answer each time
    assert len(scans) == 1
    # A worker with room joins: once the recheck time has passed, the model is placed on it.
    swarm.add("b", room_mb=50_000, memory_mb=16_000)
    swarm.clock.now += service_module.UNFIT_RECHECK_S + 1
    with pytest.raises(ModelLoading):
        await swarm.service.prepare(BIG)
    assert [name for name, _fetch in swarm.all_fetches()] == ["b"]


async def test_no_taker_at_all_leaves_the_404_to_the_caller(swarm: Swarm):
    swarm.add("legacy", legacy=True)
    swarm.add("no-fetch", fetch=False)
    await swarm.service.prepare(MODEL)  # returns: nobody to place it on
    await swarm.service.prepare("not a hub name")
    assert swarm.reader.listings == 0
    assert swarm.all_fetches() == []


@pytest.mark.parametrize(("kind", "status", "code", "kind_of_error"), [
    ("not_found", 404, "model_not_found", ModelNotFound),
    ("gated", 403, "model_gated", ModelForbidden),
    ("ambiguous", 400, "model_ambiguous", InvalidRequest),
    ("no_match", 400, "model_file_not_found", InvalidRequest),
    ("unreachable", 503, "hub_unreachable", NoCapacity),
    ("unpinned", 400, "model_unusable", InvalidRequest),
    ("invalid", 400, "model_unusable", InvalidRequest),
])
def test_refusal_maps_each_kind(kind: str, status: int, code: str,
                                kind_of_error: type[ApiError]):
    candidates = ["a-Q4_K_M.gguf", "b-Q4_K_M.gguf"] if kind in ("ambiguous", "no_match") else None
    error = refusal("org/x:Q4_K_M", ModelUnverified("why", lasting=kind != "unreachable",
                                                    kind=kind, candidates=candidates))
    assert isinstance(error, kind_of_error)
    assert (error.status_code, error.code) == (status, code)
    assert "org/x:Q4_K_M" in error.message
    if candidates:
        assert error.extra["candidates"] == candidates
        assert "a-Q4_K_M.gguf, b-Q4_K_M.gguf" in error.message
    if kind == "unreachable":
        assert error.headers["Retry-After"] == "30"


def test_refusal_lists_at_most_twenty_candidates():
    many = [f"m-{i}-Q4_K_M.gguf" for i in range(45)]
    error = refusal("org/x:Q4_K_M", ModelUnverified("why", lasting=True, kind="ambiguous",
                                                    candidates=many))
    assert "(and 25 more)" in error.message
    assert "m-20-Q4_K_M.gguf" not in error.message
    assert error.extra["candidates"] == many  # the body keeps them all


async def test_hub_refusals_through_prepare(swarm: Swarm):
    swarm.add("a")
    swarm.reader.add("org/two-GGUF:Q4_K_M", 100 * MB, "other-Q4_K_M-v2.gguf")
    swarm.reader.errors["org/gated-GGUF"] = ModelUnverified(
        "gated", lasting=True, kind="gated")
    swarm.reader.errors["org/down-GGUF"] = ModelUnverified("cannot reach", lasting=False)
    cases = {
        "org/missing-GGUF:Q4_K_M": (404, "model_not_found"),
        "org/gated-GGUF:Q4_K_M": (403, "model_gated"),
        "org/two-GGUF:Q4_K_M": (400, "model_ambiguous"),
        "org/small-GGUF:Q8_0": (400, "model_file_not_found"),
        "org/down-GGUF:Q4_K_M": (503, "hub_unreachable"),
    }
    for name, (status, code) in cases.items():
        with pytest.raises(ApiError) as caught:
            await swarm.service.prepare(name)
        assert (caught.value.status_code, caught.value.code) == (status, code), name
    with pytest.raises(InvalidRequest) as caught:
        await swarm.service.prepare("org/two-GGUF:Q4_K_M")
    assert sorted(caught.value.extra["candidates"]) == [  # type: ignore[arg-type]
        "model-Q4_K_M.gguf", "other-Q4_K_M-v2.gguf"]
    assert swarm.all_fetches() == []


async def test_the_deny_list_gives_403_without_asking_the_hub(header: bytes):
    swarm = Swarm(header, Settings(model_deny=["ORG/*"], model_allow=["*"]))
    swarm.add("a")
    with pytest.raises(ModelForbidden) as caught:
        await swarm.service.prepare(MODEL)
    assert caught.value.status_code == 403
    assert "deny-list" in caught.value.message
    assert swarm.reader.listings == 0
    assert swarm.all_fetches() == []


async def test_the_allow_list_gives_403_to_others(header: bytes):
    swarm = Swarm(header, Settings(model_allow=["trusted/*"]))
    swarm.add("a")
    with pytest.raises(ModelForbidden) as caught:
        await swarm.service.prepare(MODEL)
    assert "allow-list" in caught.value.message


async def test_max_model_gb(header: bytes):
    swarm = Swarm(header, Settings(max_model_gb=1.0))
    swarm.add("a")
    with pytest.raises(InvalidRequest) as caught:
        await swarm.service.prepare(BIG)
    assert (caught.value.status_code, caught.value.code) == (400, "model_too_large")
    assert "4.3 GB" in caught.value.message
    assert "up to 1 GB" in caught.value.message
    assert swarm.all_fetches() == []
    # A smaller one still goes.
    task = asyncio.create_task(swarm.service.prepare(MODEL))
    name, _ = await swarm.next_frame()
    swarm.holds(swarm.workers[name], MODEL)
    await asyncio.wait_for(task, WAIT)


async def test_placements_per_hour_stops_a_client_naming_many_real_models(header: bytes):
    swarm = Swarm(header, Settings(placements_per_hour=3, model_wait_s=0))
    for i in range(5):
        swarm.add(f"w{i}")
    names = [f"org/model{i}-GGUF:Q4_K_M" for i in range(10)]
    for name in names:
        swarm.reader.add(name, 100 * MB)
    answers: list[ApiError] = []
    for name in names:
        with pytest.raises(ApiError) as caught:
            await swarm.service.prepare(name)
        answers.append(caught.value)
    assert [a.code for a in answers[:3]] == ["model_loading"] * 3
    for limited in answers[3:]:
        assert isinstance(limited, RateLimited)
        assert (limited.status_code, limited.code) == (429, "placement_limit")
        assert 3500 < int(limited.headers["Retry-After"]) <= 3601
    assert len(swarm.all_fetches()) == 3
    # An hour later it places again.
    swarm.clock.now += 3601
    with pytest.raises(ModelLoading):
        await swarm.service.prepare(names[5])
    assert len(swarm.all_fetches()) == 4


async def test_asking_again_for_a_placed_model_spends_no_placement(header: bytes):
    swarm = Swarm(header, Settings(placements_per_hour=1, model_wait_s=0))
    swarm.add("a")
    for _ in range(5):
        with pytest.raises(ModelLoading):
            await swarm.service.prepare(MODEL)
    assert len(swarm.all_fetches()) == 1
