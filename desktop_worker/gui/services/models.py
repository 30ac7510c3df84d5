"""The model store for the app: list, pull (checked first, in a thread, with progress and
Cancel), import, delete, and disk use against the quota. Reports through signals only."""

from __future__ import annotations

import asyncio
import logging
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from PySide6.QtCore import QObject, Signal

from desktop_worker.errors import DownloadCancelled, HubError, HubOffline, WorkerError
from desktop_worker.gui.services.advice import memory_verdict
from desktop_worker.hardware import HardwareReport
from desktop_worker.settings import WorkerSettings
from desktop_worker.store import ModelStore, PullPlan, PullProgress
from desktop_worker.store.hub import free_bytes
from desktop_worker.store.names import validate_local_name

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DiskUse:
    used_bytes: int
    quota_bytes: int | None
    free_bytes: int


DEFAULT_HUB = "https://huggingface.co"


def plain_pull_error(exc: WorkerError, endpoint: str | None = None) -> str:
    """A store error as an owner reads it: no raw ``[Errno -2] Name or service not known``.
    The hub's address is named, with what to do; other errors are already in plain words."""
    host = urlsplit(endpoint or DEFAULT_HUB).hostname or "the model hub"
    text = str(exc)
    if isinstance(exc, HubOffline):
        if "offline mode" in text:
            return ("offline mode is on (HF_HUB_OFFLINE=1), so nothing can be downloaded; turn "
                    "it off, or use a .gguf file you already have")
        return f"could not reach {host}: check your internet connection, then retry"
    if isinstance(exc, HubError):
        answered = re.search(r"answered (\d{3})", text)
        if answered and answered.group(1).startswith("5"):
            return (f"{host} had a problem (HTTP {answered.group(1)}): try again in a "
                    "while")
        if answered:
            return f"{host} refused the download (HTTP {answered.group(1)})"
    return text


def store_for(settings: WorkerSettings) -> ModelStore:
    quota = int(settings.disk_quota_gb * 1024**3) if settings.disk_quota_gb else None
    return ModelStore(settings.models_dir, quota_bytes=quota, endpoint=settings.hf_endpoint)


class ModelsService(QObject):
    models_changed = Signal(list)  # list[LocalModel]
    disk_changed = Signal(object)  # DiskUse
    progress = Signal(object)  # PullProgress (queued from the download thread)
    pull_started = Signal(str)
    # name, outcome ("done", "cancelled", "refused", "warning", "failed"), message
    pull_finished = Signal(str, str, str)
    busy_changed = Signal(bool)

    def __init__(
        self,
        settings: WorkerSettings,
        hardware: Callable[[], HardwareReport | None],
        parent: QObject | None = None,
    ) -> None:
        super().__init__(parent)
        self.settings = settings
        self._hardware = hardware
        self.store = store_for(settings)
        self._cancel: threading.Event | None = None
        self.pulling: str | None = None
        self.last_message = ""  # what the last pull or import ended with, in plain words

    def apply_settings(self, settings: WorkerSettings) -> None:
        """New folder or quota: a new store over it."""
        self.settings = settings
        if self.pulling is None:
            self.store = store_for(settings)
        self.refresh()

    # --- reading --------------------------------------------------------------------------------

    def refresh(self) -> None:
        self.models_changed.emit(self.store.list())
        self.disk_changed.emit(self.disk_use())

    def disk_use(self) -> DiskUse:
        try:
            free = free_bytes(self.store.root)
        except OSError:
            free = 0
        return DiskUse(self.store.used_bytes, self.store.quota_bytes, free)

    # --- pulling --------------------------------------------------------------------------------

    async def check(self, name: str) -> tuple[PullPlan, str | None]:
        """The pull's plan (disk, quota) and a memory warning, before any download."""
        plan = await asyncio.to_thread(self.store.plan_pull, name)
        cap = getattr(self.settings, "vram_cap_mb", None)
        return plan, memory_verdict(plan.total_bytes, self._hardware(), cap)

    async def pull(self, name: str, *, force: bool = False) -> str:
        """Check, then download ``name``. Returns the outcome also sent by ``pull_finished``:
        ``refused`` (no room on disk), ``warning`` (would not fit in memory; call again with
        ``force``), ``done``, ``cancelled`` (partial kept) or ``failed``."""
        name = name.strip()
        if self.pulling is not None:
            return self._finish(name, "failed", f"{self.pulling} is still downloading")
        self.pulling = name
        self.busy_changed.emit(True)
        try:
            plan, warning = await self.check(name)
            if plan.cached:
                return self._finish(name, "done", f"{name} is already here")
            if plan.problem:
                return self._finish(name, "refused", plan.problem)
            if warning and not force:
                return self._finish(name, "warning", f"{name} {warning}")
            self._cancel = threading.Event()
            self.pull_started.emit(name)
            model = await asyncio.to_thread(self.store.pull, name, self.progress.emit,
                                            self._cancel)
            return self._finish(name, "done", f"{model.name} is ready ({model.path.name})")
        except DownloadCancelled:
            return self._finish(name, "cancelled",
                                "download cancelled; what was downloaded is kept for next time")
        except WorkerError as exc:
            log.info("pulling %s failed: %s", name, exc)  # the raw reason, for the Logs tab
            return self._finish(name, "failed", plain_pull_error(exc, self.settings.hf_endpoint))
        except Exception as exc:  # never let a download take the app down
            log.exception("pulling %s failed", name)
            return self._finish(name, "failed", f"{type(exc).__name__}: {exc}")
        finally:
            self.pulling = None
            self._cancel = None
            self.busy_changed.emit(False)

    def cancel(self) -> None:
        if self._cancel is not None:
            self._cancel.set()

    def _finish(self, name: str, outcome: str, message: str) -> str:
        log.log(logging.WARNING if outcome in ("failed", "refused") else logging.INFO,
                "model %s: %s", outcome, message)
        self.last_message = message
        self.pull_finished.emit(name, outcome, message)
        self.refresh()
        return outcome

    # --- importing and deleting -----------------------------------------------------------------

    async def import_file(self, path: Path, name: str | None = None) -> str | None:
        """Copy a local .gguf into the store (hashing in a thread). Returns an error or None."""
        try:
            name = validate_local_name(name or Path(path).stem)
            await asyncio.to_thread(self.store.import_file, Path(path), name)
        except WorkerError as exc:
            self.pull_finished.emit(name or str(path), "failed", str(exc))
            return str(exc)
        self.pull_finished.emit(name, "done", f"imported {Path(path).name} as {name}")
        self.refresh()
        return None

    async def remove(self, name: str) -> str | None:
        try:
            await asyncio.to_thread(self.store.remove, name)
        except WorkerError as exc:
            return str(exc)
        finally:
            self.refresh()
        return None


def progress_fraction(progress: PullProgress) -> float | None:
    if not progress.total_bytes:
        return None
    return min(1.0, progress.downloaded_bytes / progress.total_bytes)
