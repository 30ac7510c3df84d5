"""The loop that pauses and resumes the worker for its owner.

``PauseWatcher`` runs beside the link (``WorkerService.serve`` starts and stops it): every
``pause_check_interval_s`` it reads the probe in a thread, asks ``policy.decide`` and calls
``service.pause(reason)`` or ``service.resume()``, only on a change. It pauses at once but
resumes only after ``clear_checks`` clear checks in a row, so a GPU share hovering around the
threshold does not pause and resume the worker every few seconds. A probe that raises reads as
unknown (logged once); active hours that cannot be read are ignored with a warning (once). It
resumes only pauses it made itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from datetime import datetime
from typing import Protocol

from desktop_worker.owner.errors import ActiveHoursError
from desktop_worker.owner.policy import (
    OwnerReadings,
    PauseSettings,
    decide,
    parse_active_hours,
    wants_for,
)
from desktop_worker.owner.probes import OwnerProbe

log = logging.getLogger(__name__)


class Pausable(Protocol):
    """What the watcher drives (``WorkerService``)."""

    paused: str | None

    def pause(self, reason: str) -> None: ...
    def resume(self) -> None: ...


class WatcherSettings(PauseSettings, Protocol):
    pause_check_interval_s: float


def local_now() -> datetime:
    return datetime.now().astimezone()


class PauseWatcher:
    """``settings`` is read at every check (a callable, or the settings object itself)."""

    def __init__(
        self,
        service: Pausable,
        probe: OwnerProbe,
        settings: WatcherSettings | Callable[[], WatcherSettings],
        clock: Callable[[], datetime] = local_now,
        *,
        clear_checks: int = 2,
    ) -> None:
        self.service = service
        self.probe = probe
        self._settings = settings if callable(settings) else (lambda: settings)
        self.clock = clock
        self.clear_checks = max(1, clear_checks)
        self.reason: str | None = None  # the pause this watcher made (None: none)
        self._clear = 0
        self._warned: set[str] = set()
        self.checks = 0

    async def run(self, stop: asyncio.Event) -> None:
        """Check now, then every interval, until ``stop``."""
        while not stop.is_set():
            try:
                await self.check()
            except Exception:  # the watcher must never take the worker down
                log.exception("the owner's pause check failed")
            interval = max(0.05, float(self._settings().pause_check_interval_s))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)

    async def check(self) -> str | None:
        """One check: read, decide, pause or resume on a change. Returns the pause reason now
        in force by this watcher (None: not paused by it)."""
        settings = self._settings()
        self._warn_bad_hours(settings)
        readings = await self._read(settings)
        wanted = decide(readings, settings, self.clock())
        self.checks += 1
        if wanted is not None:
            self._clear = 0
            if self.reason != wanted or self.service.paused != wanted:
                self.reason = wanted
                self.service.pause(wanted)
        elif self.reason is not None:
            self._clear += 1
            if self._clear >= self.clear_checks:
                self._clear = 0
                mine = self.service.paused == self.reason
                self.reason = None
                if mine:
                    self.service.resume()
        return self.reason

    async def _read(self, settings: PauseSettings) -> OwnerReadings:
        wants = wants_for(settings)
        if not wants.any:
            return OwnerReadings()
        try:
            return await asyncio.to_thread(self.probe.read, wants)
        except Exception as exc:
            self._warn_once(f"probe:{type(exc).__name__}",
                            "the owner's pause probe failed (treated as unknown): %s", exc)
            return OwnerReadings()

    def _warn_bad_hours(self, settings: PauseSettings) -> None:
        try:
            parse_active_hours(settings.active_hours)
        except ActiveHoursError as exc:
            self._warn_once(f"hours:{settings.active_hours}", "active_hours ignored: %s", exc)

    def _warn_once(self, key: str, message: str, *args: object) -> None:
        if key in self._warned:
            return
        if len(self._warned) < 64:
            self._warned.add(key)
        log.warning(message, *args)
