"""Start and stop earning: ``WorkerController`` runs a ``WorkerService`` on the app's event loop
and turns the link's and the job runner's callbacks into Qt signals.

The tray state is a pure function of the link state and the number of jobs in flight
(``tray_state``). While the link waits to reconnect, the controller keeps why (in plain words,
from ``link_probe.explain_connect_error``) and when the next attempt is (``retry_at``), so the
header can count down each second (``countdown_text``). A failure that the owner can fix names
the fix (``fix``: a key of ``FIX_LABELS``). Log records from any thread reach the Logs tab
through ``LogBridge``, a ``logging.Handler`` whose signal Qt queues onto the GUI thread.

While earning, the controller's ``GroupWatch`` reads the worker's part in a model group (issue
19) each second; ``status_text`` puts it in the status line instead of "waiting for jobs"
(``group_changed`` tells the header and the tray).

Whenever the worker is not earning, the header says why in whole sentences, with the button that
fixes it (issue 35): ``not_earning`` for a stop (no model yet, the owner's Stop, not started at
launch), ``as_sentence`` for an error's words, ``FIX_LABELS`` for the fix. While the link waits
to reconnect the fix is "Retry now" (``retry_now``: the wait ends at once). The tray's Pause
(``pause``, ``TRAY_PAUSE``) uses the owner-pause path of the running service, so it lasts only
as long as that run: a new Start is never paused by it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from PySide6.QtCore import QObject, Signal

from desktop_worker.errors import HandshakeRefusedError, LinkError, ModelStoreError, WorkerError
from desktop_worker.groups.rpc import RpcSupport
from desktop_worker.gui.services.groups import GroupStatus, GroupWatch, group_status, group_text
from desktop_worker.hardware import HardwareReport
from desktop_worker.jobs import JobRecord, job_kind
from desktop_worker.link.backoff import Backoff
from desktop_worker.link_probe import explain_connect_error
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
    PAUSED = "paused"
    ERROR = "error"


STATE_TEXT = {
    TrayState.STOPPED: "Not earning",
    TrayState.CONNECTING: "Connecting…",
    TrayState.IDLE: "Earning: waiting for jobs",
    TrayState.WORKING: "Earning: serving a job",
    TrayState.PAUSED: "Paused",
    TrayState.ERROR: "Needs attention",
}


# What the header's fix button says for each kind of problem the owner can fix.
FIX_LABELS = {
    "models": "Add a model",
    "retry_download": "Retry download",
    "settings": "Open Settings",
    "queen_url": "Fix the queen URL",
    "payout": "Fix the payout address",
    "retry": "Retry now",
    "resume": "Resume",
}
# Refusals the owner fixes in Settings' payout address field (the address the queen refused).
PAYOUT_REFUSALS = frozenset({"invalid_ln_url"})
# Why the worker is paused when its owner chose Pause in the tray (the queen sees it too).
TRAY_PAUSE = "paused from the tray"
# Why the worker is not earning, when it is stopped with nothing gone wrong (``not_earning``).
NO_MODEL_YET = "There is no model to serve yet. Add one, then click Start Earning."
OWNER_STOPPED = ("You stopped earning. Click Start Earning to earn again; until you do, Apiary "
                 "stays stopped, even after a restart.")
NOT_STARTED_AT_LAUNCH = ("Apiary does not start earning by itself when it opens. Click Start "
                         "Earning, and it will from then on.")
NOT_STARTED = "Not connected to the queen. Click Start Earning to earn."
_RECONNECT_IN = re.compile(r"reconnecting in ([0-9]+(?:\.[0-9]+)?) s")


def status_text(state: TrayState, group: GroupStatus | None = None) -> str:
    """The status line: the state's words, or, while earning in a model group (issue 19), what
    this worker does for it ("Serving 12 layers of SmolLM2 for a group"): a member takes no jobs
    of its own, and "waiting for jobs" would leave its owner wondering why none come."""
    if group is not None and state in (TrayState.IDLE, TrayState.WORKING):
        return group_text(group, working=state == TrayState.WORKING)
    return STATE_TEXT.get(state, state.value)


def countdown_text(reason: str, retry_at: float | None, now: float) -> str:
    """"Cannot reach the queen: <reason>. Retrying in 12 s…", the seconds rounded up so it
    never shows 0 before the attempt; "Retrying now…" once the time is up."""
    head = f"Cannot reach the queen: {reason}." if reason else ""
    if retry_at is None:
        return head
    left = math.ceil(retry_at - now - 1e-6)
    tail = f"Retrying in {left} s…" if left > 0 else "Retrying now…"
    return f"{head} {tail}".strip()


def as_sentence(text: str) -> str:
    """``text`` as a whole sentence: a capital first letter and a full stop at the end (error
    messages are written to follow a colon: "the queen refused this worker: ...")."""
    text = text.strip()
    if not text:
        return ""
    text = text[0].upper() + text[1:]
    return text if text[-1] in ".!?…" else text + "."


def not_earning(*, has_model: bool, stopped_by_owner: bool,
                starts_at_launch: bool) -> tuple[str, str | None]:
    """Why a stopped worker is not earning, and the fix (a ``FIX_LABELS`` key; None: the
    Start Earning button beside it is the fix)."""
    if not has_model:
        return NO_MODEL_YET, "models"
    if stopped_by_owner:
        return OWNER_STOPPED, None
    if not starts_at_launch:
        return NOT_STARTED_AT_LAUNCH, None
    return NOT_STARTED, None


_SENTENCE_END = re.compile(r"(?<=[.!?…])\s+")
MORE = "…"  # what follows a reason cut to fit (its whole text is in the tooltip)


def fit_reason(text: str, fits: Callable[[str], bool]) -> str:
    """As much of ``text`` as ``fits`` the header's reason area: all of it when it fits, else
    its first whole sentences and ``MORE``; only a first sentence too long on its own is cut
    between words."""
    if fits(text):
        return text
    kept = ""
    for sentence in _SENTENCE_END.split(text):
        longer = f"{kept} {sentence}".strip()
        if not fits(f"{longer} {MORE}"):
            break
        kept = longer
    if kept:
        return f"{kept} {MORE}"
    words = text.split(" ")
    while len(words) > 1 and not fits(" ".join(words) + MORE):
        words.pop()
    return " ".join(words) + MORE


def paused_detail(reason: str) -> str:
    """The header's detail line while paused: why, and how earning comes back."""
    if reason == TRAY_PAUSE:
        return "You paused earning from the tray. Click Resume to take jobs again."
    return f"Paused: {reason}. Earning resumes by itself when that changes."


def reconnect_fix(reason_kind: str) -> str:
    """The fix offered while the link waits to reconnect: Retry now, unless what answered is
    no queen at all (a web page, another server), where only a new queen URL helps."""
    return "queen_url" if reason_kind == "not_a_queen" else "retry"


def reconnect_delay(detail: str) -> float | None:
    """The wait the link announced in its "disconnected" detail ("reconnecting in 12.9 s")."""
    match = _RECONNECT_IN.search(detail)
    return float(match.group(1)) if match else None


def fix_for(exc: BaseException) -> str | None:
    """Which fix to offer for an error that stopped the worker (a ``FIX_LABELS`` key)."""
    if isinstance(exc, HandshakeRefusedError):
        return "payout" if exc.code in PAYOUT_REFUSALS else None
    if isinstance(exc, LinkError):
        return "queen_url"  # a queen address the link cannot use
    if isinstance(exc, ModelStoreError):
        return "models"
    return None


class NoModelYet(WorkerError):
    """Start was asked with nothing to serve."""


def tray_state(link_state: str, active_jobs: int, running: bool,
               paused: str | None = None) -> TrayState:
    """The tray's state from the link's (``LinkClient.state``), the jobs in flight and
    whether the owner's controls paused the worker (``paused``: why)."""
    if link_state == "refused":
        return TrayState.ERROR
    if not running or link_state == "stopped":
        return TrayState.STOPPED
    if paused:
        return TrayState.PAUSED
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
    job_progress = Signal(object)  # jobs.JobProgress: a training job's latest report
    job_rendered = Signal(object)  # image_jobs.RenderedJob: an image job's images are made
    failed = Signal(str)  # something the owner must fix
    hardware_detected = Signal(object)  # HardwareReport
    running_changed = Signal(bool)
    welcomed = Signal(object)  # the queen's Welcome, each session (whether it pays, threshold)
    demand_changed = Signal(object)  # shared_schema.Demand: what developers ask the queen for
    paused_changed = Signal(str)  # why the worker paused ("" when it resumes)
    group_changed = Signal(object)  # GroupStatus | None: this worker's part in a model group
    engine_crashed = Signal(str, str)  # the model, what happened (from a pool thread: queued)

    def __init__(
        self,
        settings: WorkerSettings,
        store: Callable[[], ModelStore],
        *,
        detector: Detector | None = None,
        backoff: Callable[[], Backoff] | None = None,
        clock: Callable[[], float] = time.monotonic,
        rpc: RpcSupport | None = None,
        group_poll_ms: int = 1000,
        parent: QObject | None = None,
    ) -> None:
        """``rpc``: llama.cpp's RPC backend for each run's service (None: the real one);
        ``group_poll_ms``: how often the group status is read while earning."""
        super().__init__(parent)
        self.settings = settings
        self.rpc = rpc
        self._store = store
        self._detector = detector
        self._backoff = backoff
        self.clock = clock
        self.fix: str | None = None  # the fix for the failure on show (FIX_LABELS key)
        self.reason = ""  # why the link is waiting to reconnect, in plain words
        self.reason_kind = ""  # and its kind (``explain_connect_error``: refused, dns, ...)
        self.retry_at: float | None = None  # when it tries again (``clock`` time)
        self.service: WorkerService | None = None
        self._task: asyncio.Task[None] | None = None
        self._stop: asyncio.Event | None = None
        self.link_state = "stopped"
        self.state = TrayState.STOPPED
        self.detail = ""
        self.jobs_served = 0
        self.paused: str | None = None
        self.stopped_by_owner = False  # the last run ended with the owner's Stop
        self._published: tuple[TrayState, str] = (TrayState.STOPPED, "")
        self.groups = GroupWatch(self._read_group, interval_ms=group_poll_ms, parent=self)
        self.groups.changed.connect(self.group_changed.emit)

    @property
    def group(self) -> GroupStatus | None:
        """This worker's part in a model group now (None: none, or not earning)."""
        return self.groups.status

    def status_text(self) -> str:
        return status_text(self.state, self.group)

    def has_model(self) -> bool:
        """Whether there is anything to serve (a model in the store, or one named to pull)."""
        return bool(self.settings.models) or bool(self._store().list())

    def not_earning(self) -> tuple[str, str | None]:
        """Why the worker is stopped now, and the fix (``not_earning``)."""
        return not_earning(has_model=self.has_model(), stopped_by_owner=self.stopped_by_owner,
                           starts_at_launch=self.settings.start_earning_at_launch)

    def _read_group(self) -> GroupStatus | None:
        service = self.service
        return group_status(service.groups) if service is not None and self.running else None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    # --- commands ------------------------------------------------------------------------------

    def start(self) -> None:
        """Start earning (no-op while running)."""
        if self.running:
            return
        self.stopped_by_owner = False
        self.paused = None  # a pause (the tray's, the owner's settings') was the last run's
        self.service = None  # the last run's: this run builds its own at once
        self._stop = asyncio.Event()
        self._task = asyncio.ensure_future(self._run(self._stop))
        self.running_changed.emit(True)

    def stop(self, *, by_owner: bool = False) -> None:
        """Ask the worker to stop (it finishes or cancels its jobs, then closes). ``by_owner``:
        the owner's Stop (the header says so), not a restart or the app quitting."""
        if self._stop is not None:
            if by_owner and self.running:
                self.stopped_by_owner = True
            self._stop.set()

    def toggle(self) -> None:
        if self.running:
            self.stop()
        else:
            self.start()

    def retry_now(self) -> bool:
        """The owner's "Retry now": end the link's wait and dial the queen at once. False when
        it is not waiting to reconnect."""
        service = self.service
        return service is not None and self.running and service.link.retry_now()

    def pause(self, reason: str = TRAY_PAUSE) -> bool:
        """Pause this run (the tray's Pause): no new jobs, the queen told why. False when
        there is no run to pause yet."""
        service = self.service
        if service is None or not self.running:
            return False
        service.pause(reason)
        return True

    def resume(self) -> None:
        """Take jobs again after the tray's Pause (a pause of the owner's settings is theirs
        to lift: it comes back at their next check)."""
        service = self.service
        if service is not None and self.running:
            service.resume()

    async def stop_and_wait(self, timeout_s: float = 20.0) -> None:
        self.stop()
        task = self._task
        if task is not None and not task.done():
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(task), timeout_s)
            if not task.done():
                task.cancel()

    async def restart(self) -> None:
        """Stop (jobs finish or are cancelled) and start again with the current settings."""
        await self.stop_and_wait()
        self.start()

    async def detect(self) -> HardwareReport:
        """Detect the hardware (in a thread) and announce it."""
        service = self.service or self._build()
        report = await service.detect()
        self.hardware_detected.emit(report)
        return report

    # --- running -------------------------------------------------------------------------------

    def _build(self) -> WorkerService:
        service = WorkerService(self.settings, store=self._store(), detector=self._detector,
                                rpc=self.rpc)
        if self._backoff is not None:
            service.link.backoff = self._backoff()
        return service

    async def _run(self, stop: asyncio.Event) -> None:
        self._set_link("connecting", "Getting ready…")
        try:
            service = self._build()
            self.service = service
            service.link.on_state = self._set_link
            service.link.on_welcome = self.welcomed.emit
            service.runner.on_started.append(self._on_started)
            service.runner.on_finished.append(self._on_finished)
            service.runner.on_progress.append(self.job_progress.emit)
            if service.images is not None:
                service.images.on_rendered.append(self.job_rendered.emit)
            service.demand_listeners.append(self.demand_changed.emit)
            service.pause_listeners.append(self._on_paused)
            service.engines.on_crash.append(self.engine_crashed.emit)
            self.groups.start()
            if not self.has_model():
                raise NoModelYet("there is no model to serve yet: add one in the Models tab")
            # Detect first: loading a model plans its GPU layers from the free VRAM detected.
            report = await service.detect()
            self.hardware_detected.emit(report)
            if self.settings.models:
                self._set_link("connecting", "Loading the models…")
                await service.prepare(self.settings.models)
            await service.serve(stop)
        except HandshakeRefusedError as exc:
            self._fail(f"the queen refused this worker: {exc}", fix_for(exc))
        except NoModelYet as exc:
            self._fail(str(exc), "models")
        except WorkerError as exc:
            self._fail(str(exc), fix_for(exc))
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
            self.groups.stop()
            self.running_changed.emit(False)
            self._publish()

    def _fail(self, message: str, fix: str | None = None) -> None:
        log.error("%s", message)
        self.fix = fix
        self.retry_at = None
        self.link_state = "refused"
        self.detail = message
        self.state = TrayState.ERROR
        self._published = (self.state, message)
        self.state_changed.emit(self.state.value, message)
        self.failed.emit(message)

    def _set_link(self, state: str, detail: str) -> None:
        if state == "connecting" and self.link_state == "refused":
            self.fix = None  # a new start: the last failure is over
        self.link_state = state
        if state == "disconnected":
            link = self.service.link if self.service is not None else None
            self.reason_kind, self.reason = explain_connect_error(
                link.last_error if link is not None else None, self.settings.queen_url)
            delay = reconnect_delay(detail)
            self.retry_at = None if delay is None else self.clock() + delay
            detail = countdown_text(self.reason, self.retry_at, self.clock())
        elif state == "connecting" and self.reason:  # the next attempt, after a failed one
            self.retry_at = None
            detail = countdown_text(self.reason, self.clock(), self.clock())
        else:
            self.retry_at = None
            self.reason = ""
            self.reason_kind = ""
            if state == "connecting" and "://" in detail:  # the link names the URL it dials
                detail = f"Connecting to the queen at {detail}…"
        self.detail = detail
        self.link_changed.emit(state, detail)
        self._publish()

    def _active(self) -> int:
        return self.service.runner.active if self.service is not None else 0

    def _publish(self) -> None:
        if self.link_state == "refused":
            return  # keep the error on show until the next start
        state = tray_state(self.link_state, self._active(), self._task is not None,
                           self.paused if self._task is not None else None)
        if (state, self.detail) != self._published:
            self._published = (state, self.detail)
            self.state = state
            self.state_changed.emit(state.value, self.detail)

    def _on_paused(self, reason: str | None) -> None:
        self.paused = reason
        if reason:
            self.detail = f"Paused: {reason}"
        elif self.detail.startswith("Paused: "):
            self.detail = ""
        self.paused_changed.emit(reason or "")
        self._publish()

    def _on_started(self, job: Job) -> None:
        kind = job_kind(job.openai_url)
        model = str(job.openai_req.get("model", ""))
        if kind == "train":  # the base it fine-tunes, said so
            model = f"fine-tuning {model}"
        elif kind == "image":  # what it makes, said so
            req = job.openai_req
            model = f"image {req.get('width')}x{req.get('height')}: {model}"
        self.job_started.emit(JobStart(job.id, model, kind, time.time()))
        self._publish()

    def _on_finished(self, record: JobRecord) -> None:
        if record.outcome == "ok":
            self.jobs_served += 1
        self.job_finished.emit(record)
        self._publish()


class LogBridge(QObject):
    """Log records from any thread, as a signal on the GUI thread."""

    # level name, logger name, the line shown (with its time), the message alone (for folding)
    record = Signal(str, str, str, str)

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
            self.bridge.record.emit(record.levelname, record.name, self.format(record),
                                    record.getMessage())
