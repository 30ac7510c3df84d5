"""The one interface every GPU detector implements, and what a detector returns.

A detector never raises for a missing or broken driver: it returns a ``DetectorResult`` with no
devices and a ``reason`` saying why, and logs that reason. Units are binary: MB means MiB
(2**20 bytes), as ``nvidia-smi`` prints them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from shared_schema.hardware import ClGpu, NvGpu

MIB = 1 << 20
GIB = 1 << 30

# Device types a detector reports. The first two count as GPUs for the wire's ``cl_gpus``.
GPU_TYPES = frozenset({"gpu", "accelerator"})


@dataclass(frozen=True)
class ComputeDevice:
    """One device as a detector read it. NVML fills the NVIDIA-only fields; OpenCL the rest."""

    name: str
    device_type: str = "gpu"
    vendor: str | None = None
    memory_total_mb: int = 0
    memory_free_mb: int | None = None
    driver_version: str | None = None
    compute_capability: str | None = None
    utilization_pct: int | None = None
    uuid: str | None = None
    platform: str | None = None

    @property
    def is_gpu(self) -> bool:
        """True for GPUs and accelerators; False for CPU (and other) OpenCL devices."""
        return self.device_type in GPU_TYPES

    def to_nv_gpu(self) -> NvGpu:
        """This device as the wire's ``NvGpu``."""
        return NvGpu(
            name=self.name,
            memory=self.memory_total_mb,
            memory_free_mb=self.memory_free_mb,
            compute_capability=self.compute_capability,
            utilization_pct=self.utilization_pct,
            uuid=self.uuid,
        )

    def to_cl_gpu(self) -> ClGpu:
        """This device as the wire's ``ClGpu``."""
        return ClGpu(
            name=self.name,
            vendor=self.vendor,
            memory=self.memory_total_mb,
            driver_version=self.driver_version,
        )


@dataclass(frozen=True)
class DetectorResult:
    """What one detector found.

    ``devices`` holds every device read (OpenCL CPU devices included); ``gpus`` only the GPUs.
    ``reason`` says why nothing (or less than everything) was found, else it is None.
    """

    source: str
    devices: tuple[ComputeDevice, ...] = ()
    driver_version: str | None = None
    reason: str | None = None

    @property
    def gpus(self) -> tuple[ComputeDevice, ...]:
        """The devices that are GPUs or accelerators."""
        return tuple(device for device in self.devices if device.is_gpu)


@runtime_checkable
class GpuDetector(Protocol):
    """Anything that can list one kind of GPU. ``detect`` must be fast and must not raise."""

    source: str

    def detect(self) -> DetectorResult:
        """Read the devices now."""
        ...


class NullGpuDetector:
    """A detector that finds nothing: for a disabled probe, or a test that wants no GPUs."""

    def __init__(self, source: str = "none", reason: str = "detection disabled") -> None:
        self.source = source
        self.reason = reason

    def detect(self) -> DetectorResult:
        """Return an empty result carrying this detector's reason."""
        return DetectorResult(source=self.source, reason=self.reason)
