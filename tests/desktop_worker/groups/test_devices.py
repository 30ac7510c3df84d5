"""Which devices a worker gives a model group, and their memory (issue 19): one rule
(``rpc.group_devices``) for what a member's RPC server serves, what a head offloads its own
layers to and what the queen is told (``device_free_mb``). Its GPUs (never an RPC device),
else its CPU; its CPU when the owner keeps layers off the GPU. Made-up devices: this machine
has no GPU."""

from __future__ import annotations

import pytest

from desktop_worker.errors import GroupError, SandboxError
from desktop_worker.groups import member as member_module
from desktop_worker.groups import rpc_backend
from desktop_worker.groups.rpc import Device, device_free_mb, group_devices
from desktop_worker.groups.rpc_backend import LlamaRpc
from shared_schema import GroupMemberReady
from tests.desktop_worker.groups.device_fakes import (
    CPU,
    GPU0,
    GPU1,
    IGPU,
    NO_GPU,
    REMOTE,
    TWO_GPUS,
)
from tests.desktop_worker.groups.roles_support import serve_frame
from tests.support.rpc import needs_rpc

BUDGET = 12_000


def test_two_gpus_give_their_free_memory_in_llama_cpps_order() -> None:
    assert group_devices(TWO_GPUS, gpus=True) == [GPU0, GPU1]
    assert device_free_mb(TWO_GPUS, BUDGET, gpus=True) == [7_900, 23_500]  # MiB, rounded down
    assert device_free_mb((CPU, GPU1, IGPU), BUDGET, gpus=True) == [23_500, 2_000]


def test_the_owners_vram_cap_is_shared_out_over_the_gpus_in_order() -> None:
    """A group's share of this worker's GPUs never passes the owner's cap: the queen plans with
    what it is told, and a member's gate enforces the queen's plan."""
    assert device_free_mb(TWO_GPUS, BUDGET, gpus=True, vram_cap_mb=10_000) == [7_900, 2_100]
    assert device_free_mb(TWO_GPUS, BUDGET, gpus=True, vram_cap_mb=5_000) == [5_000, 0]
    assert device_free_mb(TWO_GPUS, BUDGET, gpus=True, vram_cap_mb=99_000) == [7_900, 23_500]
    assert device_free_mb(NO_GPU, BUDGET, gpus=True, vram_cap_mb=1_000) == [BUDGET]  # RAM


def test_an_owner_who_keeps_layers_off_the_gpu_gives_the_cpu_at_the_pools_budget() -> None:
    assert group_devices(TWO_GPUS, gpus=False) == [CPU]
    assert device_free_mb(TWO_GPUS, BUDGET, gpus=False) == [BUDGET]


def test_a_worker_without_a_gpu_gives_its_cpu_at_the_pools_budget() -> None:
    assert device_free_mb(NO_GPU, BUDGET, gpus=True) == [BUDGET]
    assert device_free_mb(NO_GPU, BUDGET, gpus=False) == [BUDGET]
    assert device_free_mb((), BUDGET, gpus=True) == []  # llama.cpp lists nothing usable


def test_an_rpc_device_is_never_given() -> None:
    """A server this process added (a head's member) is not this worker's to give."""
    assert device_free_mb((CPU, REMOTE, GPU0), BUDGET, gpus=True) == [7_900]
    assert device_free_mb((CPU, REMOTE), BUDGET, gpus=True) == [BUDGET]
    assert REMOTE not in group_devices((REMOTE, CPU, GPU0, GPU1), gpus=True)


class ListedRpc(LlamaRpc):
    """The real ``LlamaRpc`` rule over made-up devices; ``serve`` records what it was given."""

    served: list[list[Device]] = []

    def devices(self) -> list[Device]:
        return [CPU, REMOTE, GPU0, GPU1]

    def serve(self, endpoint: str, devices: list[Device], n_threads: int) -> None:
        ListedRpc.served.append(devices)


@pytest.mark.parametrize(("gpus", "count", "served"), [
    (True, None, [GPU0, GPU1]),
    (True, 1, [GPU0]),
    (False, 1, [CPU]),  # gpu_layers=0: the member's server serves its CPU, as its head would
])
def test_the_members_child_serves_what_the_rule_gives(monkeypatch, gpus: bool,
                                                      count: int | None,
                                                      served: list[Device]) -> None:
    monkeypatch.setattr(rpc_backend, "LlamaRpc", ListedRpc)
    monkeypatch.setenv("GGML_NO_BACKTRACE", "1")
    ListedRpc.served = []
    with pytest.raises(SystemExit):  # ``serve`` returned: the server "could not start"
        rpc_backend.serve_member("127.0.0.1:1", 1, count, gpus)
    assert ListedRpc.served == [served]


@pytest.mark.parametrize("gpus", [True, False])
async def test_the_member_server_hands_its_child_the_rule(monkeypatch, gpus: bool) -> None:
    """``MemberServer(gpus=)`` (what ``GroupRoles`` passes from the worker's rule) reaches
    the engine child that runs ``serve_member``, with its share as the memory limit."""
    made: list[tuple[object, ...]] = []

    def not_started(*args: object) -> None:
        made.append(args)
        raise SandboxError("not started in this test")

    monkeypatch.setattr(member_module, "start_member", not_started)
    server = member_module.MemberServer(devices=2, gpus=gpus, port=40_123, n_threads=3,
                                        memory_mb=700)
    with pytest.raises(GroupError, match="could not start"):
        await server.start()
    assert made == [(server.endpoint, 3, 2, gpus, 700)]


@needs_rpc
@pytest.mark.timeout(120)
async def test_a_members_roles_serve_by_the_workers_rule(sides) -> None:
    """``GroupRoles(gpus=)``: the worker's answer reaches its member's server (here the real
    one, which serves this machine's CPU either way)."""
    member = sides("member", gpus=lambda: False)
    member.send(serve_frame(layers=30))
    ready = await member.reports.next()
    assert isinstance(ready, GroupMemberReady), ready
    assert member.roles.part.server.gpus is False
