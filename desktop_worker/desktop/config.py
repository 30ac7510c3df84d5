"""The settings the desktop app edits, kept as JSON in the config dir.

``settings.json`` lives in ``platformdirs.user_config_dir("apiary")`` (``~/.config/apiary`` on
Linux, ``%LOCALAPPDATA%\\apiary`` on Windows, ``~/Library/Application Support/apiary`` on macOS),
or in ``$APIARY_CONFIG_DIR`` when that is set. ``WorkerSettings`` reads it as a settings source
(``SavedSettingsSource``), so the precedence is: CLI flags > ``APIARY_*`` env > settings.json >
defaults, for the app and ``--headless`` alike.

A file that is not a JSON object is moved aside to ``settings.json.bad`` with a warning and read
as empty; a value in it that is not valid for its setting is skipped with a warning. A bad file
never stops the worker from starting. Saving is atomic (a temp file, then ``os.replace``) and
merges with what is on disk, so saving a few fields keeps the others.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import platformdirs
from pydantic import TypeAdapter, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import PydanticBaseSettingsSource

from desktop_worker.errors import ConfigError

if TYPE_CHECKING:
    from pydantic_settings import BaseSettings

    from desktop_worker.settings import WorkerSettings

__all__ = [
    "APP_EDITABLE_FIELDS",
    "CONFIG_DIR_ENV",
    "SETTINGS_FILE",
    "SavedSettingsSource",
    "config_dir",
    "config_path",
    "load_saved",
    "save_settings",
]

log = logging.getLogger(__name__)

CONFIG_DIR_ENV = "APIARY_CONFIG_DIR"
SETTINGS_FILE = "settings.json"

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
    "first_run_done",
)


def config_dir() -> Path:
    """Where the worker keeps its settings (and, by default, its key file)."""
    override = os.environ.get(CONFIG_DIR_ENV, "").strip()
    if override:
        return Path(override).expanduser()
    return Path(platformdirs.user_config_dir("apiary", appauthor=False))


def config_path() -> Path:
    return config_dir() / SETTINGS_FILE


def load_saved() -> dict[str, Any]:
    """What ``settings.json`` holds, as a dict; ``{}`` when it is missing, unreadable or corrupt.

    A corrupt file (not JSON, or not a JSON object) is moved aside to ``settings.json.bad``
    (replacing an older one), so the next save starts clean and the owner can still look at it.
    """
    path = config_path()
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        log.warning("cannot read the settings file %s (%s); using the defaults", path, exc)
        return {}
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        problem = f"it is not valid JSON ({exc})"
    else:
        if isinstance(data, dict):
            return data
        problem = f"it holds a JSON {type(data).__name__}, not an object"
    bad = path.with_name(path.name + ".bad")
    try:
        os.replace(path, bad)
    except OSError as exc:
        log.warning("the settings file %s is corrupt: %s; ignoring it (could not move it "
                    "aside: %s)", path, problem, exc)
    else:
        log.warning("the settings file %s is corrupt: %s; moved it to %s and using the "
                    "defaults", path, problem, bad)
    return {}


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


class SavedSettingsSource(PydanticBaseSettingsSource):
    """``settings.json`` as a pydantic-settings source, below the environment.

    Each value is checked against its field on its own: an invalid one is dropped with a warning
    (the field falls back to the env or the default) instead of making the settings fail.
    Names that are not settings are ignored.
    """

    def __init__(self, settings_cls: type[BaseSettings]) -> None:
        super().__init__(settings_cls)

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        # Unused: __call__ reads the whole file at once.
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        saved = load_saved()
        if not saved:
            return {}
        fields = self.settings_cls.model_fields
        values: dict[str, Any] = {}
        for name, value in saved.items():
            field = fields.get(name)
            if field is None:
                log.debug("ignoring %r in %s: not a setting", name, config_path())
                continue
            problem = _check_value(field, value)
            if problem is not None:
                log.warning("ignoring %s=%r in %s: %s", name, value, config_path(), problem)
                continue
            values[name] = value
        return values


def _check_value(field: FieldInfo, value: Any) -> str | None:
    """None when ``value`` is valid for ``field`` (type and constraints), else the reason."""
    annotation = field.annotation
    if field.metadata:
        annotation = Annotated[(annotation, *field.metadata)]  # type: ignore[assignment]
    try:
        TypeAdapter(annotation).validate_python(value)
    except ValidationError as exc:
        return exc.errors(include_url=False)[0]["msg"]
    return None
