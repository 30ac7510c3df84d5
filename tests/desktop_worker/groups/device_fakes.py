"""Made-up ggml devices and an ``RpcSupport`` that lists them (issue 19): what a GPU worker's
llama.cpp would list, on a machine without a GPU and without loading llama.cpp."""

from __future__ import annotations

from collections.abc import Sequence

from desktop_worker.errors import GroupError
from desktop_worker.groups.rpc import Device, DeviceType, RpcProbe

MIB = 1024 * 1024
BUILD = "ggml-test+abc/rpc-7.0.0"


def device(name: str, kind: DeviceType, free_mb: float, handle: int = 0) -> Device:
    free = int(free_mb * MIB)
    return Device(handle=handle, name=name, description=f"a made-up {name}", type=kind,
                  free_bytes=free, total_bytes=free + 512 * MIB)


CPU = device("CPU", DeviceType.CPU, 60_000, handle=1)
GPU0 = device("CUDA0", DeviceType.GPU, 7_900.6, handle=2)  # reported in MiB, rounded down
GPU1 = device("CUDA1", DeviceType.GPU, 23_500, handle=3)
IGPU = device("Vulkan0", DeviceType.IGPU, 2_000, handle=4)
REMOTE = device("RPC[127.0.0.1:50052]", DeviceType.GPU, 48_000, handle=5)  # a server added

TWO_GPUS = (CPU, GPU0, GPU1)
NO_GPU = (CPU,)


class DevicesRpc:
    """A build with the RPC backend whose llama.cpp lists ``devices``; ``broken``: listing
    them raises ``GroupError`` (counted in ``listed`` all the same)."""

    def __init__(self, devices: Sequence[Device] = NO_GPU, *, broken: bool = False) -> None:
        self.listing = list(devices)
        self.broken = broken
        self.listed = 0

    def probe(self) -> RpcProbe:
        return RpcProbe(True, BUILD)

    def devices(self) -> list[Device]:
        self.listed += 1
        if self.broken:
            raise GroupError("llama.cpp's ggml functions are not reachable: a test said so")
        return list(self.listing)
