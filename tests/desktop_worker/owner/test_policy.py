"""The pause rules, as tables: active hours (overnight, several ranges, bad strings) and
``decide``'s reasons in their fixed order."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import pytest

from desktop_worker.owner import (
    ActiveHoursError,
    OwnerReadings,
    controls_on,
    decide,
    parse_active_hours,
    wants_for,
)
from desktop_worker.owner.policy import active_hours_problem, within_hours
from desktop_worker.settings import WorkerSettings


@dataclass
class Owner:
    pause_on_battery: bool = False
    pause_gpu_busy_pct: int | None = None
    pause_fullscreen: bool = False
    active_hours: str | None = None


def at(hhmm: str) -> datetime:
    hour, minute = (int(x) for x in hhmm.split(":"))
    return datetime(2025, 3, 14, hour, minute)


@pytest.mark.parametrize(("hours", "now", "inside"), [
    ("09:00-17:00", "09:00", True),
    ("09:00-17:00", "16:59", True),
    ("09:00-17:00", "17:00", False),  # the end is not included
    ("09:00-17:00", "08:59", False),
    ("22:00-07:00", "23:30", True),  # overnight
    ("22:00-07:00", "00:00", True),
    ("22:00-07:00", "06:59", True),
    ("22:00-07:00", "07:00", False),
    ("22:00-07:00", "12:00", False),
    ("09:00-12:00,14:00-18:00", "10:00", True),  # several ranges
    ("09:00-12:00,14:00-18:00", "13:00", False),
    ("09:00-12:00, 14:00-18:00", "17:59", True),
    ("18:00-24:00", "23:59", True),  # 24:00 ends a day
    ("18:00-24:00", "00:00", False),
    (" 9:05 - 9:10 ", "09:07", True),  # spaces and one-digit hours
    ("", "03:00", True),  # empty: always
    (None, "03:00", True),
])
def test_active_hours(hours: str | None, now: str, inside: bool) -> None:
    assert within_hours(parse_active_hours(hours), at(now)) is inside


@pytest.mark.parametrize(("bad", "says"), [
    ("9-17", "is not a range of hours"),
    ("09:00", "is not a range of hours"),
    ("25:00-07:00", "hours go from 00:00 to 23:59"),
    ("24:00-07:00", "hours go from 00:00 to 23:59"),  # 24:00 only ends a range
    ("09:60-10:00", "minutes go from 00 to 59"),
    ("09:00-09:00", "starts and ends at the same time"),
    ("00:00-24:00", "starts and ends at the same time"),
    ("09:00-12:00,,14:00-18:00", "an empty range"),
    ("09:00-12:00,", "an empty range"),
    ("always", "is not a range of hours"),
    ("\uff10\uff19:00-10:00", "is not a range of hours"),  # full-width digits
    ("09:00-10:00; 11:00-12:00", "is not a range of hours"),
])
def test_bad_active_hours_are_refused_with_the_form_expected(bad: str, says: str) -> None:
    with pytest.raises(ActiveHoursError, match=says):
        parse_active_hours(bad)
    assert says in (active_hours_problem(bad) or "")
    assert isinstance(ActiveHoursError("x"), ValueError)


def test_a_usable_active_hours_has_no_problem() -> None:
    assert active_hours_problem("22:00-07:00") is None
    assert active_hours_problem("") is None
    assert active_hours_problem(None) is None


BATTERY = OwnerReadings(on_battery=True)
GPU_87 = OwnerReadings(gpu_others_pct=87)
FULL = OwnerReadings(fullscreen=True, fullscreen_app="Foo")
ALL = OwnerReadings(on_battery=True, gpu_others_pct=87, fullscreen=True, fullscreen_app="Foo")


@pytest.mark.parametrize(("readings", "owner", "now", "reason"), [
    (OwnerReadings(), Owner(True, 50, True, "22:00-07:00"), "23:00", None),  # unknown: serve
    (BATTERY, Owner(pause_on_battery=True), "12:00", "on battery"),
    (BATTERY, Owner(pause_on_battery=False), "12:00", None),
    (OwnerReadings(on_battery=False), Owner(pause_on_battery=True), "12:00", None),
    (GPU_87, Owner(pause_gpu_busy_pct=50), "12:00",
     "another program is using the GPU (87% of its memory)"),
    (OwnerReadings(gpu_others_pct=60, gpu_measure="time"), Owner(pause_gpu_busy_pct=50),
     "12:00", "another program is using the GPU (60% of its time)"),
    (OwnerReadings(gpu_others_pct=50), Owner(pause_gpu_busy_pct=50), "12:00", None),  # above
    (GPU_87, Owner(pause_gpu_busy_pct=None), "12:00", None),
    (FULL, Owner(pause_fullscreen=True), "12:00", "a full-screen app is running (Foo)"),
    (OwnerReadings(fullscreen=True), Owner(pause_fullscreen=True), "12:00",
     "a full-screen app is running"),
    (FULL, Owner(pause_fullscreen=False), "12:00", None),
    (OwnerReadings(), Owner(active_hours="22:00-07:00"), "12:00",
     "outside your chosen hours (22:00-07:00)"),
    (OwnerReadings(), Owner(active_hours="22:00-07:00"), "23:00", None),
    (OwnerReadings(), Owner(active_hours="9:00-12:00, 14:00-18:00"), "13:00",
     "outside your chosen hours (09:00-12:00,14:00-18:00)"),
    (OwnerReadings(), Owner(active_hours="garbage"), "03:00", None),  # unreadable: ignored
    # The fixed order: battery, GPU, full-screen, hours.
    (ALL, Owner(True, 50, True, "22:00-07:00"), "12:00", "on battery"),
    (ALL, Owner(False, 50, True, "22:00-07:00"), "12:00",
     "another program is using the GPU (87% of its memory)"),
    (ALL, Owner(False, None, True, "22:00-07:00"), "12:00",
     "a full-screen app is running (Foo)"),
    (ALL, Owner(False, None, False, "22:00-07:00"), "12:00",
     "outside your chosen hours (22:00-07:00)"),
])
def test_decide(readings: OwnerReadings, owner: Owner, now: str, reason: str | None) -> None:
    assert decide(readings, owner, at(now)) == reason


def test_a_reason_fits_the_status_field() -> None:
    """The queen takes at most 200 characters of ``Status.paused``: a long app name is cut."""
    long_name = OwnerReadings(fullscreen=True, fullscreen_app="x" * 5000)
    reason = decide(long_name, Owner(pause_fullscreen=True), at("12:00")) or ""
    assert 0 < len(reason) <= 200


def test_what_the_settings_need_read(tmp_path) -> None:
    defaults = WorkerSettings(models_dir=tmp_path)
    assert wants_for(defaults).battery
    assert not wants_for(defaults).gpu
    assert controls_on(defaults)  # pause on battery is on by default
    off = Owner()
    assert not wants_for(off).any
    assert not controls_on(off)
    hours_only = Owner(active_hours="22:00-07:00")
    assert not wants_for(hours_only).any
    assert controls_on(hours_only)
