"""The disk headroom of the test run: 1 GB, not the default 10 % of the disk, 10-50 GB.

The models the tests write are small, and whether they fit must not depend on how full the
machine's disk is: a CI disk with 25 GB free of 252 GB left the default headroom (25.2 GB) no
room at all. ``APIARY_DISK_HEADROOM_GB`` carries it to every worker built from settings (in this
process or another); ``real_disk_headroom`` carries it to stores built straight from
``ModelStore(...)`` on the real disk. Tests of the default headroom remove the variable
(tests/desktop_worker/gui/test_disk_settings.py) or feed a fake disk (``FakeDisk``), which keeps
the default."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from desktop_worker.store.disk import DiskGuard, DiskUsage, LocalDisk

HEADROOM_ENV = "APIARY_DISK_HEADROOM_GB"
TEST_HEADROOM_GB = "1"


@pytest.fixture(autouse=True, scope="session")
def real_disk_headroom() -> Iterator[None]:
    """A store on the real disk with no headroom of its own keeps the run's headroom (the
    environment's, read when it is asked: a test that removes the variable gets the default).
    For the whole session, so that module-scoped fixtures' stores have it too."""
    default = DiskGuard.headroom_for

    def headroom_for(guard: DiskGuard, usage: DiskUsage) -> int:
        gb = os.environ.get(HEADROOM_ENV)
        if guard.headroom_bytes is None and isinstance(guard.probe, LocalDisk) and gb:
            return int(float(gb) * 1024**3)
        return default(guard, usage)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(DiskGuard, "headroom_for", headroom_for)
        yield
