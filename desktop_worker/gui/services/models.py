"""The model store for the app: list, pull (checked first, in a thread, with progress and
Cancel), import, delete, and disk use against the quota. Reports through signals only.

It also keeps the "In demand" list (issue 17): the queen's latest ``Demand``, this worker's
measured speed (``SpeedMeter``, fed with the jobs it finishes) and the rows
``services/demand.py`` makes of them, as a ``DemandTableModel`` the Models tab shows (testable
without a window). ``fetch_demand`` asks a queen for its demand over HTTP (the first-run
wizard, before any worker session).

For the first-run wizard (issue 35): ``hub_problem`` says whether anything can be downloaded now
(the small model that comes with Apiary goes first when not), and ``demand_name_for`` finds the
hub name under which the queen's demand lists a local file (by sha256), to import it under."""

from __future__ import annotations

import asyncio
import logging
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
from huggingface_hub import constants as hub_constants
from pydantic import ValidationError
from PySide6.QtCore import (
    QAbstractTableModel,
    QModelIndex,
    QObject,
    QPersistentModelIndex,
    Qt,
    Signal,
)

from desktop_worker.earnings import queen_http_url
from desktop_worker.errors import DownloadCancelled, HubError, HubOffline, WorkerError
from desktop_worker.gui.common import size
from desktop_worker.gui.services.advice import memory_verdict
from desktop_worker.gui.services.demand import (
    DemandRow,
    SpeedMeter,
    demand_rows,
    hub_name_of,
    pinned_candidates,
)
from desktop_worker.hardware import HardwareReport
from desktop_worker.jobs import JobRecord
from desktop_worker.settings import WorkerSettings
from desktop_worker.store import LocalModel, PullPlan, PullProgress, store_for
from desktop_worker.store.hub import free_bytes, resolve_endpoint, sha256_file
from desktop_worker.store.names import validate_local_name
from shared_schema import Demand

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DiskUse:
    used_bytes: int
    quota_bytes: int | None
    free_bytes: int


DEFAULT_HUB = "https://huggingface.co"
HUB_CHECK_TIMEOUT_S = 3.0  # the wizard's "can anything be downloaded now?"


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


class ModelsService(QObject):
    models_changed = Signal(list)  # list[LocalModel]
    disk_changed = Signal(object)  # DiskUse
    progress = Signal(object)  # PullProgress (queued from the download thread)
    pull_started = Signal(str)
    # name, outcome ("done", "cancelled", "refused", "warning", "failed"), message
    pull_finished = Signal(str, str, str)
    busy_changed = Signal(bool)
    demand_changed = Signal(list)  # list[DemandRow]: the "In demand" list, best first

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
        self.demand: Demand | None = None  # the queen's latest
        self.speed = SpeedMeter()
        self.demand_rows: list[DemandRow] = []

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
        self.update_demand()

    # --- demand (issue 17) ----------------------------------------------------------------------

    def set_demand(self, demand: Demand) -> None:
        """The queen's demand (each ``WorkerController.demand_changed``)."""
        self.demand = demand
        self.refresh()  # the swarm's own choices may have changed the store meanwhile

    def record_job(self, record: JobRecord) -> None:
        """A finished job: its speed, on the model's file size, measures this worker."""
        model = next((m for m in self.store.list() if m.name == record.model), None)
        size_bytes = model.size_bytes if model is not None else None
        if self.speed.record(record.completion_tokens, record.seconds, size_bytes,
                             record.outcome):
            self.update_demand()

    def update_demand(self) -> None:
        """Recompute the "In demand" rows (hardware, models held, room, speed may change)."""
        loaded: set[str] = set()
        try:
            room = self.store.room_bytes(loaded, evict=True)
        except OSError:
            room = None
        held = {m.name: m.sha256 for m in self.store.list()}
        self.demand_rows = demand_rows(self.demand, self._hardware(),
                                       cap_mb=getattr(self.settings, "vram_cap_mb", None),
                                       held=held, room_bytes=room, speed=self.speed)
        self.demand_changed.emit(self.demand_rows)

    def demand_row(self, name: str) -> DemandRow | None:
        return next((r for r in self.demand_rows if r.name == name), None)

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

    async def pull(self, name: str, *, force: bool = False, revision: str | None = None,
                   expect_sha256: str | None = None) -> str:
        """Check, then download ``name``. Returns the outcome also sent by ``pull_finished``:
        ``refused`` (no room on disk), ``warning`` (would not fit in memory; call again with
        ``force``), ``done``, ``cancelled`` (partial kept) or ``failed``. ``revision`` and
        ``expect_sha256``: the commit and file the queen pinned the name to (an in-demand
        model), so that the copy is the one the queen routes to."""
        name = name.strip()
        if self.pulling is not None:
            return self._finish(name, "failed", f"{self.pulling} is still downloading")
        self.pulling = name
        self.busy_changed.emit(True)
        try:
            plan, warning = await self.check(name)
            held = next((m for m in self.store.list() if m.name == name), None)
            if plan.cached and (expect_sha256 is None or held is None
                                or held.sha256 == expect_sha256):
                return self._finish(name, "done", f"{name} is already here")
            if plan.problem:
                return self._finish(name, "refused", plan.problem)
            if warning and not force:
                return self._finish(name, "warning", f"{name} {warning}")
            self._cancel = threading.Event()
            self.pull_started.emit(name)
            model = await asyncio.to_thread(self.store.pull, name, self.progress.emit,
                                            self._cancel, revision=revision,
                                            expect_sha256=expect_sha256)
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
        """Copy a local .gguf into the store (hashing in a thread). Returns an error or None.
        The same file imported under the same name before (the wizard run again with the
        model that comes with Apiary, say) is already here: nothing is copied."""
        try:
            name = validate_local_name(name or Path(path).stem)
            if self._imported_before(Path(path), name):
                self.pull_finished.emit(name, "done", f"{name} is already here")
                return None
            await asyncio.to_thread(self.store.import_file, Path(path), name)
        except WorkerError as exc:
            self.pull_finished.emit(name or str(path), "failed", str(exc))
            return str(exc)
        self.pull_finished.emit(name, "done", f"imported {Path(path).name} as {name}")
        self.refresh()
        return None

    def _imported_before(self, path: Path, name: str) -> bool:
        held = next((m for m in self.store.list() if m.name == name), None)
        if held is None or held.source != "import":
            return False
        try:
            return held.origin == str(path.resolve()) and held.size_bytes == path.stat().st_size
        except OSError:
            return False

    async def hub_problem(self, timeout_s: float = HUB_CHECK_TIMEOUT_S) -> str | None:
        """Why nothing can be downloaded now, in plain words, or None when the hub answers
        (any HTTP answer will do: a HEAD of its address). Offline mode (HF_HUB_OFFLINE=1) is
        told without asking anything."""
        endpoint = resolve_endpoint(self.settings.hf_endpoint)
        host = urlsplit(endpoint).hostname or "the model hub"
        if hub_constants.HF_HUB_OFFLINE:
            return "offline mode is on (HF_HUB_OFFLINE=1)"
        try:
            async with httpx.AsyncClient(timeout=timeout_s) as client:
                await client.head(endpoint + "/")
        except httpx.HTTPError as exc:
            log.info("the model hub %s cannot be reached: %r", endpoint, exc)
            return f"{host} cannot be reached from this computer"
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


def provenance(model: LocalModel) -> tuple[str, str, str]:
    """Where a model came from, as (repo, file, commit): a hub pull's origin is
    ``repo@commit:path``; an import's is the file it was copied from."""
    origin = model.origin or ""
    repo, at, rest = origin.partition("@")
    commit, colon, path = rest.partition(":")
    if model.source == "hub" and at and colon:
        return repo, path, commit
    if model.source == "hub":  # pulled before the store recorded where from
        return model.name.partition(":")[0], model.path.name, ""
    return ("imported", origin or model.path.name, "")


# --- the queen's demand over HTTP (the wizard) ------------------------------------------------


async def demand_name_for(path: Path, demand: Demand | None) -> str | None:
    """The hub name under which the queen's ``demand`` lists the local file at ``path`` (the
    same sha256; ``services.demand.hub_name_of``), or None. The file is hashed (in a thread)
    only when a pinned model of the demand has its size."""
    return await asyncio.to_thread(_demand_name_for, path, demand)


def _demand_name_for(path: Path, demand: Demand | None) -> str | None:
    try:
        size_bytes = path.stat().st_size
        if not pinned_candidates(demand, size_bytes):
            return None
        sha256 = sha256_file(path)
    except OSError as exc:
        log.info("could not read %s: %s", path, exc)
        return None
    return hub_name_of(demand, sha256, size_bytes)


DEMAND_TIMEOUT_S = 5.0
MAX_DEMAND_BYTES = 1 << 20


async def fetch_demand(queen_url: str, *, timeout_s: float = DEMAND_TIMEOUT_S,
                       client: httpx.AsyncClient | None = None) -> Demand | None:
    """``GET <queen>/worker/demand``: the queen's ``Demand``, or None when it has none to give
    (an older queen answers 404, one out of reach or answering nonsense is logged): the caller
    falls back to the built-in list. Never raises for the queen's sake."""
    try:
        url = queen_http_url(queen_url) + "/worker/demand"
    except ValueError:
        return None
    try:
        if client is None:
            async with httpx.AsyncClient(timeout=timeout_s) as own:
                response = await own.get(url)
        else:
            response = await client.get(url, timeout=timeout_s)
    except httpx.HTTPError as exc:
        log.info("no demand from %s: %s", url, exc)
        return None
    if response.status_code != 200:
        log.info("no demand from %s: it answered %s (an older queen?)", url,
                 response.status_code)
        return None
    if len(response.content) > MAX_DEMAND_BYTES:
        log.warning("the demand from %s is too large (%d bytes); ignored", url,
                    len(response.content))
        return None
    try:
        return Demand.model_validate_json(response.content)
    except ValidationError as exc:
        log.warning("the demand from %s is unreadable: %s", url, exc)
        return None


# --- the "In demand" table ----------------------------------------------------------------------

DEMAND_COLUMNS = ("Model", "Demand", "Size", "Memory", "Estimate", "")
ADD_COLUMN = len(DEMAND_COLUMNS) - 1  # the view puts a one-click Add button there
Index = QModelIndex | QPersistentModelIndex


class DemandTableModel(QAbstractTableModel):
    """The "In demand" rows as a Qt table (QtCore only: tested without a window)."""

    def __init__(self, parent: Any = None) -> None:
        super().__init__(parent)
        self.rows: list[DemandRow] = []

    def set_rows(self, rows: list[DemandRow]) -> None:
        self.beginResetModel()
        self.rows = list(rows)
        self.endResetModel()

    def names(self) -> list[str]:
        return [r.name for r in self.rows]

    def cell(self, name: str, column: str) -> str | None:
        """What the table shows for ``name`` under the heading ``column``."""
        row = next((r for r in self.rows if r.name == name), None)
        return None if row is None else self._text(row, DEMAND_COLUMNS.index(column))

    def rowCount(self, parent: Index = QModelIndex()) -> int:  # noqa: B008 (Qt's signature)
        return 0 if parent.isValid() else len(self.rows)

    def columnCount(self, parent: Index = QModelIndex()) -> int:  # noqa: B008
        return 0 if parent.isValid() else len(DEMAND_COLUMNS)

    def headerData(self, section: int, orientation: Qt.Orientation,
                   role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if (orientation == Qt.Orientation.Horizontal and role == Qt.ItemDataRole.DisplayRole
                and 0 <= section < len(DEMAND_COLUMNS)):
            return DEMAND_COLUMNS[section]
        return None

    @staticmethod
    def _text(row: DemandRow, column: int) -> str:
        d = row.demand
        if column == 0:
            return row.name
        if column == 1:
            return row.line
        if column == 2:
            return size(d.size_bytes) if d.size_bytes is not None else "?"
        if column == 3:
            return f"{row.need_mb:,} MB"
        if column == 4:
            return row.estimate
        return ""

    def data(self, index: Index, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if not index.isValid() or not 0 <= index.row() < len(self.rows):
            return None
        row, column = self.rows[index.row()], index.column()
        if role == Qt.ItemDataRole.DisplayRole:
            return self._text(row, column)
        if role == Qt.ItemDataRole.TextAlignmentRole and column in (2, 3, 4):
            return Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter
        if role == Qt.ItemDataRole.ToolTipRole:
            if column == 4:
                return row.estimate_tip
            d = row.demand
            pin = f"\ncommit {d.revision}" if d.revision else ""
            pin += f"\nsha256 {d.sha256}" if d.sha256 else ""
            return f"{row.name}{pin}"
        return None
