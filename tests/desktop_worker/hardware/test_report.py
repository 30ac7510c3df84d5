"""The report: honest registration fields, a Hello built from them, and change detection."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from desktop_worker.errors import DetectionError
from desktop_worker.hardware import (
    ComputeDevice,
    DetectorResult,
    HardwareReport,
    NullGpuDetector,
    SystemInfo,
    changed,
    detect_hardware,
    status_changes,
)
from desktop_worker.hardware.base import GIB
from desktop_worker.hardware.report import REGISTRATION_KEYS
from shared_schema import PROTOCOL_VERSION, ClGpu, Hello, NvGpu, Status, decode, encode
from tests.support.hardware_fixtures import (
    FixedSystemProbe,
    FixtureOpenClDetector,
    fixture_path,
    recorded_machine,
)
from tests.support.workers import new_key, signed_hello


def recorded(name: str, models_dir: Path = Path("/models")) -> HardwareReport:
    """A whole recorded machine through the real detectors' parsing code."""
    return recorded_machine(fixture_path(name), models_dir)


def hello_from(fields: dict[str, object]) -> Hello:
    return Hello(
        protocol=PROTOCOL_VERSION,
        worker_version="0.1.0",
        pubkey="ab" * 32,
        signature="cd" * 64,
        **fields,
    )


@pytest.mark.parametrize(
    ("fixture", "expected"),
    [
        (
            "gaming_rtx3060",
            {"cpu_count": 12, "disk_space": 412, "vram": 12288, "nv_gpu_count": 1,
             "nv_driver_version": "550.107.02", "cl_driver_version": "550.107.02",
             "cl_gpu_count": 1},
        ),
        (
            "server_2x_a100",
            {"cpu_count": 64, "disk_space": 3310, "vram": 2 * 81920, "nv_gpu_count": 2,
             "nv_driver_version": "535.183.01", "cl_driver_version": "535.183.01",
             "cl_gpu_count": 2},
        ),
        (
            "legacy_gt730_no_utilization",
            {"cpu_count": 4, "disk_space": 87, "vram": 2048, "nv_gpu_count": 1,
             "nv_driver_version": "470.256.02", "cl_driver_version": None, "cl_gpu_count": 0},
        ),
        (
            # No NVIDIA: vram comes from the OpenCL GPU, never the CPU device nor system RAM.
            "amd_rx6700xt_opencl_only",
            {"cpu_count": 16, "disk_space": 230, "vram": 12272, "nv_gpu_count": 0,
             "nv_driver_version": None, "cl_driver_version": "3614.0 (HSA1.1,LC)",
             "cl_gpu_count": 1},
        ),
    ],
)
def test_registration_fields_are_honest(fixture: str, expected: dict[str, object]) -> None:
    report = recorded(fixture)

    fields = report.registration_fields()

    assert tuple(fields) == REGISTRATION_KEYS
    got = {key: fields[key] for key in expected if key != "cl_gpu_count"}
    got["cl_gpu_count"] = len(fields["cl_gpus"])
    assert got == expected
    assert len(fields["nv_gpus"]) == fields["nv_gpu_count"]
    assert all(type(gpu) is NvGpu for gpu in fields["nv_gpus"])
    assert all(type(gpu) is ClGpu for gpu in fields["cl_gpus"])
    assert fields["vram"] != report.total_ram_mb


def test_a_hello_carries_the_detected_hardware_over_the_wire() -> None:
    report = recorded("server_2x_a100")
    fields = report.registration_fields()

    hello = hello_from(fields)
    again = decode(encode(hello))

    assert isinstance(again, Hello)
    assert again.vram == 163840
    assert [g.memory_free_mb for g in again.nv_gpus] == [81248, 40960]
    assert [g.utilization_pct for g in again.nv_gpus] == [0, 87]
    assert [g.compute_capability for g in again.nv_gpus] == ["8.0", "8.0"]
    assert again.nv_gpus[1].uuid == "GPU-7e3b9a51-4c2d-4f8e-b6a0-1d5c7e9f2a84"
    assert [g.memory for g in again.cl_gpus] == [81050, 81050]
    assert set(REGISTRATION_KEYS) <= set(Hello.model_fields)
    # and a properly signed hello (as the test workers build one) validates with them too
    signed = signed_hello(new_key(), "ab" * 16, models=[])
    rebuilt = Hello(**(signed.model_dump() | fields))
    assert (rebuilt.signature, rebuilt.nv_gpu_count, rebuilt.vram) == (signed.signature, 2, 163840)


def test_no_gpu_at_all_reports_zero_vram_not_ram(tmp_path: Path) -> None:
    report = detect_hardware(
        tmp_path,
        nvidia=NullGpuDetector("nvml", "no driver"),
        opencl=NullGpuDetector("opencl", "no driver"),
    )
    fields = report.registration_fields()
    assert fields["vram"] == 0
    assert (fields["nv_gpu_count"], fields["nv_gpus"], fields["cl_gpus"]) == (0, [], [])
    assert report.free_vram_mb is None
    assert report.total_ram_mb > 0
    assert hello_from(fields).vram == 0


def test_free_vram_sums_nvidia_memory_and_is_none_without_it() -> None:
    assert recorded("gaming_rtx3060").free_vram_mb == 11264
    assert recorded("server_2x_a100").free_vram_mb == 81248 + 40960
    assert recorded("legacy_gt730_no_utilization").free_vram_mb == 1760
    assert recorded("amd_rx6700xt_opencl_only").free_vram_mb is None
    status = Status(**recorded("server_2x_a100").status_fields())
    assert (status.vram_free_mb, status.disk_space) == (122208, 3310)


def test_ram_readings_and_json_dict() -> None:
    report = recorded("amd_rx6700xt_opencl_only", Path("/srv/models"))
    assert (report.total_ram_mb, report.available_ram_mb) == (31998, 20480)

    data = json.loads(json.dumps(report.to_json_dict()))

    assert data["models_dir"] == "/srv/models"
    assert data["registration"]["vram"] == 12272
    assert data["registration"]["cl_gpus"][0]["name"] == "gfx1031"
    assert data["nvidia"]["reason"] == "no NVIDIA driver (the NVML library was not found)"
    assert [d["device_type"] for d in data["opencl"]["devices"]] == ["gpu", "cpu"]
    assert data["available_ram_mb"] == 20480


def test_detect_hardware_on_this_machine(tmp_path: Path) -> None:
    models_dir = tmp_path / "not-yet-created" / "models"

    report = detect_hardware(models_dir)

    assert report.cpu_count == os.cpu_count()
    assert report.disk_space > 0
    assert abs(report.disk_space - shutil.disk_usage(tmp_path).free // GIB) <= 1
    assert 0 < report.available_ram_mb <= report.total_ram_mb
    assert report.models_dir == models_dir
    assert not models_dir.exists()  # detection only reads
    assert all(isinstance(gpu, NvGpu) for gpu in report.registration_fields()["nv_gpus"])
    assert hello_from(report.registration_fields()).cpu_count == os.cpu_count()


def test_a_detector_that_raises_does_not_crash_detection(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Broken:
        source = "nvml"

        def detect(self) -> DetectorResult:
            raise ZeroDivisionError("driver bug")

    report = detect_hardware(
        Path("/models"),
        nvidia=Broken(),
        opencl=FixtureOpenClDetector(fixture_path("gaming_rtx3060")),
        system=FixedSystemProbe.from_json(fixture_path("gaming_rtx3060")),
    )

    assert report.nvidia.devices == ()
    assert report.nvidia.reason is not None
    assert "driver bug" in report.nvidia.reason
    assert report.vram == 12037  # falls back to the OpenCL GPU's memory
    assert "nvml detection failed unexpectedly" in caplog.text


def test_a_failing_system_probe_is_a_detection_error() -> None:
    class Broken:
        def probe(self, models_dir: Path) -> SystemInfo:
            raise OSError("no /proc")

    with pytest.raises(DetectionError, match="no /proc"):
        detect_hardware(Path("/models"), system=Broken(), nvidia=NullGpuDetector())


# --- changed() ----------------------------------------------------------------------------------


def report_with(free_mb: list[int | None], disk_gb: int) -> HardwareReport:
    gpus = tuple(
        ComputeDevice(name=f"GPU {i}", memory_total_mb=24564, memory_free_mb=free)
        for i, free in enumerate(free_mb)
    )
    return HardwareReport(
        models_dir=Path("/models"),
        system=SystemInfo(cpu_count=8, total_ram_mb=32000, available_ram_mb=16000,
                          disk_free_gb=disk_gb),
        nvidia=DetectorResult(source="nvml", devices=gpus, driver_version="550.54.14"),
        opencl=DetectorResult(source="opencl", reason="none"),
    )


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        (([20000], 100), ([20000], 100), {}),
        (([20000], 100), ([19950], 100), {}),  # 50 MB: within the 64 MB tolerance
        (([20000], 100), ([19936], 100), {}),  # exactly the tolerance
        (([20000], 100), ([19935], 100), {"vram_free_mb": 19935}),
        (([20000], 100), ([16000], 100), {"vram_free_mb": 16000}),
        (([20000, 1000], 100), ([20000, 2000], 100), {"vram_free_mb": 22000}),
        (([20000], 100), ([20000], 99), {"disk_space": 99}),
        (([20000], 100), ([12000], 140), {"vram_free_mb": 12000, "disk_space": 140}),
        (([20000], 100), ([None], 100), {"vram_free_mb": None}),  # became unknown
        (([], 100), ([8000], 100), {"vram_free_mb": 8000}),  # a GPU appeared
        (([], 100), ([], 100), {}),
    ],
)
def test_changed_and_status_changes(
    old: tuple[list[int | None], int], new: tuple[list[int | None], int], expected: dict
) -> None:
    before, after = report_with(*old), report_with(*new)
    assert status_changes(before, after) == expected
    assert changed(before, after) is bool(expected)


def test_changed_tolerances_are_adjustable() -> None:
    before, after = report_with([20000], 100), report_with([19990], 98)
    assert not changed(before, after, vram_tolerance_mb=64, disk_tolerance_gb=2)
    assert changed(before, after, vram_tolerance_mb=5, disk_tolerance_gb=2)
    assert changed(before, after, vram_tolerance_mb=64, disk_tolerance_gb=1)


def test_recorded_machines_compare() -> None:
    assert not changed(recorded("gaming_rtx3060"), recorded("gaming_rtx3060"))
    assert status_changes(recorded("gaming_rtx3060"), recorded("server_2x_a100")) == {
        "vram_free_mb": 122208,
        "disk_space": 3310,
    }
