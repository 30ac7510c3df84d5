"""CPU, RAM and free disk: the real probe, the fixed one, and a models directory not yet made."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import psutil

from desktop_worker.hardware import PsutilSystemProbe, SystemInfo, SystemProbe
from desktop_worker.hardware.base import GIB, MIB
from desktop_worker.hardware.system import disk_free_bytes
from tests.support.hardware_fixtures import FixedSystemProbe, fixture_path


def test_real_probe_reads_this_machine(tmp_path: Path) -> None:
    info = PsutilSystemProbe().probe(tmp_path)

    assert info.cpu_count == os.cpu_count()
    assert info.total_ram_mb == psutil.virtual_memory().total // MIB
    assert 0 < info.available_ram_mb <= info.total_ram_mb
    assert abs(info.disk_free_gb - shutil.disk_usage(tmp_path).free // GIB) <= 1
    assert info.disk_free_gb > 0


def test_free_disk_of_a_directory_not_yet_created(tmp_path: Path) -> None:
    missing = tmp_path / "a" / "b" / "models"
    free = disk_free_bytes(missing)
    assert free > 0
    assert abs(free - shutil.disk_usage(tmp_path).free) < GIB
    assert not (tmp_path / "a").exists()


def test_fixed_probe_replays_a_recording() -> None:
    probe = FixedSystemProbe.from_json(fixture_path("server_2x_a100"))
    assert isinstance(probe, SystemProbe)
    assert isinstance(PsutilSystemProbe(), SystemProbe)
    assert probe.probe(Path("/anywhere")) == SystemInfo(
        cpu_count=64, total_ram_mb=515712, available_ram_mb=498120, disk_free_gb=3310
    )
