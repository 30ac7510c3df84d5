"""OpenCL devices through ``pyopencl``: GPUs for the wire, CPU devices for the full report.

``OpenClDetector`` takes the OpenCL module as an argument: the real ``pyopencl`` by default, or
any object with ``get_platforms``, ``Error`` and ``device_type`` (the tests' ``FakeOpenCl``, in
``tests/support/hardware_fixtures.py``), so recorded readings go through exactly this parsing
code.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from desktop_worker.hardware.base import MIB, ComputeDevice, DetectorResult

logger = logging.getLogger(__name__)

SOURCE = "opencl"
PLATFORM_NOT_FOUND_KHR = -1001
DEVICE_NOT_FOUND = -1


def _nothing(reason: str) -> DetectorResult:
    """An empty result; the reason is logged, since a missing driver is normal, not an error."""
    logger.info("no OpenCL device: %s", reason)
    return DetectorResult(source=SOURCE, reason=reason)


class OpenClApi(Protocol):
    """The part of ``pyopencl`` the detector uses."""

    Error: type[Exception]
    device_type: Any

    def get_platforms(self) -> list[Any]: ...


def _clean(value: object) -> str:
    return str(value).strip().strip("\x00").strip()


class OpenClDetector:
    """Reads every OpenCL device of every platform: type, name, vendor, memory, driver.

    ``cl`` is the OpenCL module to call; None means import the real ``pyopencl`` on each detect.
    Vendor-specific failures (an attribute that raises ``cl.LogicError``) leave that field None.
    """

    source = SOURCE

    def __init__(self, cl: OpenClApi | None = None) -> None:
        self._cl = cl

    def detect(self) -> DetectorResult:
        """List the platforms and their devices. Never raises for OpenCL errors."""
        cl = self._cl
        if cl is None:
            try:
                import pyopencl
            except (ImportError, OSError) as exc:
                return _nothing(f"pyopencl cannot be loaded: {exc}")
            cl = pyopencl
        try:
            platforms = cl.get_platforms()
        except cl.Error as exc:
            if getattr(exc, "code", None) == PLATFORM_NOT_FOUND_KHR:
                return _nothing("no OpenCL platform (no OpenCL driver)")
            return _nothing(f"OpenCL failed: {exc}")
        devices: list[ComputeDevice] = []
        problems: list[str] = []
        for platform in platforms:
            platform_name = self._optional(cl, platform, "name")
            try:
                found = platform.get_devices()
            except cl.Error as exc:
                if getattr(exc, "code", None) != DEVICE_NOT_FOUND:
                    logger.warning("OpenCL platform %s cannot list devices: %s", platform_name, exc)
                    problems.append(f"platform {platform_name}: {exc}")
                continue
            for device in found:
                try:
                    devices.append(self._read_device(cl, device, platform_name))
                except cl.Error as exc:
                    logger.warning("OpenCL device on %s cannot be read: %s", platform_name, exc)
                    problems.append(f"a device of {platform_name}: {exc}")
        if not devices:
            reason = "; ".join(problems) or "the OpenCL platforms have no devices"
            return _nothing(reason)
        first = next((d for d in devices if d.is_gpu), devices[0])
        return DetectorResult(
            source=SOURCE,
            devices=tuple(devices),
            driver_version=first.driver_version,
            reason="; ".join(problems) or None,
        )

    def _read_device(self, cl: OpenClApi, device: Any, platform: str | None) -> ComputeDevice:
        """One device. Its type and name are required; the rest is optional."""
        kind = _device_type(cl, int(device.type))
        name = _clean(device.name)
        memory = self._optional(cl, device, "global_mem_size")
        return ComputeDevice(
            name=name,
            device_type=kind,
            vendor=self._optional(cl, device, "vendor"),
            memory_total_mb=int(memory) // MIB if memory is not None else 0,
            driver_version=self._optional(cl, device, "driver_version"),
            platform=platform,
        )

    @staticmethod
    def _optional(cl: OpenClApi, obj: Any, attribute: str) -> Any:
        """An attribute that a driver may refuse (``cl.LogicError``): None then."""
        try:
            value = getattr(obj, attribute)
        except cl.Error as exc:
            logger.debug("OpenCL cannot read %s: %s", attribute, exc)
            return None
        return _clean(value) if isinstance(value, str) else value


def _device_type(cl: OpenClApi, bits: int) -> str:
    """The device type bit field as one word; GPU wins over the others."""
    types = cl.device_type
    for flag, word in (
        (types.GPU, "gpu"),
        (types.ACCELERATOR, "accelerator"),
        (types.CPU, "cpu"),
        (types.CUSTOM, "custom"),
    ):
        if bits & int(flag):
            return word
    return "other"
