"""A disk for tests of the model store's headroom (issue 34): set sizes instead of this machine's.

``FakeDisk`` answers ``DiskProbe.usage`` with a total and a free space the test sets (and may
change). Given ``filled_by``, a folder, the free space shrinks as files grow under it, by
``cost_per_byte`` bytes for each byte there (``free_bytes`` is then the free space while the
folder is empty): 1.0 is the download itself; more is another program filling the disk at the
same time. Every reading is counted (``reads``), and the lowest free space read is kept.

``huge_file`` makes a file of any size that the fake hub can list (a sparse file, so it takes no
disk, and a made-up sha256, so the hub does not read 64 GB to hash it).
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import pytest

from desktop_worker.store.disk import DiskUsage
from tests.support import fake_hub

__all__ = ["FakeDisk", "huge_file"]


def huge_file(path: Path, size_bytes: int, monkeypatch: pytest.MonkeyPatch) -> str:
    """A sparse file of ``size_bytes`` at ``path`` for the fake hub to list; its sha256 (made up:
    the fake hub is told it instead of hashing the file). Nothing may download it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as handle:
        handle.truncate(size_bytes)
    sha256 = hashlib.sha256(f"huge:{size_bytes}".encode()).hexdigest()
    real = fake_hub._sha256

    def hashed(data: bytes | None, file: Path | None) -> str:
        return sha256 if file is not None and Path(file) == path else real(data, file)

    monkeypatch.setattr(fake_hub, "_sha256", hashed)
    return sha256


class FakeDisk:
    def __init__(
        self,
        *,
        total_bytes: int,
        free_bytes: int,
        filled_by: Path | None = None,
        cost_per_byte: float = 1.0,
    ) -> None:
        self.total_bytes = total_bytes
        self.free_bytes = free_bytes
        self.filled_by = filled_by
        self.cost_per_byte = cost_per_byte
        self.reads = 0
        self.lowest_free = free_bytes
        self._lock = threading.Lock()

    def usage(self, path: Path) -> DiskUsage:
        free = self.free_bytes - int(self.cost_per_byte * self.written_bytes())
        with self._lock:
            self.reads += 1
            self.lowest_free = min(self.lowest_free, free)
        return DiskUsage(self.total_bytes, max(free, 0))

    def written_bytes(self) -> int:
        """Bytes in the files under ``filled_by`` now (0 without it)."""
        if self.filled_by is None or not self.filled_by.exists():
            return 0
        total = 0
        for folder, _dirs, names in os.walk(self.filled_by):
            for name in names:
                try:
                    total += (Path(folder) / name).stat().st_size
                except FileNotFoundError:
                    continue
        return total
