"""The owner's settings: validated, saved to ``settings.json`` (``desktop/config.py``), and
announced to the rest of the app; "Run at login" goes through ``desktop/autostart.py``.

``classify_changes`` says what a save means for a running worker: the queen and the payout
address apply at once (the app reconnects), the store and engine settings when earning
restarts, the rest at the next launch or right away (run at login). The owner's pause
settings and the models opt-ins (issue 17) apply when earning restarts too: the service reads
them when it is built (the hello carries the opt-ins; the pause watcher starts with it). So
do the model-group switches (issue 19, ``join_groups`` and ``lan_groups``): the hello says
``rpc`` and the gates choose where to listen when earning starts."""

from __future__ import annotations

import logging
from typing import Any, Protocol

from pydantic import ValidationError
from PySide6.QtCore import QObject, Signal

from desktop_worker.desktop.config import save_settings
from desktop_worker.errors import WorkerError
from desktop_worker.owner.policy import active_hours_problem
from desktop_worker.settings import WorkerSettings

log = logging.getLogger(__name__)


# Applied to a running worker at once: the app reconnects (the hello carries both).
LIVE_FIELDS = ("queen_url", "ln_url")
# Applied when earning restarts: the model store and the engine are built per Start.
RESTART_FIELDS = ("models_dir", "disk_quota_gb", "vram_cap_mb", "threads",
                  "pause_on_battery", "pause_gpu_busy_pct", "pause_fullscreen", "active_hours",
                  "accept_fetch", "swarm_models", "join_groups", "lan_groups")
# How each field that applies at restart is named to the owner.
RESTART_NAMES = {
    "models_dir": "the models folder",
    "disk_quota_gb": "the disk quota",
    "vram_cap_mb": "the VRAM cap",
    "threads": "CPU threads",
    "pause_on_battery": "pausing on battery",
    "pause_gpu_busy_pct": "the GPU threshold",
    "pause_fullscreen": "pausing for full-screen apps",
    "active_hours": "your hours",
    "accept_fetch": "models placed by the queen",
    "swarm_models": "models chosen by the swarm",
    "join_groups": "helping run big models",
    "lan_groups": "direct connections on your home network",
}


def classify_changes(old: WorkerSettings, new: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(live, on restart): the names in ``new`` whose values differ from ``old``'s, split by
    when they can take effect on a running worker."""
    changed = [name for name, value in new.items() if getattr(old, name, None) != value]
    return ([n for n in changed if n in LIVE_FIELDS],
            [n for n in changed if n in RESTART_FIELDS])


class AutostartLike(Protocol):
    def is_enabled(self) -> bool: ...
    def set_enabled(self, enabled: bool) -> None: ...


def validation_message(exc: ValidationError) -> str:
    first = exc.errors(include_url=False)[0]
    where = ".".join(str(part) for part in first.get("loc", ())) or "value"
    return f"{where.replace('_', ' ')}: {first['msg']}"


class SettingsService(QObject):
    changed = Signal(object)  # WorkerSettings

    def __init__(
        self,
        settings: WorkerSettings,
        autostart: AutostartLike | None = None,
        parent: QObject | None = None,
    ) -> None:
        super().__init__(parent)
        self.settings = settings
        self.autostart = autostart

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
        save_settings(updated)
        self.settings = updated
        self.changed.emit(updated)
        return updated

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
