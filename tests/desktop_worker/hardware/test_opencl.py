"""OpenCL detection: pocl's real CPU device, and recorded machines through the real parser."""

from __future__ import annotations

import logging

import pyopencl as cl
import pytest

from desktop_worker.hardware import GpuDetector, OpenClDetector
from desktop_worker.hardware.base import MIB
from tests.support.hardware_fixtures import FakeOpenCl, FixtureOpenClDetector, fixture_path

POCL = "Portable Computing Language"


def test_real_pocl_cpu_device_is_reported_but_not_as_a_gpu() -> None:
    pocl = [p for p in cl.get_platforms() if p.name == POCL]
    assert pocl, "pocl-binary-distribution should provide a real OpenCL platform"
    (real,) = pocl[0].get_devices()

    result = OpenClDetector().detect()

    devices = [d for d in result.devices if d.platform == POCL]
    assert len(devices) == 1
    (device,) = devices
    assert device.device_type == "cpu"
    assert not device.is_gpu
    assert device not in result.gpus
    assert device.name == real.name.strip()
    assert device.memory_total_mb == real.global_mem_size // MIB
    assert device.memory_total_mb > 256
    assert device.driver_version == "3.0-rc2"
    assert device.vendor == real.vendor


def test_real_pocl_vendor_fields_raise_logic_error() -> None:
    # The premise of the fixture-fed vendor test: drivers really refuse vendor-only queries.
    (device,) = next(p for p in cl.get_platforms() if p.name == POCL).get_devices()
    with pytest.raises(cl.LogicError):
        _ = device.pci_bus_id_nv


def test_no_platform_gives_no_device_and_a_logged_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake = FakeOpenCl({"get_platforms": {"cl_error": "PLATFORM_NOT_FOUND_KHR", "code": -1001}})
    with pytest.raises(cl.LogicError) as raised:  # pyopencl's own error, with the real code
        fake.get_platforms()
    assert raised.value.code == -1001
    caplog.set_level(logging.INFO, logger="desktop_worker.hardware.opencl")

    result = OpenClDetector(cl=fake).detect()

    assert result.devices == ()
    assert result.reason == "no OpenCL platform (no OpenCL driver)"
    assert any(
        r.name == "desktop_worker.hardware.opencl" and "no OpenCL platform" in r.getMessage()
        for r in caplog.records
    )


def test_a_fixture_without_opencl_means_no_platform() -> None:
    result = FixtureOpenClDetector(fixture_path("legacy_gt730_no_utilization")).detect()
    assert result.devices == ()
    assert result.reason == "no OpenCL platform (no OpenCL driver)"


def test_other_platform_errors_are_reasons_too() -> None:
    fake = FakeOpenCl(
        {"get_platforms": {"cl_error": "OUT_OF_HOST_MEMORY", "code": -6, "kind": "RuntimeError"}}
    )
    result = OpenClDetector(cl=fake).detect()
    assert result.devices == ()
    assert result.reason is not None
    assert result.reason.startswith("OpenCL failed:")
    assert "OUT_OF_HOST_MEMORY" in result.reason


def test_vendor_logic_error_and_empty_platform_do_not_break_detection() -> None:
    result = FixtureOpenClDetector(fixture_path("quirky_opencl_driver")).detect()

    assert [(d.platform, d.device_type) for d in result.devices] == [
        ("Clover", "gpu"),
        (POCL, "cpu"),
    ]
    gpu = result.gpus[0]
    assert gpu.vendor is None  # the vendor query raised cl.LogicError
    assert gpu.name.startswith("AMD Radeon RX 580 Series")
    assert gpu.memory_total_mb == 8192
    assert gpu.driver_version == "22.3.6"
    assert result.driver_version == "22.3.6"  # the GPU's driver, not the CPU device's
    assert result.reason is None  # a platform with no device is normal, not a problem


def test_recorded_nvidia_and_amd_opencl_gpus() -> None:
    nvidia = FixtureOpenClDetector(fixture_path("gaming_rtx3060")).detect()
    assert [(d.name, d.vendor, d.memory_total_mb) for d in nvidia.gpus] == [
        ("NVIDIA GeForce RTX 3060", "NVIDIA Corporation", 12037)
    ]
    amd = FixtureOpenClDetector(fixture_path("amd_rx6700xt_opencl_only")).detect()
    assert [(d.name, d.device_type, d.memory_total_mb) for d in amd.devices] == [
        ("gfx1031", "gpu", 12272),
        ("pthread-AMD Ryzen 7 5800X 8-Core Processor", "cpu", 28672),
    ]
    assert amd.driver_version == "3614.0 (HSA1.1,LC)"
    assert amd.gpus[0].to_cl_gpu().model_dump() == {
        "name": "gfx1031",
        "vendor": "Advanced Micro Devices, Inc.",
        "memory": 12272,
        "driver_version": "3614.0 (HSA1.1,LC)",
    }


def test_opencl_detectors_share_the_interface() -> None:
    assert isinstance(OpenClDetector(), GpuDetector)
    assert isinstance(FixtureOpenClDetector(fixture_path("gaming_rtx3060")), OpenClDetector)
