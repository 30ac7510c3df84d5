"""CPU count, RAM and free disk where the models live.

``SystemProbe`` is the interface; ``PsutilSystemProbe`` reads this machine and
``FixedSystemProbe`` returns given (or recorded, JSON) values for tests.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass, fields
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


class FixedSystemProbe:
    """Always returns the same readings, whatever the directory."""

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
