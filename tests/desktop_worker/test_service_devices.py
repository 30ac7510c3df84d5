"""What a worker tells the queen of its devices for model groups (issue 19): ``device_free_mb``
in its hello and every status when it joins groups, nothing otherwise; by the same rule its
head offloads to and its member serves (``rpc.group_devices``). An ``RpcSupport`` that lists
made-up devices stands in for a GPU machine's llama.cpp."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from desktop_worker.groups.rpc import NullRpc, RpcSupport
from desktop_worker.service import WorkerService
from desktop_worker.settings import WorkerSettings
from shared_schema import Hello
from shared_schema.groups import MAX_MEMBER_DEVICES
from shared_schema.hardware import MAX_VRAM_MB
from tests.desktop_worker.groups.device_fakes import (
    CPU,
    GPU0,
    NO_GPU,
    REMOTE,
    TWO_GPUS,
    DevicesRpc,
    device,
)
from tests.support.hardware_fixtures import fixture_path, recorded_machine

BUDGET = 12_000  # the owner's memory budget: the pool's, and so the CPU device's

Make = Callable[..., WorkerService]


@pytest.fixture
async def make(tmp_path: Path) -> AsyncIterator[Make]:
    made: list[WorkerService] = []

    def service(rpc: RpcSupport, **settings: Any) -> WorkerService:
        config = WorkerSettings(models_dir=tmp_path / "models", key_path=tmp_path / "key.pem",
                                key_store="file", queen_url="ws://127.0.0.1:9/worker",
                                memory_budget_mb=BUDGET, **settings)
        made.append(WorkerService(config, rpc=rpc, detector=lambda models_dir: recorded_machine(
            fixture_path("gaming_rtx3060"), models_dir)))
        return made[-1]

    yield service
    for one in made:
        await one.pool.close()


async def hello_of(service: WorkerService) -> Hello:
    hello_for, _ = await service.hello_factory()
    return hello_for("nonce", "http://127.0.0.1:9")


async def test_a_two_gpu_worker_names_both_in_its_hello_and_statuses(make: Make) -> None:
    rpc = DevicesRpc(TWO_GPUS)
    service = make(rpc)
    assert (await hello_of(service)).device_free_mb == [7_900, 23_500]
    rpc.listing = [CPU, device("CUDA0", GPU0.type, 6_000), device("CUDA1", GPU0.type, 1_000)]
    assert (await service.status()).device_free_mb == [6_000, 1_000]  # fresh each time
    # by the same rule, its head offloads to both and its member serves its GPUs
    assert service._head_gpus() == 2
    assert service.groups.gpus() is True


async def test_the_owners_vram_cap_bounds_what_the_queen_is_told_of_the_gpus(make: Make) -> None:
    """An owner who lets the worker use 10 GB of GPU memory: the queen is never told more, so a
    group's share (which a member's gate enforces) stays within it."""
    service = make(DevicesRpc(TWO_GPUS), vram_cap_mb=10_000)
    assert (await hello_of(service)).device_free_mb == [7_900, 2_100]
    assert (await service.status()).device_free_mb == [7_900, 2_100]


async def test_gpu_layers_0_gives_the_cpu_at_the_budget_everywhere(make: Make) -> None:
    """The owner keeps layers off the GPU: the queen plans one device (its budget), the head
    keeps its layers on its CPU and the member serves its CPU."""
    service = make(DevicesRpc(TWO_GPUS), gpu_layers=0)
    assert (await hello_of(service)).device_free_mb == [BUDGET]
    assert (await service.status()).device_free_mb == [BUDGET]
    assert service._head_gpus() == 0
    assert service.groups.gpus() is False


async def test_a_worker_without_a_gpu_gives_its_budget_and_never_an_rpc_device(
        make: Make) -> None:
    service = make(DevicesRpc([REMOTE, *NO_GPU]))
    assert (await hello_of(service)).device_free_mb == [BUDGET]
    assert service._head_gpus() == 0


@pytest.mark.parametrize(("rpc", "settings"), [
    (DevicesRpc(TWO_GPUS), {"join_groups": False}),  # its owner does not let it join
    (NullRpc(), {}),  # llama.cpp without the RPC backend
])
async def test_a_worker_that_joins_no_group_names_no_device(make: Make, rpc: RpcSupport,
                                                            settings: dict[str, Any]) -> None:
    service = make(rpc, **settings)
    assert (await hello_of(service)).device_free_mb is None
    assert (await service.status()).device_free_mb is None
    if isinstance(rpc, DevicesRpc):
        assert rpc.listed == 0  # the GPU driver is not even asked


async def test_devices_that_cannot_be_listed_are_sent_as_none_and_logged_once(
        make: Make, caplog: pytest.LogCaptureFixture) -> None:
    service = make(DevicesRpc(TWO_GPUS, broken=True))
    with caplog.at_level(logging.WARNING, logger="desktop_worker.service"):
        hello = await hello_of(service)
        statuses = [await service.status() for _ in range(2)]
    assert hello.device_free_mb is None
    assert [s.device_free_mb for s in statuses] == [None, None]
    assert len([r for r in caplog.records if "devices could not be listed" in r.message]) == 1


async def test_a_machine_beyond_the_wires_bounds_still_says_hello(make: Make) -> None:
    """More GPUs than a group uses, or an absurd free figure: cut to the bounds, never a
    hello the queen refuses."""
    many = [CPU, *(device(f"CUDA{i}", GPU0.type, 1_000 + i) for i in range(20))]
    service = make(DevicesRpc([*many, device("CUDA99", GPU0.type, MAX_VRAM_MB * 2)]))
    figure = (await hello_of(service)).device_free_mb
    assert figure == [1_000 + i for i in range(MAX_MEMBER_DEVICES)]
    huge = make(DevicesRpc([CPU, device("CUDA0", GPU0.type, MAX_VRAM_MB * 2)]))
    assert (await hello_of(huge)).device_free_mb == [MAX_VRAM_MB]


async def test_automatic_jobs_at_once_tell_the_queen_what_the_loaded_batch_holds(
        tmp_path: Path) -> None:
    """Issue 36: with Jobs at once on automatic, the status says the slots memory gave the
    loaded model's batch, not the automatic most; an owner's own number is said as it is."""
    from tests.support.on_demand import REAL

    async def loaded(**settings: Any) -> WorkerService:
        config = WorkerSettings(models_dir=tmp_path / "models", key_path=tmp_path / "key.pem",
                                key_store="file", queen_url="ws://127.0.0.1:9/worker",
                                memory_budget_mb=300, n_ctx=2048, **settings)
        service = WorkerService(config, rpc=NullRpc(), detector=lambda models_dir:
                                recorded_machine(fixture_path("gaming_rtx3060"), models_dir))
        if "smol" not in {model.name for model in service.store.list()}:
            service.store.import_file(REAL, "smol")
        return service

    automatic = await loaded()
    try:
        assert (await automatic.status()).max_jobs == 8  # nothing loaded yet: the most
        await automatic.pool.load("smol")
        slots = automatic.pool.slots("smol")
        assert 1 < slots < 8  # 300 MB: the file, its own cache and a few more
        assert (await automatic.status()).max_jobs == slots
    finally:
        await automatic.pool.close()
    owners = await loaded(max_jobs=5)
    try:
        await owners.pool.load("smol")
        assert (await owners.status()).max_jobs == 5
    finally:
        await owners.pool.close()


@pytest.mark.parametrize(("settings", "on_gpu"), [
    ({"train": True}, False),  # train_on_gpu is off by default
    ({"train": True, "train_on_gpu": True}, True),
    ({"train": True, "train_on_gpu": True, "gpu_layers": 0}, False),  # layers kept off the GPU
    ({"train": True, "train_on_gpu": True, "vram_cap_mb": 500}, False),  # no room under the cap
])
async def test_a_fine_tuning_run_goes_on_the_gpu_only_as_the_owner_allows(
        make: Make, settings: dict[str, Any], on_gpu: bool) -> None:
    """The RTX 3060 machine (about 11 GB free): SmolLM2-135M's run needs about 1.8 GB there."""
    from desktop_worker.sandbox.policy import TrainLimits

    service = make(NullRpc(), **settings)
    await service.detect()
    assert service.runner.training is not None
    plan = service.runner.training.trainer.plan(TrainLimits.of(134_515_008))
    assert plan.on_gpu is on_gpu


@pytest.mark.parametrize(("settings", "gpus"), [
    ({"images": True}, True),
    ({"images": True, "gpu_layers": 0}, False),  # the owner keeps models off the GPU
])
async def test_image_children_get_the_gpu_unless_the_owner_keeps_models_off_it(
        make: Make, settings: dict[str, Any], gpus: bool) -> None:
    service = make(NullRpc(), **settings)
    assert service.images is not None
    assert service.images.engine.gpus is gpus
