"""NVIDIA GPUs through NVML (``nvidia-ml-py``, imported as ``pynvml``).

``NvmlDetector`` takes the NVML module as an argument: the real ``pynvml`` by default, or any
object with the same functions (the tests' ``FakeNvml``, in ``tests/support/hardware_fixtures.py``),
so recorded readings go through exactly this parsing code.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar

from desktop_worker.hardware.base import MIB, ComputeDevice, DetectorResult

logger = logging.getLogger(__name__)

SOURCE = "nvml"
T = TypeVar("T")

# NVML return codes (pynvml's NVML_ERROR_*), for the reasons given when NVML cannot start.
_INIT_REASONS = {
    9: "the NVIDIA driver is not loaded",
    12: "no NVIDIA driver (the NVML library was not found)",
    18: "the NVIDIA driver and library versions differ (a reboot may be needed)",
}


# Reasons already logged at INFO in this process. Detection runs at every (re)connect and
# status check; a machine without an NVIDIA driver says so once per run, then only at DEBUG.
_SAID: set[str] = set()


def _nothing(reason: str) -> DetectorResult:
    """An empty result; the reason is logged (once per run at INFO), since a missing driver is
    normal, not an error."""
    level = logging.DEBUG if reason in _SAID else logging.INFO
    if len(_SAID) < 64:
        _SAID.add(reason)
    logger.log(level, "no NVIDIA GPU: %s", reason)
    return DetectorResult(source=SOURCE, reason=reason)


class NvmlApi(Protocol):
    """The part of ``pynvml`` the detector uses."""

    NVMLError: type[Exception]

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None: ...
    def nvmlSystemGetDriverVersion(self) -> str | bytes: ...
    def nvmlDeviceGetCount(self) -> int: ...
    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any: ...
    def nvmlDeviceGetName(self, handle: Any) -> str | bytes: ...
    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any: ...
    def nvmlDeviceGetCudaComputeCapability(self, handle: Any) -> tuple[int, int]: ...
    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any: ...
    def nvmlDeviceGetUUID(self, handle: Any) -> str | bytes: ...


def _text(value: str | bytes) -> str:
    """NVML strings arrive as ``str`` in current pynvml and as ``bytes`` in old ones."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


@contextlib.contextmanager
def nvml_session(nvml: NvmlApi | None = None) -> Iterator[tuple[NvmlApi | None, str | None]]:
    """NVML started for the ``with`` body and shut down after it: ``(nvml, None)``, or
    ``(None, why)`` in plain words when it cannot start (no driver, no ``nvidia-ml-py``). ``nvml``
    is the module to call; None imports the real ``pynvml``. Shared by the detector and the
    owner's GPU probe (``desktop_worker/owner/probes.py``)."""
    if nvml is None:
        try:
            import pynvml
        except ImportError as exc:  # nvidia-ml-py is a dependency; be safe anyway
            yield None, f"nvidia-ml-py is not installed: {exc}"
            return
        nvml = pynvml
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        code = getattr(exc, "value", None)
        yield None, _INIT_REASONS.get(code, f"NVML failed: {exc}")
        return
    try:
        yield nvml, None
    finally:
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError as exc:
            logger.debug("nvmlShutdown failed: %s", exc)


class NvmlDetector:
    """Reads every NVIDIA GPU through NVML: name, memory, driver, compute capability, load, uuid.

    ``nvml`` is the NVML module to call; None means import the real ``pynvml`` on each detect.
    """

    source = SOURCE

    def __init__(self, nvml: NvmlApi | None = None) -> None:
        self._nvml = nvml

    def detect(self) -> DetectorResult:
        """Start NVML, read every GPU and shut NVML down again. Never raises for NVML errors."""
        with nvml_session(self._nvml) as (nvml, reason):
            if nvml is None:
                return _nothing(reason or "NVML failed")
            return self._read(nvml)

    def _read(self, nvml: NvmlApi) -> DetectorResult:
        driver = self._optional(nvml, "driver version", nvml.nvmlSystemGetDriverVersion)
        driver_version = _text(driver) if driver is not None else None
        try:
            count = nvml.nvmlDeviceGetCount()
        except nvml.NVMLError as exc:
            return _nothing(f"cannot count NVIDIA GPUs: {exc}")
        devices: list[ComputeDevice] = []
        problems: list[str] = []
        for index in range(count):
            try:
                devices.append(self._read_device(nvml, index, driver_version))
            except nvml.NVMLError as exc:
                logger.warning("NVIDIA GPU %d cannot be read, skipped: %s", index, exc)
                problems.append(f"GPU {index} cannot be read: {exc}")
        if not devices:
            reason = "; ".join(problems) or "NVML found no NVIDIA GPU"
            return _nothing(reason)
        return DetectorResult(
            source=SOURCE,
            devices=tuple(devices),
            driver_version=driver_version,
            reason="; ".join(problems) or None,
        )

    def _read_device(self, nvml: NvmlApi, index: int, driver: str | None) -> ComputeDevice:
        """One GPU. Name and memory are required; the rest is None where NVML cannot say."""
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        name = _text(nvml.nvmlDeviceGetName(handle))
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        capability = self._optional(
            nvml,
            f"{name}: compute capability",
            lambda: nvml.nvmlDeviceGetCudaComputeCapability(handle),
        )
        rates = self._optional(
            nvml, f"{name}: utilisation", lambda: nvml.nvmlDeviceGetUtilizationRates(handle)
        )
        uuid = self._optional(nvml, f"{name}: uuid", lambda: nvml.nvmlDeviceGetUUID(handle))
        return ComputeDevice(
            name=name,
            device_type="gpu",
            vendor="NVIDIA",
            memory_total_mb=int(memory.total) // MIB,
            memory_free_mb=int(memory.free) // MIB,
            driver_version=driver,
            compute_capability=f"{capability[0]}.{capability[1]}" if capability else None,
            utilization_pct=min(100, max(0, int(rates.gpu))) if rates is not None else None,
            uuid=_text(uuid) if uuid is not None else None,
            platform="NVML",
        )

    @staticmethod
    def _optional(nvml: NvmlApi, what: str, call: Callable[[], T]) -> T | None:
        """Call NVML for a value some GPUs cannot give (NotSupported and the like): None then."""
        try:
            return call()
        except nvml.NVMLError as exc:
            logger.debug("NVML cannot read %s: %s", what, exc)
            return None
