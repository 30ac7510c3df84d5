"""CPU count, RAM and free disk where the models live.

``SystemProbe`` is the interface; ``PsutilSystemProbe`` reads this machine. The tests'
``FixedSystemProbe`` (``tests/support/hardware_fixtures.py``) returns given or recorded values.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import psutil

from desktop_worker.hardware.base import GIB, MIB

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SystemInfo:
    """The machine apart from its GPUs. MB is MiB and GB is GiB."""

    cpu_count: int
    total_ram_mb: int
    available_ram_mb: int
    disk_free_gb: int


@runtime_checkable
class SystemProbe(Protocol):
    """Anything that can read CPU, RAM and free disk; ``probe`` must be fast and not raise."""

    def probe(self, models_dir: Path) -> SystemInfo:
        """Read the machine now; the free disk is that of the file system holding models_dir."""
        ...


def disk_free_bytes(path: Path) -> int:
    """Free bytes on the file system that holds ``path`` (or would hold it: the models
    directory may not exist yet, so the nearest existing parent is asked). 0 if unreadable."""
    probe = path.expanduser().absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return shutil.disk_usage(probe).free
    except OSError as exc:
        logger.warning("cannot read the free disk at %s: %s", probe, exc)
        return 0


class PsutilSystemProbe:
    """This machine, read through ``os``, ``psutil`` and ``shutil``."""

    def probe(self, models_dir: Path) -> SystemInfo:
        """Read CPU count, RAM and the free disk at ``models_dir`` now."""
        memory = psutil.virtual_memory()
        return SystemInfo(
            cpu_count=os.cpu_count() or 1,
            total_ram_mb=int(memory.total) // MIB,
            available_ram_mb=int(memory.available) // MIB,
            disk_free_gb=disk_free_bytes(models_dir) // GIB,
        )

