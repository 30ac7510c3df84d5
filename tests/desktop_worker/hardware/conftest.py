"""Shared helpers for the hardware tests: the recorded machines and whether NVML is real here."""

from __future__ import annotations

from pathlib import Path

import pynvml
import pytest

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "hardware"


def fixture_path(name: str) -> Path:
    """A recorded machine from tests/fixtures/hardware."""
    path = FIXTURES / f"{name}.json"
    assert path.is_file(), path
    return path


def nvml_has_driver() -> bool:
    """Whether this machine has a working NVIDIA driver (the GPU test machines do)."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


@pytest.fixture(scope="session")
def has_nvidia_driver() -> bool:
    return nvml_has_driver()
