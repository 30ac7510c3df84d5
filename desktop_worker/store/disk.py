"""The volunteer's disk: how much of it the model store may fill (issue 34).

The store never fills a disk past its **headroom**: by default it keeps 10 % of the disk
free, 10-50 GB (``default_headroom_bytes``), or what the owner set (``disk_headroom_gb``). A pull is
checked against it before the first byte, and while it runs the free space is read again every
``CHECK_STEP_BYTES`` or ``CHECK_INTERVAL_S`` (``CheckPacer``): a download that would end inside
the headroom stops (``ModelStore`` deletes its partial file and raises ``InsufficientDisk``).

``DiskGuard`` keeps one store's disk: its headroom, what each download under way will still write
(so two downloads together cannot do what one may not), and the checks before and during a
download. ``DiskProbe`` is where the readings come from: ``LocalDisk`` reads the real disk; tests
use a fake (``tests/support/fake_disk.py``), so no test needs a nearly full disk. GB here is
GiB, as everywhere in the worker's settings.
"""

from __future__ import annotations

import itertools
import logging
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from desktop_worker.errors import InsufficientDisk

__all__ = [
    "CHECK_INTERVAL_S",
    "CHECK_STEP_BYTES",
    "GIB",
    "MAX_HEADROOM_BYTES",
    "MIN_HEADROOM_BYTES",
    "CheckPacer",
    "DiskGuard",
    "DiskProbe",
    "DiskUsage",
    "LocalDisk",
    "default_headroom_bytes",
    "default_quota_gb",
    "fmt_bytes",
    "writable_bytes",
]

logger = logging.getLogger(__name__)

GIB = 1 << 30
MIN_HEADROOM_BYTES = 10 * GIB  # the headroom's floor: 10 GB ...
HEADROOM_SHARE = 10  # ... or one tenth of the disk, the larger ...
MAX_HEADROOM_BYTES = 50 * GIB  # ... but never more than 50 GB (a tenth of a 2 TB disk would
# keep 200 GB from an owner who has 150 GB free there)
# How often a download re-reads the free disk: after this many bytes or this long, the first.
CHECK_STEP_BYTES = 32 << 20
CHECK_INTERVAL_S = 1.0


@dataclass(frozen=True)
class DiskUsage:
    """The size of a disk and its free space, in bytes."""

    total_bytes: int
    free_bytes: int


@runtime_checkable
class DiskProbe(Protocol):
    """Reads the disk holding a path (or the path it would be created at); never raises."""

    def usage(self, path: Path) -> DiskUsage: ...


class LocalDisk:
    """This machine's disks, through ``shutil.disk_usage`` (statvfs, GetDiskFreeSpaceExW). A
    disk that cannot be read counts as full (logged): nothing is downloaded onto it blind."""

    def usage(self, path: Path) -> DiskUsage:
        probe = Path(path).absolute()
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        try:
            found = shutil.disk_usage(probe)
        except OSError as exc:
            logger.warning("cannot read the free space of the disk holding %s: %s", probe, exc)
            return DiskUsage(0, 0)
        return DiskUsage(found.total, found.free)


def default_headroom_bytes(total_bytes: int) -> int:
    """What the store keeps free on a disk of ``total_bytes`` unless the owner says otherwise:
    10 % of the disk, 10-50 GB."""
    return min(MAX_HEADROOM_BYTES, max(MIN_HEADROOM_BYTES, total_bytes // HEADROOM_SHARE))


def default_quota_gb(free_bytes: int) -> float:
    """The quota a fresh install gets for models: half the disk's free space then, in whole GB
    (at least 1). It is saved once chosen, so it does not drift as the disk fills."""
    return float(max(1, free_bytes // 2 // GIB))


def writable_bytes(free_bytes: int, headroom_bytes: int, pending_bytes: int = 0) -> int:
    """How much more may be written to a disk with ``free_bytes`` free, keeping
    ``headroom_bytes`` free, when downloads under way will still write ``pending_bytes``
    (negative: the disk is already inside its headroom)."""
    return free_bytes - headroom_bytes - pending_bytes


class CheckPacer:
    """When a download re-reads the free disk: first at once, then once ``step_bytes`` more have
    arrived or ``interval_s`` has passed, whichever comes first. A reading costs one statvfs,
    so this keeps it to a few a second at any speed."""

    def __init__(
        self,
        step_bytes: int = CHECK_STEP_BYTES,
        interval_s: float = CHECK_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.step_bytes = step_bytes
        self.interval_s = interval_s
        self._clock = clock
        self._last_bytes: int | None = None
        self._last_time = 0.0

    def due(self, written_bytes: int) -> bool:
        """Whether to read the disk now, ``written_bytes`` into the download (then counted)."""
        now = self._clock()
        if (
            self._last_bytes is None
            or written_bytes - self._last_bytes >= self.step_bytes
            or now - self._last_time >= self.interval_s
        ):
            self._last_bytes = written_bytes
            self._last_time = now
            return True
        return False


def fmt_bytes(n: int) -> str:
    """A size for messages: ``512 B``, ``1.5 MiB``, ``64.0 GiB``."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


class DiskGuard:
    """The headroom of the disk holding ``root``, and the downloads under way onto it.

    ``headroom_bytes`` None is the default for the disk (``default_headroom_bytes``). Each
    download reserves what it will still write (``reserve``, ``release``); ``room_bytes``,
    ``problem`` and ``watch`` count the reservations, so what one download may write, two may
    not write together. Thread-safe."""

    def __init__(
        self,
        root: Path,
        probe: DiskProbe | None = None,
        headroom_bytes: int | None = None,
        *,
        check_step_bytes: int = CHECK_STEP_BYTES,
        check_interval_s: float = CHECK_INTERVAL_S,
    ) -> None:
        self.root = root
        self.probe: DiskProbe = probe or LocalDisk()
        self.headroom_bytes = headroom_bytes
        self.check_step_bytes = check_step_bytes
        self.check_interval_s = check_interval_s
        self._lock = threading.Lock()
        self._pending: dict[int, int] = {}
        self._tokens = itertools.count()

    def usage(self) -> DiskUsage:
        return self.probe.usage(self.root)

    def headroom_for(self, usage: DiskUsage) -> int:
        """The bytes kept free on this disk: the owner's figure, else the default."""
        if self.headroom_bytes is not None:
            return self.headroom_bytes
        return default_headroom_bytes(usage.total_bytes)

    def pending_bytes(self, but: int | None = None) -> int:
        """What the downloads under way (all but the reservation ``but``) will still write."""
        with self._lock:
            return sum(v for k, v in self._pending.items() if k != but)

    def room_bytes(self) -> int:
        """What may be written now: the free space less the headroom and the reservations
        (negative: inside the headroom already)."""
        usage = self.usage()
        return writable_bytes(usage.free_bytes, self.headroom_for(usage), self.pending_bytes())

    def problem(
        self, name: str, needed: int, on_disk: int = 0, freed: int = 0,
        usage: DiskUsage | None = None,
    ) -> str | None:
        """Why ``needed`` bytes for ``name`` (``on_disk`` of them here already) do not fit once
        ``freed`` bytes are evicted, in plain words; None when they fit."""
        usage = usage or self.usage()
        headroom = self.headroom_for(usage)
        pending = self.pending_bytes()
        room = writable_bytes(usage.free_bytes, headroom, pending) + freed
        if max(needed - on_disk, 0) <= room:
            return None
        kept = f", {fmt_bytes(on_disk)} of it already downloaded" if on_disk else ""
        busy = (f", and downloads under way will still write {fmt_bytes(pending)}"
                if pending else "")
        return (f"{name} needs {fmt_bytes(needed)}{kept}, but only {fmt_bytes(max(room, 0))} "
                f"may be used on the disk holding {self.root}: it has "
                f"{fmt_bytes(usage.free_bytes + freed)} free{busy}, and Apiary always leaves "
                f"{fmt_bytes(headroom)} of it free (change that in Settings, or with "
                "APIARY_DISK_HEADROOM_GB)")

    def reserve(self, remaining_bytes: int) -> int:
        """Count a download that will still write ``remaining_bytes``; its token."""
        with self._lock:
            token = next(self._tokens)
            self._pending[token] = max(remaining_bytes, 0)
            return token

    def release(self, token: int) -> None:
        with self._lock:
            self._pending.pop(token, None)

    def watch(self, name: str, token: int, total_bytes: int,
              clock: Callable[[], float] = time.monotonic) -> Callable[[int], None]:
        """A check for the download reserved as ``token``, to call with its bytes on disk as
        they grow: now and then (``CheckPacer``) it reads the disk again and raises
        ``InsufficientDisk`` once what is still to come would end inside the headroom."""
        pacer = CheckPacer(self.check_step_bytes, self.check_interval_s, clock)

        def check(on_disk: int) -> None:
            if not pacer.due(on_disk):
                return
            remaining = max(total_bytes - on_disk, 0)
            with self._lock:
                self._pending[token] = remaining
            usage = self.usage()
            headroom = self.headroom_for(usage)
            if writable_bytes(usage.free_bytes, headroom, self.pending_bytes(token)) >= remaining:
                return
            logger.warning("stopping the download of %s: %d bytes free, %d still to come, %d "
                           "kept free", name, usage.free_bytes, remaining, headroom)
            raise InsufficientDisk(
                f"stopped downloading {name}: the disk holding {self.root} has only "
                f"{fmt_bytes(usage.free_bytes)} free and {fmt_bytes(remaining)} of the model is "
                f"still to come, which would leave less than the {fmt_bytes(headroom)} Apiary "
                "always leaves free; the partial download was deleted")

        return check
