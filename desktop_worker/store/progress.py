"""Download progress: what a pull reports, and the meter that computes speed and ETA."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from desktop_worker.errors import DownloadCancelled
from shared_schema.hardware import DownloadProgress

__all__ = ["ProgressCallback", "ProgressMeter", "PullProgress"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PullProgress:
    """One progress report of a model download.

    ``downloaded_bytes`` counts bytes on disk for the model, including bytes kept from an earlier,
    interrupted download; ``bytes_per_s`` counts only what this download transferred.
    """

    name: str
    downloaded_bytes: int
    total_bytes: int | None
    bytes_per_s: float | None
    eta_s: float | None
    done: bool = False

    def to_wire(self) -> DownloadProgress:
        """The ``DownloadProgress`` the worker sends in its status messages."""
        return DownloadProgress(
            name=self.name,
            downloaded_bytes=self.downloaded_bytes,
            total_bytes=self.total_bytes,
            bytes_per_s=self.bytes_per_s,
        )


ProgressCallback = Callable[[PullProgress], None]


class ProgressMeter:
    """Turns byte counts into ``PullProgress`` reports, at a sensible rate.

    A report goes out at the start, whenever ``min_step_bytes`` more bytes have arrived or
    ``min_interval_s`` has passed since the last one, and at the end (``finish``). A callback
    that raises is logged and otherwise ignored (a broken progress display must not break a
    download), except ``DownloadCancelled``, which cancels the download.
    """

    def __init__(
        self,
        name: str,
        total_bytes: int | None,
        callback: ProgressCallback | None,
        *,
        min_interval_s: float = 0.5,
        min_step_bytes: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.total_bytes = total_bytes
        self._callback = callback
        self._clock = clock
        self._min_interval = min_interval_s
        self._min_step = (
            min_step_bytes
            if min_step_bytes is not None
            else max(1 << 20, (total_bytes or 0) // 200)
        )
        self._start_time = clock()
        self._start_bytes: int | None = None
        self._bytes = 0
        self._last_time = self._start_time
        self._last_bytes = -1

    @property
    def downloaded_bytes(self) -> int:
        return self._bytes

    def update(self, downloaded_bytes: int) -> None:
        """Record the model's bytes on disk now; report if it is time to."""
        if self._start_bytes is None:
            self._start_bytes = downloaded_bytes
            self._start_time = self._clock()
        self._bytes = downloaded_bytes
        now = self._clock()
        if (
            self._last_bytes < 0
            or abs(downloaded_bytes - self._last_bytes) >= self._min_step
            or now - self._last_time >= self._min_interval
        ):
            self._emit(now, done=False)

    def finish(self) -> None:
        """Report the end of the download (downloaded == total)."""
        if self.total_bytes is not None:
            self._bytes = self.total_bytes
        self._emit(self._clock(), done=True)

    def snapshot(self, *, done: bool = False) -> PullProgress:
        """The report for the bytes recorded so far."""
        return self._report(self._clock(), done=done)

    def _report(self, now: float, *, done: bool) -> PullProgress:
        elapsed = now - self._start_time
        moved = self._bytes - (self._start_bytes or 0)
        speed = moved / elapsed if elapsed > 0 and moved > 0 else None
        eta: float | None = None
        if done:
            eta = 0.0
        elif speed and self.total_bytes is not None:
            eta = max(self.total_bytes - self._bytes, 0) / speed
        return PullProgress(self.name, self._bytes, self.total_bytes, speed, eta, done)

    def _emit(self, now: float, *, done: bool) -> None:
        self._last_time = now
        self._last_bytes = self._bytes
        if self._callback is None:
            return
        try:
            self._callback(self._report(now, done=done))
        except DownloadCancelled:
            raise
        except Exception:
            logger.exception("the progress callback for %s failed", self.name)
