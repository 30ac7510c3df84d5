"""The owner's settings: validated, saved to ``settings.json`` (``desktop/config.py``), and
announced to the rest of the app; "Run at login" goes through ``desktop/autostart.py``.

``classify_changes`` says what a save means for a running worker: the queen and the payout
address apply at once (the app reconnects), the store and engine settings when earning
restarts, the rest at the next launch or right away (run at login). The owner's pause
settings and the models opt-ins (issue 17) apply when earning restarts too: the service reads
them when it is built (the hello carries the opt-ins; the pause watcher starts with it). So
do the model-group switches (issue 19, ``join_groups`` and ``lan_groups``): the hello says
``rpc`` and the gates choose where to listen when earning starts.

The volunteer's disk (issue 34): a save with no quota chosen yet (``disk_quota_gb`` None) saves
the default, half the free space of the models folder's disk (``default_quota_gb``), so the quota
is chosen once and does not drift; 0 is "no quota". ``disk_headroom_gb`` (None: 10 % of the disk,
10-50 GB) is saved beside the app's fields. ``quota_gb`` and ``headroom_gb`` are what the
wizard and the Settings tab show.

Jobs at once (issue 36, ``max_jobs``): None is automatic (each model's batch holds as many jobs
as memory allows, up to ``MAX_BATCH_SLOTS``), else the owner's number; it is saved beside the
app's fields and applies when earning restarts (the worker's pool is built per Start).
``jobs_choices`` lists what the Settings tab offers, keeping a larger number a config file set.

Start at launch (issue 35): the owner's last word wins. The wizard's Start Earning and a Start
from the header or the tray turn ``start_earning_at_launch`` on, a Stop from them turns it off
(``remember_start_at_launch``: that one field saved alone, announced by ``at_launch_changed``
so the Settings checkbox shows it without losing the owner's unsaved edits there)."""

from __future__ import annotations

import logging
from typing import Any, Protocol

from pydantic import ValidationError
from PySide6.QtCore import QObject, Signal

from desktop_worker.desktop.config import APP_EDITABLE_FIELDS, save_settings
from desktop_worker.errors import WorkerError
from desktop_worker.link_probe import ProbeResult
from desktop_worker.owner.policy import active_hours_problem
from desktop_worker.settings import WorkerSettings
from desktop_worker.store.disk import (
    GIB,
    DiskProbe,
    LocalDisk,
    default_headroom_bytes,
    default_quota_gb,
)
from shared_schema.fitting import MAX_BATCH_SLOTS

log = logging.getLogger(__name__)

# What the app saves: the fields it edits, the disk's headroom (issue 34) and jobs at once
# (issue 36).
SAVED_FIELDS = tuple(dict.fromkeys((*APP_EDITABLE_FIELDS, "disk_headroom_gb", "max_jobs")))


# Applied to a running worker at once: the app reconnects (the hello carries both).
LIVE_FIELDS = ("queen_url", "ln_url")
# Applied when earning restarts: the model store and the engine are built per Start.
RESTART_FIELDS = ("models_dir", "disk_quota_gb", "disk_headroom_gb", "vram_cap_mb", "threads",
                  "max_jobs",
                  "pause_on_battery", "pause_gpu_busy_pct", "pause_fullscreen", "active_hours",
                  "accept_fetch", "swarm_models", "train", "train_on_gpu", "images", "join_groups",
                  "lan_groups", "group_family")
# How each field that applies at restart is named to the owner.
RESTART_NAMES = {
    "models_dir": "the models folder",
    "disk_quota_gb": "the disk quota",
    "disk_headroom_gb": "the space always left free",
    "vram_cap_mb": "the VRAM cap",
    "threads": "CPU threads",
    "max_jobs": "jobs at once",
    "pause_on_battery": "pausing on battery",
    "pause_gpu_busy_pct": "the GPU threshold",
    "pause_fullscreen": "pausing for full-screen apps",
    "active_hours": "your hours",
    "accept_fetch": "models placed by the queen",
    "swarm_models": "models chosen by the swarm",
    "train": "fine-tuning jobs",
    "train_on_gpu": "fine-tuning on the GPU",
    "images": "making images",
    "join_groups": "helping run big models",
    "lan_groups": "direct connections on your home network",
    "group_family": "big models with your own machines only",
}


AUTOMATIC_JOBS = f"Automatic (as memory allows, up to {MAX_BATCH_SLOTS})"
JOBS_HINT = ("More jobs at once earn more per hour on a GPU; each job then runs a little "
             "slower.")


def jobs_choices(current: int | None) -> list[tuple[str, int | None]]:
    """The "Jobs at once" choices, (text, ``max_jobs``): automatic first, then 1 to
    ``MAX_BATCH_SLOTS``, and ``current`` after them when a config file set more (kept as it
    is, shown as its number)."""
    choices: list[tuple[str, int | None]] = [(AUTOMATIC_JOBS, None)]
    choices += [(str(n), n) for n in range(1, MAX_BATCH_SLOTS + 1)]
    if current is not None and current > MAX_BATCH_SLOTS:
        choices.append((str(current), current))
    return choices


def classify_changes(old: WorkerSettings, new: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(live, on restart): the names in ``new`` whose values differ from ``old``'s, split by
    when they can take effect on a running worker."""
    changed = [name for name, value in new.items() if getattr(old, name, None) != value]
    return ([n for n in changed if n in LIVE_FIELDS],
            [n for n in changed if n in RESTART_FIELDS])


def probe_verdict(outcome: ProbeResult) -> tuple[bool, str]:
    """Test connection's line under the queen URL: whether it worked, and the handshake's own
    plain words after a tick or a cross."""
    return outcome.ok, ("✓ " if outcome.ok else "✗ ") + outcome.message


class AutostartLike(Protocol):
    def is_enabled(self) -> bool: ...
    def set_enabled(self, enabled: bool) -> None: ...


def validation_message(exc: ValidationError) -> str:
    first = exc.errors(include_url=False)[0]
    where = ".".join(str(part) for part in first.get("loc", ())) or "value"
    return f"{where.replace('_', ' ')}: {first['msg']}"


class SettingsService(QObject):
    changed = Signal(object)  # WorkerSettings
    at_launch_changed = Signal(bool)  # start_earning_at_launch, after a Start or Stop

    def __init__(
        self,
        settings: WorkerSettings,
        autostart: AutostartLike | None = None,
        parent: QObject | None = None,
        *,
        disk: DiskProbe | None = None,
    ) -> None:
        """``disk`` reads the models folder's disk (a fake in tests)."""
        super().__init__(parent)
        self.settings = settings
        self.autostart = autostart
        self.disk: DiskProbe = disk or LocalDisk()

    def quota_gb(self, settings: WorkerSettings | None = None) -> float:
        """The quota to show: the one chosen (0: none), else the default a save would choose."""
        chosen = (settings or self.settings).disk_quota_gb
        if chosen is not None:
            return chosen
        return default_quota_gb(self.disk.usage((settings or self.settings).models_dir)
                                .free_bytes)

    def headroom_gb(self, settings: WorkerSettings | None = None) -> float:
        """The space always left free on the models folder's disk: the owner's, else the
        default for that disk (10 % of the disk, 10-50 GB), in GB."""
        current = settings or self.settings
        if current.disk_headroom_gb is not None:
            return current.disk_headroom_gb
        return default_headroom_bytes(self.disk.usage(current.models_dir).total_bytes) / GIB

    def update(self, **changes: Any) -> WorkerSettings:
        """Validate ``changes`` over the current settings, save them and announce them.
        Raises ``WorkerError`` with a readable reason (nothing is saved then)."""
        hours = changes.get("active_hours")
        problem = active_hours_problem(hours) if isinstance(hours, str) else None
        if problem is not None:
            raise WorkerError(f"Active hours: {problem}")
        if isinstance(hours, str) and not hours.strip():
            changes = {**changes, "active_hours": None}
        values = self.settings.model_dump()
        values.update(changes)
        try:
            updated = WorkerSettings(**values)
        except ValidationError as exc:
            raise WorkerError(validation_message(exc)) from exc
        if updated.disk_quota_gb is None:  # chosen once, at the first save: it must not drift
            updated = updated.model_copy(update={"disk_quota_gb": self.quota_gb(updated)})
            log.info("the disk quota for models is now %.0f GB (half the free disk)",
                     updated.disk_quota_gb)
        save_settings(updated, SAVED_FIELDS)
        self.settings = updated
        self.changed.emit(updated)
        return updated

    def remember_start_at_launch(self, on: bool) -> None:
        """Save whether earning starts when the app opens (the owner's Start: on, Stop: off),
        that field alone. Raises ``WorkerError`` when it cannot be saved."""
        if self.settings.start_earning_at_launch == on:
            return
        updated = self.settings.model_copy(update={"start_earning_at_launch": on})
        save_settings(updated, ("start_earning_at_launch",))
        self.settings = updated
        log.info("earning %s when Apiary opens", "starts" if on else "does not start")
        self.at_launch_changed.emit(on)

    def run_at_login(self) -> bool:
        if self.autostart is None:
            return False
        try:
            return self.autostart.is_enabled()
        except OSError as exc:
            log.warning("cannot read the run-at-login setting: %s", exc)
            return False

    def set_run_at_login(self, enabled: bool) -> None:
        if self.autostart is None:
            raise WorkerError("run at login is not supported on this system")
        try:
            self.autostart.set_enabled(enabled)
        except OSError as exc:
            raise WorkerError(f"cannot change run at login: {exc}") from exc
