"""Fixture-fed hardware for tests: recorded readings replayed through the real parsing code.

Each kind of detector in ``desktop_worker.hardware`` has a real implementation and a null one
(``NullGpuDetector``: no such GPU); the fixture-fed ones live here, beside the tests, so that
production never ships a test double. ``FixtureNvmlDetector`` and ``FixtureOpenClDetector`` are
the real detectors fed ``FakeNvml`` and ``FakeOpenCl``, stand-ins for the ``pynvml`` and
``pyopencl`` modules; ``FixedSystemProbe`` returns given or recorded CPU, RAM and disk readings;
``recorded_machine`` puts the three together into a whole ``HardwareReport``.

A fixture is a JSON file in ``tests/fixtures/hardware`` describing one machine, with up to three
sections:

- ``"nvml"``: ``driver_version`` and ``devices`` (``name``, ``memory`` {``total``, ``free``,
  ``used``} in bytes, ``cuda_compute_capability`` [major, minor], ``utilization`` {``gpu``,
  ``memory``}, ``uuid``), and optionally ``init``;
- ``"opencl"``: ``platforms``, each with ``name``, ``vendor``, ``version`` and ``devices``
  (``type`` "GPU", "CPU", "ACCELERATOR" or "CUSTOM", ``name``, ``vendor``,
  ``global_mem_size`` in bytes, ``driver_version``), and optionally ``get_platforms``;
- ``"system"``: the fields of ``SystemInfo``.

Any value may instead be an error: ``{"nvml_error": "NotSupported"}`` raises pynvml's
``NVMLError_NotSupported``; ``{"cl_error": "PLATFORM_NOT_FOUND_KHR", "code": -1001}`` raises a
``pyopencl.LogicError`` (or the class named by ``"kind"``).
"""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml

from desktop_worker.hardware import HardwareReport, SystemInfo, detect_hardware
from desktop_worker.hardware.nvidia import NvmlDetector
from desktop_worker.hardware.opencl import OpenClDetector

#: The recorded machines.
HARDWARE_FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hardware"


def fixture_path(name: str) -> Path:
    """A recorded machine from ``tests/fixtures/hardware``, by name (``"gaming_rtx3060"``)."""
    path = HARDWARE_FIXTURES / f"{name}.json"
    assert path.is_file(), path
    return path


def recorded_machine(path: Path, models_dir: Path) -> HardwareReport:
    """A whole recorded machine (a fixture file) through the real detectors' parsing code."""
    return detect_hardware(
        models_dir,
        nvidia=FixtureNvmlDetector(path),
        opencl=FixtureOpenClDetector(path),
        system=FixedSystemProbe.from_json(path),
    )


def load_fixture(path: Path) -> dict[str, Any]:
    """A fixture file as a dict."""
    return json.loads(Path(path).read_text(encoding="utf-8"))


# --- NVML ---------------------------------------------------------------------------------------


def _nvml_value(value: Any) -> Any:
    """The recorded value, or raise the recorded NVML error."""
    if isinstance(value, dict) and "nvml_error" in value:
        raise getattr(pynvml, f"NVMLError_{value['nvml_error']}")()
    return value


class FakeNvml:
    """A ``pynvml`` look-alike that answers from recorded readings and raises real NVML errors.

    Like NVML, every call but ``nvmlInit`` raises ``NVMLError_Uninitialized`` before init.
    ``init_calls`` and ``shutdown_calls`` count the calls, so tests can check the pairing.
    """

    NVMLError = pynvml.NVMLError

    def __init__(self, section: dict[str, Any]) -> None:
        self._section = section
        self._devices: list[dict[str, Any]] = list(section.get("devices", []))
        self._initialised = 0
        self.init_calls = 0
        self.shutdown_calls = 0

    @classmethod
    def from_file(cls, path: Path) -> FakeNvml:
        """The ``"nvml"`` section of a fixture file (empty: a driver with no GPU)."""
        return cls(load_fixture(path).get("nvml", {}))

    def _check(self) -> None:
        if not self._initialised:
            raise pynvml.NVMLError_Uninitialized()

    def _device(self, handle: int) -> dict[str, Any]:
        self._check()
        return self._devices[handle]

    def nvmlInit(self) -> None:
        self.init_calls += 1
        _nvml_value(self._section.get("init"))
        self._initialised += 1

    def nvmlShutdown(self) -> None:
        self._check()
        self.shutdown_calls += 1
        self._initialised -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        self._check()
        return _nvml_value(self._section.get("driver_version", {"nvml_error": "NotSupported"}))

    def nvmlDeviceGetCount(self) -> int:
        self._check()
        return _nvml_value(self._section.get("count", len(self._devices)))

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        self._check()
        if not 0 <= index < len(self._devices):
            raise pynvml.NVMLError_InvalidArgument()
        return index

    def nvmlDeviceGetName(self, handle: int) -> str:
        return _nvml_value(self._device(handle)["name"])

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> SimpleNamespace:
        return SimpleNamespace(**_nvml_value(self._device(handle)["memory"]))

    def nvmlDeviceGetCudaComputeCapability(self, handle: int) -> tuple[int, int]:
        major, minor = _nvml_value(self._device(handle)["cuda_compute_capability"])
        return int(major), int(minor)

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> SimpleNamespace:
        return SimpleNamespace(**_nvml_value(self._device(handle)["utilization"]))

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        return _nvml_value(self._device(handle)["uuid"])


class FixtureNvmlDetector(NvmlDetector):
    """The real NVML detector, fed a ``FakeNvml`` built from a fixture file."""

    def __init__(self, path: Path) -> None:
        self.fake = FakeNvml.from_file(path)
        super().__init__(nvml=self.fake)


# --- OpenCL -------------------------------------------------------------------------------------


def cl_error(spec: dict[str, Any]) -> Exception:
    """A real ``pyopencl`` error (``LogicError`` unless ``kind`` names another) from a spec."""
    import pyopencl as cl

    kind = getattr(cl, spec.get("kind", "LogicError"))
    routine = spec.get("routine", "clGetDeviceInfo")
    code = int(spec.get("code", -30))
    message = spec["cl_error"]
    record = getattr(getattr(cl, "_cl", None), "_ErrorRecord", None)
    if record is not None:
        return kind(record(routine=routine, code=code, msg=message))
    # Older or newer pyopencl without the record type: a subclass that still carries the code.
    stand_in = type(kind.__name__, (kind,), {"code": property(lambda _self: code)})
    return stand_in(f"{routine} failed: {message}")


def _cl_value(value: Any) -> Any:
    if isinstance(value, dict) and "cl_error" in value:
        raise cl_error(value)
    return value


class _FakeClObject:
    """A platform or device whose attributes come from a dict (errors raised on read)."""

    def __init__(self, data: dict[str, Any], device_types: Any) -> None:
        self._data = data
        self._device_types = device_types

    def __getattr__(self, name: str) -> Any:
        data = self.__dict__["_data"]
        if name not in data:
            raise cl_error({"cl_error": "INVALID_VALUE", "code": -30})
        value = _cl_value(data[name])
        if name == "type" and isinstance(value, str):
            return int(getattr(self._device_types, value.upper()))
        return value

    def get_devices(self) -> list[_FakeClObject]:
        devices = _cl_value(self._data.get("devices", []))
        return [_FakeClObject(device, self._device_types) for device in devices]


class FakeOpenCl:
    """A ``pyopencl`` look-alike that answers from recorded readings; errors are real
    ``pyopencl`` errors and ``device_type`` is pyopencl's own."""

    def __init__(self, section: dict[str, Any]) -> None:
        import pyopencl as cl

        self.Error = cl.Error
        self.LogicError = cl.LogicError
        self.RuntimeError = cl.RuntimeError
        self.device_type = cl.device_type
        self._section = section

    @classmethod
    def from_file(cls, path: Path) -> FakeOpenCl:
        """The ``"opencl"`` section of a fixture file (missing: no OpenCL platform at all)."""
        section = load_fixture(path).get("opencl")
        if section is None:
            section = {"get_platforms": {"cl_error": "PLATFORM_NOT_FOUND_KHR", "code": -1001}}
        return cls(section)

    def get_platforms(self) -> list[_FakeClObject]:
        if "get_platforms" in self._section:
            raise cl_error({"routine": "clGetPlatformIDs", **self._section["get_platforms"]})
        return [_FakeClObject(p, self.device_type) for p in self._section.get("platforms", [])]


class FixtureOpenClDetector(OpenClDetector):
    """The real OpenCL detector, fed a ``FakeOpenCl`` built from a fixture file."""

    def __init__(self, path: Path) -> None:
        self.fake = FakeOpenCl.from_file(path)
        super().__init__(cl=self.fake)


# --- CPU, RAM and disk --------------------------------------------------------------------------


class FixedSystemProbe:
    """A ``SystemProbe`` that always returns the same readings, whatever the directory."""

    def __init__(self, info: SystemInfo) -> None:
        self.info = info

    @classmethod
    def from_json(cls, path: Path) -> FixedSystemProbe:
        """Readings recorded as the fields of ``SystemInfo``: a fixture's ``"system"`` section,
        or the whole file."""
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        data = data.get("system", data)
        return cls(SystemInfo(**{f.name: int(data[f.name]) for f in fields(SystemInfo)}))

    def probe(self, models_dir: Path) -> SystemInfo:
        """Return the fixed readings."""
        return self.info
