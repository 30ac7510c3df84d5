"""When the worker should pause for its owner: pure rules, no I/O.

``decide`` turns what the probes read (``OwnerReadings``) and the owner's settings into the
reason to pause, in plain words for the tray and the queen, or None to serve. The reasons are
tried in a fixed order (battery, GPU, full-screen app, hours) so the one shown is stable when
several apply. Anything a probe could not read is unknown (None) and never pauses: a machine
where a reading is unsupported keeps earning rather than pausing forever.

``active_hours`` is local time, ``"HH:MM-HH:MM"`` ranges separated by commas; a range whose end
is before its start runs overnight ("22:00-07:00"); "24:00" may end a range.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

from desktop_worker.owner.errors import ActiveHoursError

MINUTES_PER_DAY = 24 * 60
EXAMPLE = "22:00-07:00, or 09:00-12:00,14:00-18:00"
_RANGE = re.compile(r"^([0-9]{1,2}):([0-9]{2})\s*-\s*([0-9]{1,2}):([0-9]{2})$")


class PauseSettings(Protocol):
    """The settings the rules read (``WorkerSettings`` has them all)."""

    pause_on_battery: bool
    pause_gpu_busy_pct: int | None
    pause_fullscreen: bool
    active_hours: str | None


@dataclass(frozen=True)
class OwnerReadings:
    """What the probes read; None is unknown (unsupported, or the probe failed).

    ``gpu_others_pct`` is the largest share (0-100) of one GPU that other processes use:
    of its memory (``gpu_measure == "memory"``) or, where NVML cannot say how much memory each
    process holds, of its time (``"time"``: only when this process is not on that GPU)."""

    on_battery: bool | None = None
    gpu_others_pct: int | None = None
    gpu_measure: str = "memory"
    fullscreen: bool | None = None
    fullscreen_app: str | None = None


@dataclass(frozen=True)
class Wants:
    """Which readings the settings need, so a probe reads nothing it need not (NVML, xprop)."""

    battery: bool = False
    gpu: bool = False
    fullscreen: bool = False

    @property
    def any(self) -> bool:
        return self.battery or self.gpu or self.fullscreen


def wants_for(settings: PauseSettings) -> Wants:
    return Wants(battery=settings.pause_on_battery,
                 gpu=settings.pause_gpu_busy_pct is not None,
                 fullscreen=settings.pause_fullscreen)


def controls_on(settings: PauseSettings) -> bool:
    """Whether any owner control is on (else the worker needs no watcher at all)."""
    return wants_for(settings).any or bool((settings.active_hours or "").strip())


@dataclass(frozen=True)
class HourRange:
    """``start`` to ``end`` in minutes after local midnight; overnight when end <= start."""

    start: int
    end: int

    def contains(self, minute: int) -> bool:
        if self.start < self.end:
            return self.start <= minute < self.end
        return minute >= self.start or minute < self.end

    def __str__(self) -> str:
        return f"{_clock(self.start)}-{_clock(self.end)}"


def _clock(minutes: int) -> str:
    return f"{minutes // 60:02d}:{minutes % 60:02d}"


def parse_active_hours(text: str | None) -> tuple[HourRange, ...] | None:
    """The ranges of ``text``; None when it is empty (always active). Raises
    ``ActiveHoursError`` saying what is wrong and the form expected."""
    if text is None or not text.strip():
        return None
    ranges = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            raise ActiveHoursError(f"an empty range in {text.strip()!r}: write {EXAMPLE}")
        ranges.append(_parse_range(part))
    return tuple(ranges)


def _parse_range(part: str) -> HourRange:
    match = _RANGE.match(part)
    if match is None:
        raise ActiveHoursError(f"{part!r} is not a range of hours: write {EXAMPLE}")
    h1, m1, h2, m2 = (int(g) for g in match.groups())
    start = _minutes(h1, m1, part, may_be_24=False)
    end = _minutes(h2, m2, part, may_be_24=True) % MINUTES_PER_DAY
    if start == end:
        raise ActiveHoursError(f"{part!r} starts and ends at the same time: leave the hours "
                               "empty to serve all day")
    return HourRange(start, end)


def _minutes(hour: int, minute: int, part: str, *, may_be_24: bool) -> int:
    if minute > 59:
        raise ActiveHoursError(f"{part!r}: minutes go from 00 to 59")
    if hour > 23 and not (may_be_24 and hour == 24 and minute == 0):
        raise ActiveHoursError(f"{part!r}: hours go from 00:00 to 23:59 (24:00 may end a range)")
    return hour * 60 + minute


def active_hours_problem(text: str | None) -> str | None:
    """None when ``text`` is usable (empty included), else why not: the settings form shows
    this as the owner types."""
    try:
        parse_active_hours(text)
    except ActiveHoursError as exc:
        return str(exc)
    return None


def within_hours(ranges: tuple[HourRange, ...] | None, now_local: datetime) -> bool:
    if ranges is None:
        return True
    minute = now_local.hour * 60 + now_local.minute
    return any(r.contains(minute) for r in ranges)


def decide(readings: OwnerReadings, settings: PauseSettings, now_local: datetime) -> str | None:
    """Why to pause now, in plain words, or None to serve: the first of battery, GPU,
    full-screen app and hours that applies. Unknown readings never pause. Active hours that
    cannot be read are ignored here (the watcher warns about them once)."""
    if settings.pause_on_battery and readings.on_battery:
        return "on battery"
    threshold = settings.pause_gpu_busy_pct
    used = readings.gpu_others_pct
    if threshold is not None and used is not None and used > threshold:
        of = "its memory" if readings.gpu_measure == "memory" else "its time"
        return f"another program is using the GPU ({used}% of {of})"
    if settings.pause_fullscreen and readings.fullscreen:
        app = (readings.fullscreen_app or "").strip()
        return f"a full-screen app is running ({app[:60]})" if app \
            else "a full-screen app is running"
    try:
        ranges = parse_active_hours(settings.active_hours)
    except ActiveHoursError:
        ranges = None
    if not within_hours(ranges, now_local):
        shown = ",".join(str(r) for r in ranges or ())
        return f"outside your chosen hours ({shown})"
    return None
