"""Owner controls (issue 17): the worker pauses itself when its owner needs the machine (on
battery, another program on the GPU, a full-screen app, outside chosen hours).

``policy`` decides (pure), ``probes`` reads the machine (blocking, run in a thread), ``watcher``
runs the loop beside the link and calls ``WorkerService.pause`` / ``resume`` on changes."""

from desktop_worker.owner.errors import ActiveHoursError, OwnerControlError
from desktop_worker.owner.policy import (
    HourRange,
    OwnerReadings,
    PauseSettings,
    Wants,
    controls_on,
    decide,
    parse_active_hours,
    wants_for,
)
from desktop_worker.owner.probes import (
    FixedProbe,
    NullProbe,
    OwnerProbe,
    SystemProbe,
    default_probe,
)
from desktop_worker.owner.watcher import PauseWatcher

__all__ = [
    "ActiveHoursError",
    "FixedProbe",
    "HourRange",
    "NullProbe",
    "OwnerControlError",
    "OwnerProbe",
    "OwnerReadings",
    "PauseSettings",
    "PauseWatcher",
    "SystemProbe",
    "Wants",
    "controls_on",
    "decide",
    "default_probe",
    "parse_active_hours",
    "wants_for",
]
