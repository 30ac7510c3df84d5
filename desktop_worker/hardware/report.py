"""The whole machine in one ``HardwareReport``, and the registration fields it fills.

``detect_hardware`` runs the detectors (the real ones unless others are given); it is fast
(no benchmarks, no long probes) and safe to call on every reconnect. ``changed`` tells whether
a new report differs enough from the last one to send the queen a ``status`` update.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from desktop_worker.errors import DetectionError
from desktop_worker.hardware.base import DetectorResult, GpuDetector
from desktop_worker.hardware.nvidia import NvmlDetector
from desktop_worker.hardware.opencl import OpenClDetector
from desktop_worker.hardware.system import PsutilSystemProbe, SystemInfo, SystemProbe
from shared_schema.hardware import ClGpu, NvGpu

logger = logging.getLogger(__name__)

VRAM_TOLERANCE_MB = 64
DISK_TOLERANCE_GB = 0

REGISTRATION_KEYS = (
    "cpu_count",
    "disk_space",
    "vram",
    "nv_gpu_count",
    "nv_driver_version",
    "nv_gpus",
    "cl_driver_version",
    "cl_gpus",
)


@dataclass(frozen=True)
class HardwareReport:
    """What ``detect_hardware`` found. MB is MiB, GB is GiB.

    ``nvidia`` and ``opencl`` keep every device read, with the reason when none was; OpenCL CPU
    devices are there but never in ``cl_gpus`` nor in ``vram``.
    """

    models_dir: Path
    system: SystemInfo
    nvidia: DetectorResult
    opencl: DetectorResult

    @property
    def cpu_count(self) -> int:
        return self.system.cpu_count

    @property
    def disk_space(self) -> int:
        """Free disk where the models live, GB (the wire's ``disk_space``)."""
        return self.system.disk_free_gb

    @property
    def total_ram_mb(self) -> int:
        return self.system.total_ram_mb

    @property
    def available_ram_mb(self) -> int:
        return self.system.available_ram_mb

    @property
    def nv_gpus(self) -> list[NvGpu]:
        return [device.to_nv_gpu() for device in self.nvidia.gpus]

    @property
    def cl_gpus(self) -> list[ClGpu]:
        """OpenCL GPUs and accelerators only (an NVIDIA card shows here as well as in NVML)."""
        return [device.to_cl_gpu() for device in self.opencl.gpus]

    @property
    def cl_driver_version(self) -> str | None:
        """The driver of the first OpenCL GPU that names one; None without an OpenCL GPU."""
        return next((d.driver_version for d in self.opencl.gpus if d.driver_version), None)

    @property
    def vram(self) -> int:
        """Total GPU memory, MB: the NVIDIA GPUs', or else the OpenCL GPUs'. Never system RAM."""
        gpus = self.nvidia.gpus or self.opencl.gpus
        return sum(device.memory_total_mb for device in gpus)

    @property
    def free_vram_mb(self) -> int | None:
        """Free memory summed over the NVIDIA GPUs; None without one, or if any cannot say."""
        free = [device.memory_free_mb for device in self.nvidia.gpus]
        if not free or any(value is None for value in free):
            return None
        return sum(value for value in free if value is not None)

    def registration_fields(self) -> dict[str, Any]:
        """The original registration fields, as wire types: ``Hello(**fields, ...)``."""
        return {
            "cpu_count": self.cpu_count,
            "disk_space": self.disk_space,
            "vram": self.vram,
            "nv_gpu_count": len(self.nvidia.gpus),
            "nv_driver_version": self.nvidia.driver_version,
            "nv_gpus": self.nv_gpus,
            "cl_driver_version": self.cl_driver_version,
            "cl_gpus": self.cl_gpus,
        }

    def status_fields(self) -> dict[str, int | None]:
        """The hardware fields of a ``status`` message: ``Status(**fields, ...)``."""
        return {"vram_free_mb": self.free_vram_mb, "disk_space": self.disk_space}

    def to_json_dict(self) -> dict[str, Any]:
        """Everything, JSON-ready, for printing (``apiary-worker hardware``, logs, bug reports)."""
        fields = self.registration_fields()
        fields["nv_gpus"] = [gpu.model_dump() for gpu in fields["nv_gpus"]]
        fields["cl_gpus"] = [gpu.model_dump() for gpu in fields["cl_gpus"]]
        return {
            "models_dir": str(self.models_dir),
            **asdict(self.system),
            "free_vram_mb": self.free_vram_mb,
            "registration": fields,
            "nvidia": _result_json(self.nvidia),
            "opencl": _result_json(self.opencl),
        }


def _result_json(result: DetectorResult) -> dict[str, Any]:
    return {
        "source": result.source,
        "driver_version": result.driver_version,
        "reason": result.reason,
        "devices": [asdict(device) for device in result.devices],
    }


def _safe_detect(detector: GpuDetector, source: str) -> DetectorResult:
    """Run one detector; a detector that breaks its promise and raises counts as finding none."""
    try:
        return detector.detect()
    except Exception as exc:
        logger.exception("%s detection failed unexpectedly", source)
        return DetectorResult(source=source, reason=f"detection failed: {exc!r}")


def detect_hardware(
    models_dir: Path,
    *,
    nvidia: GpuDetector | None = None,
    opencl: GpuDetector | None = None,
    system: SystemProbe | None = None,
) -> HardwareReport:
    """Read the GPUs, CPU, RAM and the free disk at ``models_dir`` now.

    A missing GPU driver is not an error: that part of the report is empty, with its reason.
    Raises ``DetectionError`` only if the CPU/RAM/disk probe itself fails.
    """
    started = time.perf_counter()
    try:
        info = (system or PsutilSystemProbe()).probe(Path(models_dir))
    except Exception as exc:
        raise DetectionError(f"cannot read this machine's CPU, memory or disk: {exc}") from exc
    report = HardwareReport(
        models_dir=Path(models_dir),
        system=info,
        nvidia=_safe_detect(nvidia or NvmlDetector(), "nvml"),
        opencl=_safe_detect(opencl or OpenClDetector(), "opencl"),
    )
    logger.debug("hardware detected in %.3f s", time.perf_counter() - started)
    return report


def status_changes(
    old: HardwareReport,
    new: HardwareReport,
    *,
    vram_tolerance_mb: int = VRAM_TOLERANCE_MB,
    disk_tolerance_gb: int = DISK_TOLERANCE_GB,
) -> dict[str, int | None]:
    """The ``status`` fields of ``new`` that moved beyond the tolerances since ``old``.

    Free VRAM changes when it moves more than ``vram_tolerance_mb`` or becomes known/unknown;
    free disk when its whole GB differ by more than ``disk_tolerance_gb``. A changed set of GPUs
    is not a status matter (the hello carries it): compare ``registration_fields`` for that.
    """
    changes: dict[str, int | None] = {}
    before, after = old.free_vram_mb, new.free_vram_mb
    if (before is None) != (after is None) or (
        before is not None and after is not None and abs(after - before) > vram_tolerance_mb
    ):
        changes["vram_free_mb"] = after
    if abs(new.disk_space - old.disk_space) > disk_tolerance_gb:
        changes["disk_space"] = new.disk_space
    return changes


def changed(
    old: HardwareReport,
    new: HardwareReport,
    *,
    vram_tolerance_mb: int = VRAM_TOLERANCE_MB,
    disk_tolerance_gb: int = DISK_TOLERANCE_GB,
) -> bool:
    """Whether free VRAM or free disk moved enough since ``old`` to send a ``status`` update."""
    return bool(
        status_changes(
            old, new, vram_tolerance_mb=vram_tolerance_mb, disk_tolerance_gb=disk_tolerance_gb
        )
    )
