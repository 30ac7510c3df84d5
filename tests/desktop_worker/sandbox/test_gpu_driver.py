"""Starting the GPU driver before the sandbox's lock: what ``GpuDriver.start`` says on a
machine with no NVIDIA driver (this one), and with a library that is not a driver."""

from __future__ import annotations

import sys

import pytest

from desktop_worker.sandbox.gpu_driver import DriverStart, GpuDriver

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's libraries")


def test_no_driver_library_means_nothing_to_start() -> None:
    start = GpuDriver(("libapiary-no-such-driver.so.1",)).start()
    assert start == DriverStart(None)
    assert not start.started
    assert "nothing to start" in start.describe()


def test_a_library_without_cuinit_is_not_a_driver() -> None:
    start = GpuDriver(("libc.so.6",)).start()
    assert start.library is None


def test_what_a_start_says() -> None:
    assert DriverStart("libcuda.so.1", 0).started
    failed = DriverStart("libcuda.so.1", 304)
    assert not failed.started
    assert "cuInit returned 304" in failed.describe()
