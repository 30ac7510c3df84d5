"""Shared helpers for the hardware tests: whether NVML is real here. (The recorded machines
are in ``tests/support/hardware_fixtures.py``.)"""

from __future__ import annotations

import pynvml
import pytest


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
