"""Start and stop earning: ``WorkerController`` runs a ``WorkerService`` on the app's event loop
and turns the link's and the job runner's callbacks into Qt signals.

The tray state is a pure function of the link state and the number of jobs in flight
(``tray_state``). Log records from any thread reach the Logs tab through ``LogBridge``, a
``logging.Handler`` whose signal Qt queues onto the GUI thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from PySide6.QtCore import QObject, Signal

from desktop_worker.errors import HandshakeRefusedError, WorkerError
from desktop_worker.hardware import HardwareReport
from desktop_worker.jobs import JobRecord
from desktop_worker.service import Detector, WorkerService
from desktop_worker.settings import WorkerSettings
from desktop_worker.store import ModelStore
from shared_schema import Job

log = logging.getLogger(__name__)


class TrayState(StrEnum):
    STOPPED = "stopped"
    CONNECTING = "connecting"
    IDLE = "idle"
    WORKING = "working"
    ERROR = "error"


STATE_TEXT = {
    TrayState.STOPPED: "Not earning",
    TrayState.CONNECTING: "Connecting…",
    TrayState.IDLE: "Earning: waiting for jobs",
    TrayState.WORKING: "Earning: serving a job",
    TrayState.ERROR: "Needs attention",
}


def tray_state(link_state: str, active_jobs: int, running: bool) -> TrayState:
    """The tray's state from the link's (``LinkClient.state``) and the jobs in flight."""
    if link_state == "refused":
        return TrayState.ERROR
    if not running or link_state == "stopped":
        return TrayState.STOPPED
    if link_state == "connected":
        return TrayState.WORKING if active_jobs > 0 else TrayState.IDLE
    return TrayState.CONNECTING


@dataclass(frozen=True)
class JobStart:
    """A job as it starts, for the jobs table."""

    job_id: str
    model: str
    kind: str
    started: float


class WorkerController(QObject):
    """Start Earning / Stop for the app. One ``WorkerService`` per run, sharing the store."""

    state_changed = Signal(str, str)  # TrayState value, detail
    link_changed = Signal(str, str)  # the link's own state and detail (for notifications)
    job_started = Signal(object)  # JobStart
    job_finished = Signal(object)  # JobRecord
    failed = Signal(str)  # something the owner must fix
    hardware_detected = Signal(object)  # HardwareReport
    running_changed = Signal(bool)

    def __init__(
        self,
        settings: WorkerSettings,
        store: Callable[[], ModelStore],
        *,
        detector: Detector | None = None,
        parent: QObject | None = None,
    ) -> None:
        super().__init__(parent)
        self.settings = settings
        self._store = store
        self._detector = detector
        self.service: WorkerService | None = None
        self._task: asyncio.Task[None] | None = None
        self._stop: asyncio.Event | None = None
        self.link_state = "stopped"
        self.state = TrayState.STOPPED
        self.detail = ""
        self.jobs_served = 0
        self._published: tuple[TrayState, str] = (TrayState.STOPPED, "")

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    # --- commands ------------------------------------------------------------------------------

    def start(self) -> None:
        """Start earning (no-op while running)."""
        if self.running:
            return
        self._stop = asyncio.Event()
        self._task = asyncio.ensure_future(self._run(self._stop))
        self.running_changed.emit(True)

    def stop(self) -> None:
        """Ask the worker to stop (it finishes or cancels its jobs, then closes)."""
        if self._stop is not None:
            self._stop.set()

    def toggle(self) -> None:
        if self.running:
            self.stop()
        else:
            self.start()

    async def stop_and_wait(self, timeout_s: float = 20.0) -> None:
        self.stop()
        task = self._task
        if task is not None and not task.done():
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(task), timeout_s)
            if not task.done():
                task.cancel()

    async def detect(self) -> HardwareReport:
        """Detect the hardware (in a thread) and announce it."""
        service = self.service or self._build()
        report = await service.detect()
        self.hardware_detected.emit(report)
        return report

    # --- running -------------------------------------------------------------------------------

    def _build(self) -> WorkerService:
        return WorkerService(self.settings, store=self._store(), detector=self._detector)

    async def _run(self, stop: asyncio.Event) -> None:
        self._set_link("connecting", "getting ready")
        try:
            service = self._build()
            self.service = service
            service.link.on_state = self._set_link
            service.runner.on_started.append(self._on_started)
            service.runner.on_finished.append(self._on_finished)
            if not service.store.list() and not self.settings.models:
                raise WorkerError("there is no model to serve yet: add one in the Models tab")
            # Detect first: loading a model plans its GPU layers from the free VRAM detected.
            report = await service.detect()
            self.hardware_detected.emit(report)
            if self.settings.models:
                self._set_link("connecting", "loading models")
                await service.prepare(self.settings.models)
            await service.serve(stop)
        except HandshakeRefusedError as exc:
            self._fail(f"the queen refused this worker: {exc}")
        except WorkerError as exc:
            self._fail(str(exc))
        except asyncio.CancelledError:
            self._set_link("stopped", "")
            raise
        except Exception as exc:  # the app must survive anything the worker hits
            log.exception("the worker stopped on an unexpected error")
            self._fail(f"{type(exc).__name__}: {exc}")
        else:
            self._set_link("stopped", "")
        finally:
            self._task = None
            self.running_changed.emit(False)
            self._publish()

    def _fail(self, message: str) -> None:
        log.error("%s", message)
        self.link_state = "refused"
        self.detail = message
        self.state = TrayState.ERROR
        self._published = (self.state, message)
        self.state_changed.emit(self.state.value, message)
        self.failed.emit(message)

    def _set_link(self, state: str, detail: str) -> None:
        self.link_state = state
        self.detail = detail
        self.link_changed.emit(state, detail)
        self._publish()

    def _active(self) -> int:
        return self.service.runner.active if self.service is not None else 0

    def _publish(self) -> None:
        if self.link_state == "refused":
            return  # keep the error on show until the next start
        state = tray_state(self.link_state, self._active(), self._task is not None)
        if (state, self.detail) != self._published:
            self._published = (state, self.detail)
            self.state = state
            self.state_changed.emit(state.value, self.detail)

    def _on_started(self, job: Job) -> None:
        kind = "embeddings" if job.openai_url.endswith("/embeddings") else "chat"
        self.job_started.emit(JobStart(job.id, str(job.openai_req.get("model", "")), kind,
                                       time.time()))
        self._publish()

    def _on_finished(self, record: JobRecord) -> None:
        if record.outcome == "ok":
            self.jobs_served += 1
        self.job_finished.emit(record)
        self._publish()


class LogBridge(QObject):
    """Log records from any thread, as a signal on the GUI thread."""

    record = Signal(str, str, str)  # level name, logger name, formatted message

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.handler = _SignalHandler(self)

    def attach(self, logger: logging.Logger, level: int = logging.INFO) -> None:
        self.handler.setLevel(level)
        logger.addHandler(self.handler)
        if logger.getEffectiveLevel() > level:
            logger.setLevel(level)

    def detach(self, logger: logging.Logger) -> None:
        logger.removeHandler(self.handler)


class _SignalHandler(logging.Handler):
    def __init__(self, bridge: LogBridge) -> None:
        super().__init__()
        self.bridge = bridge
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(message)s",
                                            "%H:%M:%S"))

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(RuntimeError):  # the bridge is gone (app shutting down)
            self.bridge.record.emit(record.levelname, record.name, self.format(record))
