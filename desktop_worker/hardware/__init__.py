"""What this worker has: NVIDIA GPUs (NVML), OpenCL devices, CPUs, RAM and free disk.

``detect_hardware(models_dir)`` returns a ``HardwareReport`` whose ``registration_fields()``
fill a ``Hello``. Each kind of detector sits behind ``GpuDetector`` (or ``SystemProbe``) with a
real and a null implementation here; the fixture-fed ones that replay recorded machines are test
doubles, and live with the tests (``tests/support/hardware_fixtures.py``).
"""

from __future__ import annotations

from desktop_worker.hardware.base import (
    ComputeDevice,
    DetectorResult,
    GpuDetector,
    NullGpuDetector,
)
from desktop_worker.hardware.nvidia import NvmlDetector
from desktop_worker.hardware.opencl import OpenClDetector
from desktop_worker.hardware.report import (
    HardwareReport,
    changed,
    detect_hardware,
    status_changes,
)
from desktop_worker.hardware.system import (
    PsutilSystemProbe,
    SystemInfo,
    SystemProbe,
)

__all__ = [
    "ComputeDevice",
    "DetectorResult",
    "GpuDetector",
    "HardwareReport",
    "NullGpuDetector",
    "NvmlDetector",
    "OpenClDetector",
    "PsutilSystemProbe",
    "SystemInfo",
    "SystemProbe",
    "changed",
    "detect_hardware",
    "status_changes",
]
