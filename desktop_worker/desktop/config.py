"""Saving the settings the desktop app edits to ``settings.json``.

Reading the file (where it lives, what a damaged one reads as, and its place under flags and
env) belongs to ``desktop_worker.settings``, since the headless worker reads it too; only the app
writes it. Saving is atomic (a temp file, then ``os.replace``) and merges with what is on disk,
so saving a few fields keeps the others, including settings a newer app wrote.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from desktop_worker.errors import ConfigError
from desktop_worker.settings import WorkerSettings, config_path, load_saved

__all__ = ["APP_EDITABLE_FIELDS", "save_settings"]

log = logging.getLogger(__name__)

#: The fields the app's settings page and first-run wizard edit: what ``save_settings`` writes
#: unless told otherwise.
APP_EDITABLE_FIELDS: tuple[str, ...] = (
    "queen_url",
    "ln_url",
    "models",
    "models_dir",
    "disk_quota_gb",
    "vram_cap_mb",
    "threads",
    "start_earning_at_launch",
    "accept_fetch",
    "swarm_models",
    "train",
    "images",
    "pause_on_battery",
    "pause_gpu_busy_pct",
    "pause_fullscreen",
    "active_hours",
    "join_groups",
    "lan_groups",
    "group_family",
    "first_run_done",
)


def save_settings(settings: WorkerSettings, fields: Iterable[str] | None = None) -> Path:
    """Write ``fields`` of ``settings`` (default: ``APP_EDITABLE_FIELDS``) to ``settings.json``,
    keeping whatever else the file holds. Returns the file's path. Raises ``ConfigError`` for an
    unknown field name or when the file cannot be written (the old file is then left intact)."""
    names = list(APP_EDITABLE_FIELDS if fields is None else fields)
    known = type(settings).model_fields
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ConfigError(f"cannot save unknown settings: {', '.join(sorted(unknown))}")
    merged = load_saved()
    merged.update(settings.model_dump(mode="json", include=set(names)))
    path = config_path()
    text = json.dumps(merged, indent=2, sort_keys=True) + "\n"
    try:
        _write_atomically(path, text)
    except OSError as exc:
        raise ConfigError(f"cannot save the settings to {path}: {exc}") from exc
    log.info("saved %s to %s", ", ".join(names), path)
    return path


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
