"""NVML detection: recorded machines through the real parsing code, and the real library here."""

from __future__ import annotations

import logging
from typing import Any

import pynvml
import pytest

from desktop_worker.hardware import GpuDetector, NullGpuDetector, NvmlDetector
from tests.support.hardware_fixtures import FakeNvml, FixtureNvmlDetector, fixture_path

GB12 = 12 * 1024


@pytest.mark.parametrize(
    ("fixture", "driver", "expected"),
    [
        (
            "gaming_rtx3060",
            "550.107.02",
            [("NVIDIA GeForce RTX 3060", GB12, 11264, "8.6", 7,
              "GPU-5a7c8f3e-2b1d-4e6a-9c0f-8d3b2a1e4f67")],
        ),
        (
            "server_2x_a100",
            "535.183.01",
            [
                ("NVIDIA A100-SXM4-80GB", 81920, 81248, "8.0", 0,
                 "GPU-0d1f6c2e-8a4b-4b7e-93c1-6f2a9e5d3b10"),
                ("NVIDIA A100-SXM4-80GB", 81920, 40960, "8.0", 87,
                 "GPU-7e3b9a51-4c2d-4f8e-b6a0-1d5c7e9f2a84"),
            ],
        ),
        (
            "legacy_gt730_no_utilization",
            "470.256.02",
            [("NVIDIA GeForce GT 730", 2048, 1760, "3.5", None,
              "GPU-c4e2a7d9-1f3b-4a6c-8e5d-2b9f0a7c3e61")],
        ),
    ],
)
def test_recorded_machines_parse_through_the_real_detector(
    fixture: str, driver: str, expected: list[tuple[Any, ...]]
) -> None:
    detector = FixtureNvmlDetector(fixture_path(fixture))
    assert isinstance(detector, NvmlDetector)  # the very parsing code used on real machines

    result = detector.detect()

    assert result.source == "nvml"
    assert result.reason is None
    assert result.driver_version == driver
    got = [
        (d.name, d.memory_total_mb, d.memory_free_mb, d.compute_capability, d.utilization_pct,
         d.uuid)
        for d in result.gpus
    ]
    assert got == expected
    assert all(d.driver_version == driver and d.device_type == "gpu" for d in result.devices)
    assert (detector.fake.init_calls, detector.fake.shutdown_calls) == (1, 1)


def test_utilisation_not_supported_still_reports_the_gpu() -> None:
    fake = FakeNvml.from_file(fixture_path("legacy_gt730_no_utilization"))
    fake.nvmlInit()
    with pytest.raises(pynvml.NVMLError_NotSupported):  # the fixture raises NVML's real error
        fake.nvmlDeviceGetUtilizationRates(fake.nvmlDeviceGetHandleByIndex(0))
    fake.nvmlShutdown()

    (gpu,) = NvmlDetector(nvml=fake).detect().gpus

    assert gpu.name == "NVIDIA GeForce GT 730"
    assert gpu.utilization_pct is None
    assert gpu.memory_total_mb == 2048
    assert gpu.to_nv_gpu().utilization_pct is None


def test_no_driver_for_real_gives_no_gpu_and_a_logged_reason(
    caplog: pytest.LogCaptureFixture, has_nvidia_driver: bool
) -> None:
    if has_nvidia_driver:
        pytest.skip("this machine has an NVIDIA driver")
    with pytest.raises(pynvml.NVMLError_LibraryNotFound):  # the real library, really missing
        pynvml.nvmlInit()
    # DEBUG: the reason is logged at INFO once per run, then at DEBUG (an earlier test may
    # have said it already).
    caplog.set_level(logging.DEBUG, logger="desktop_worker.hardware.nvidia")

    result = NvmlDetector().detect()

    assert result.devices == ()
    assert result.driver_version is None
    assert result.reason is not None
    assert "no NVIDIA driver" in result.reason
    assert any(
        r.name == "desktop_worker.hardware.nvidia" and result.reason in r.getMessage()
        for r in caplog.records
    )


def test_real_gpus_when_a_driver_is_present(has_nvidia_driver: bool) -> None:
    if not has_nvidia_driver:
        pytest.skip("no NVIDIA driver on this machine")
    result = NvmlDetector().detect()
    assert result.gpus, result.reason
    for gpu in result.gpus:
        assert gpu.name
        assert gpu.memory_total_mb > 1024
        assert gpu.memory_free_mb is not None
        assert 0 <= gpu.memory_free_mb <= gpu.memory_total_mb
        assert gpu.compute_capability is not None
        assert gpu.uuid is not None
        assert gpu.uuid.startswith("GPU-")
    assert result.driver_version


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        ("DriverNotLoaded", "driver is not loaded"),
        ("LibRmVersionMismatch", "versions differ"),
        ("NoPermission", "NVML failed: Insufficient Permissions"),
    ],
)
def test_init_failures_give_reasons_not_crashes(error: str, reason: str) -> None:
    fake = FakeNvml({"init": {"nvml_error": error}})

    result = NvmlDetector(nvml=fake).detect()

    assert result.devices == ()
    assert result.reason is not None
    assert reason in result.reason
    assert fake.shutdown_calls == 0  # nothing to shut down after a failed init


def test_an_unreadable_gpu_is_skipped_and_the_others_kept() -> None:
    lost = {"nvml_error": "GpuIsLost"}
    good = {
        "name": "NVIDIA GeForce RTX 4090",
        "memory": {"total": 25757220864, "free": 25000000000, "used": 757220864},
        "cuda_compute_capability": [8, 9],
        "utilization": {"gpu": 100, "memory": 50},
        "uuid": "GPU-1",
    }
    fake = FakeNvml({"driver_version": "555.42.02", "devices": [{**good, "name": lost}, good]})

    result = NvmlDetector(nvml=fake).detect()

    assert [g.name for g in result.gpus] == ["NVIDIA GeForce RTX 4090"]
    assert result.gpus[0].memory_total_mb == 24564
    assert result.gpus[0].compute_capability == "8.9"
    assert result.reason is not None
    assert "GPU 0" in result.reason
    assert fake.shutdown_calls == 1


def test_count_failure_still_shuts_nvml_down() -> None:
    fake = FakeNvml({"driver_version": "550.54.14", "count": {"nvml_error": "Unknown"}})

    result = NvmlDetector(nvml=fake).detect()

    assert result.devices == ()
    assert result.reason is not None
    assert "cannot count" in result.reason
    assert (fake.init_calls, fake.shutdown_calls) == (1, 1)


def test_driver_with_no_gpu_and_optional_fields_missing() -> None:
    assert NvmlDetector(nvml=FakeNvml({"devices": []})).detect().reason == (
        "NVML found no NVIDIA GPU"
    )
    unsupported = {"nvml_error": "NotSupported"}
    device = {
        "name": b"Tesla K80",  # older pynvml returned bytes
        "memory": {"total": 11996954624, "free": 11996954624, "used": 0},
        "cuda_compute_capability": unsupported,
        "utilization": unsupported,
        "uuid": unsupported,
    }
    result = NvmlDetector(nvml=FakeNvml({"devices": [device]})).detect()
    (gpu,) = result.gpus
    assert (gpu.name, gpu.memory_total_mb) == ("Tesla K80", 11441)
    assert (gpu.compute_capability, gpu.utilization_pct, gpu.uuid) == (None, None, None)
    assert result.driver_version is None


def test_detectors_share_one_interface() -> None:
    null = NullGpuDetector("nvml", "disabled by --no-gpu")
    for detector in (NvmlDetector(), null, FixtureNvmlDetector(fixture_path("gaming_rtx3060"))):
        assert isinstance(detector, GpuDetector)
    result = null.detect()
    assert (result.source, result.devices, result.reason) == ("nvml", (), "disabled by --no-gpu")


def test_no_driver_is_said_once_per_run_at_info(caplog: pytest.LogCaptureFixture) -> None:
    """Detection runs at every reconnect and status check; the Logs tab (INFO) gets the
    missing driver once, not 27 times in 5 minutes."""
    from desktop_worker.hardware import nvidia

    caplog.set_level(logging.DEBUG, logger="desktop_worker.hardware.nvidia")
    reason = "a reason only this test gives"
    for _ in range(5):
        assert nvidia._nothing(reason).reason == reason
    said = [r for r in caplog.records if reason in r.getMessage()]
    assert [r.levelno for r in said] == [logging.INFO] + [logging.DEBUG] * 4
