"""The desktop app: services, main window, tray, wizard and notifications on ONE qasync event loop.

``ApiaryApp`` wires the widget-free services to the views (tests build it directly);
``run_app`` adds the QApplication, the single-instance guard and the event loop. Closing the
window keeps earning in the tray; Quit stops the worker cleanly (jobs finish or are cancelled,
the link closes) before the loop ends.

The first-run wizard's Finish is ``finish_setup``: save the choices, get the model (download or
import), start; a failure goes back to the wizard in plain words. When Start is skipped or
fails, the header says why and offers the fix (``Header.fix_requested``: Add a model,
Retry download, Fix the queen URL or the payout address, Retry now, Resume).

Start at launch follows the owner's last word (issue 35, ``owner_toggle``): the wizard's Start
Earning and a Start from the header or the tray turn it on, a Stop from them turns it off, so
after a reboot the worker earns again unless its owner had stopped it.

At launch, whether this build's llama.cpp has its RPC backend is probed in a thread (the same
``RpcSupport`` every run's worker uses), so the Settings tab can grey out the model-group
switches with the reason (issue 19).

The Hardware tab's serving figures (issue 36) follow every job's start and end and the app's
tick (``TICK_MS``): each loaded model's jobs at once, the jobs running and tokens/s per stream
and in total over the last minute (``services.serving``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from PySide6.QtCore import QObject, QTimer
from PySide6.QtWidgets import QApplication

from desktop_worker import __version__
from desktop_worker.errors import WorkerError
from desktop_worker.groups.rpc import RpcProbe, RpcSupport
from desktop_worker.groups.rpc_probe import SandboxedRpc
from desktop_worker.gui.common import Icons, spawn
from desktop_worker.gui.gui_gc import GuiThreadCollector
from desktop_worker.gui.notify import Notice, NotificationPolicy
from desktop_worker.gui.services.audit import audit_header_text
from desktop_worker.gui.services.demand import InDemandModel
from desktop_worker.gui.services.earnings import EarningsService
from desktop_worker.gui.services.logs import OncePerRun
from desktop_worker.gui.services.models import ModelsService, fetch_demand
from desktop_worker.gui.services.sandbox import sandbox_summary
from desktop_worker.gui.services.serving import ServingLog, loaded_slots, serving_headline
from desktop_worker.gui.services.settings import AutostartLike, SettingsService
from desktop_worker.gui.services.worker import LogBridge, WorkerController
from desktop_worker.gui.tray import Tray
from desktop_worker.gui.views.earnings import EarningsView
from desktop_worker.gui.views.hardware import HardwareView
from desktop_worker.gui.views.jobs import JobsView
from desktop_worker.gui.views.logs import LogsView
from desktop_worker.gui.views.models import ModelsView
from desktop_worker.gui.views.settings import SettingsView
from desktop_worker.gui.window import Header, MainWindow
from desktop_worker.gui.wizard import FirstRunWizard, WizardChoices
from desktop_worker.hardware import HardwareReport
from desktop_worker.identity import WorkerIdentity
from desktop_worker.link.backoff import Backoff
from desktop_worker.link_probe import ProbeResult, probe_queen
from desktop_worker.service import Detector, WorkerService
from desktop_worker.settings import WorkerSettings, config_dir
from shared_schema import Demand, WorkerEarnings
from shared_schema.protocol import Welcome

log = logging.getLogger(__name__)

TICK_MS = 5000
PROBE_TIMEOUT_S = 10.0
# Loggers whose warnings are about the machine, not the moment: said once per run, not at
# every Start (the keyring's "keeping the key in a file instead").
ONCE_PER_RUN_LOGGERS = ("desktop_worker.identity",)


class ApiaryApp(QObject):
    def __init__(
        self,
        settings: WorkerSettings,
        *,
        detector: Detector | None = None,
        autostart: AutostartLike | None = None,
        earnings_interval_s: float = 30.0,
        backoff: Callable[[], Backoff] | None = None,
        rpc: RpcSupport | None = None,
        group_poll_ms: int = 1000,
    ) -> None:
        """``rpc``: llama.cpp's RPC backend (None: the real one); ``group_poll_ms``: how often
        the status reads the worker's part in a model group."""
        super().__init__()
        qt_app = QApplication.instance()
        if isinstance(qt_app, QApplication):
            qt_app.setQuitOnLastWindowClosed(False)  # closing the window keeps the tray app
        self.icons = Icons()
        self.hardware: HardwareReport | None = None
        self._identity: WorkerIdentity | None = None
        self.settings_service = SettingsService(settings, autostart)
        self.models = ModelsService(settings, hardware=lambda: self.hardware)
        self.detector = detector
        self.rpc: RpcSupport = rpc or SandboxedRpc()
        self._rpc_check: asyncio.Task[RpcProbe | None] | None = None
        self.controller = WorkerController(settings, store=lambda: self.models.store,
                                           detector=detector, backoff=backoff, rpc=self.rpc,
                                           group_poll_ms=group_poll_ms)
        self.earnings = EarningsService(lambda: self.settings.queen_url, self.identity,
                                        interval_s=earnings_interval_s,
                                        payout_address=lambda: self.settings.ln_url)
        self.logs = LogBridge()
        self.logs.attach(logging.getLogger("desktop_worker"))
        self._once = OncePerRun()
        for name in ONCE_PER_RUN_LOGGERS:
            logging.getLogger(name).addFilter(self._once)
        self.policy = NotificationPolicy()
        self.wizard: FirstRunWizard | None = None
        self._retry: WizardChoices | None = None  # what to fetch again ("Retry download")

        self.header = Header(self.controller, self.icons)
        self.hardware_view = HardwareView()
        self.serving = ServingLog()  # the Hardware tab's serving figures (issue 36)
        self.window = MainWindow(
            self.header, self.hardware_view, ModelsView(self.models, self.earnings),
            JobsView(self.controller, self.earnings), EarningsView(self.earnings),
            SettingsView(self.settings_service, earning=lambda: self.controller.running,
                         tester=self.probe_queen),
            LogsView(self.logs),
            on_hidden=self._hidden,
        )
        self.window.setWindowIcon(self.icons.app())
        self.tray = Tray(self.controller, self.earnings, self.icons,
                         open_window=self.show_window, quit_app=self.quit,
                         toggle=self.owner_toggle)
        self._told_hidden = False
        self._quit = asyncio.Event()
        self._ticker = QTimer(self)
        self._ticker.setInterval(TICK_MS)
        self._ticker.timeout.connect(self._tick)

        self.controller.hardware_detected.connect(self._on_hardware)
        self.controller.demand_changed.connect(self.models.set_demand)  # the In demand list
        self.controller.job_finished.connect(self.models.record_job)  # this worker's speed
        self.controller.job_started.connect(self.serving.started)
        self.controller.job_finished.connect(self.serving.finished)
        self.controller.job_started.connect(lambda _start: self.show_serving())
        self.controller.job_finished.connect(lambda _record: self.show_serving())
        self.controller.running_changed.connect(self._on_running)
        self.controller.job_finished.connect(
            lambda record: self._notify(self.policy.job_finished(record.outcome)))
        self.controller.link_changed.connect(
            lambda state, _d: self._notify(self.policy.link(state, time.monotonic())))
        self.controller.failed.connect(lambda message: self._notify(self.policy.error(message)))
        self.controller.engine_crashed.connect(
            lambda model, why: self._notify(self.policy.engine_crashed(model, why,
                                                                       time.monotonic())))
        self.earnings.updated.connect(self._on_earnings)
        self.controller.welcomed.connect(self._on_welcome)
        self.window.earnings.add_address_requested.connect(self.open_payout_setting)
        self.settings_service.changed.connect(self._on_settings)
        self.hardware_view.refresh_button.clicked.connect(lambda: spawn(self.detect()))
        self.hardware_view.refresh_button.clicked.connect(self.show_serving)
        self.header.fix_requested.connect(self.fix)
        self.header.toggle_requested.connect(self.owner_toggle)
        self.models.models_changed.connect(lambda _models: self.header.refresh())
        self.settings_service.at_launch_changed.connect(self._on_at_launch)
        self.window.settings.reconnect.connect(lambda: spawn(self.controller.restart()))
        self.window.settings.restart_requested.connect(
            lambda: spawn(self.controller.restart()))

    @property
    def settings(self) -> WorkerSettings:
        return self.settings_service.settings

    def identity(self) -> WorkerIdentity:
        if self._identity is None:
            self._identity = WorkerIdentity.load_or_create(self.settings.key_path,
                                                           key_store=self.settings.key_store)
        return self._identity

    # --- life -------------------------------------------------------------------------------------

    def launch(self, *, show: bool = True) -> None:
        """Show the window and the tray, read the models, detect the hardware, start polling
        earnings; the wizard on first run; earning at once if the owner asked for that."""
        if show:
            self.window.show()
        self.tray.show()
        self.models.refresh()
        spawn(self.detect())
        self._rpc_check = spawn(self.check_rpc())
        self.earnings.start()
        self._ticker.start()
        if not self.settings.first_run_done:
            self.open_wizard()
        elif self.settings.start_earning_at_launch:
            self.controller.start()

    def owner_toggle(self) -> None:
        """Start Earning / Stop from the header or the tray: done, and remembered, so earning
        resumes at the next launch after a Start and a deliberate Stop survives a relaunch."""
        starting = not self.controller.running
        if starting:
            self.controller.start()
        else:
            self.controller.stop(by_owner=True)
        self._remember_start(starting)

    def _remember_start(self, on: bool) -> None:
        try:
            self.settings_service.remember_start_at_launch(on)
        except WorkerError as exc:  # earning goes on; only the next launch may differ
            log.warning("could not save whether to start earning at launch: %s", exc)

    def _on_at_launch(self, on: bool) -> None:
        self.controller.settings = self.settings
        self.window.settings.show_at_launch(on)
        self.header.refresh()

    async def detect(self) -> HardwareReport | None:
        try:
            return await self.controller.detect()
        except WorkerError as exc:
            self._notify(self.policy.error(str(exc)))
            return None

    async def check_rpc(self) -> RpcProbe | None:
        """Whether this build can join model groups, shown in the Settings tab."""
        try:
            probe = await asyncio.to_thread(self.rpc.probe)
        except Exception:  # a probe that broke must not stop the app: the switch stays usable
            log.exception("could not check llama.cpp's RPC backend")
            return None
        if not probe.available:
            log.info("this build cannot join model groups: %s", probe.reason)
        self.window.settings.show_rpc(probe)
        self.hardware_view.show_sandbox(
            sandbox_summary(getattr(self.rpc, "confinement", None), checked=True))
        return probe

    def show_window(self) -> None:
        self.window.bring_up()

    def raise_requested(self) -> None:
        """A second launch of the app asked this one to show itself."""
        log.info("another launch asked Apiary to show its window")
        self.show_window()

    def quit(self) -> None:
        """Stop earning, then end the event loop (``run_until_quit`` returns)."""
        self._quit.set()

    async def run_until_quit(self) -> int:
        await self._quit.wait()
        await self.shutdown()
        return 0

    async def shutdown(self) -> None:
        self._ticker.stop()
        if self._rpc_check is not None:  # a probe in its thread: let it land before closing
            await asyncio.gather(self._rpc_check, return_exceptions=True)
        self.header.ticker.stop()
        await self.controller.stop_and_wait()
        self.header.ticker.stop()
        await self.earnings.stop()
        close = getattr(self.rpc, "close", None)  # the device probe's engine process
        if close is not None:
            await asyncio.to_thread(close)
        self.logs.detach(logging.getLogger("desktop_worker"))
        for name in ONCE_PER_RUN_LOGGERS:
            logging.getLogger(name).removeFilter(self._once)
        self.tray.hide()
        if self.wizard is not None:
            self.wizard.close()
        self.window.quitting = True
        self.window.close()

    # --- first run --------------------------------------------------------------------------------

    def open_wizard(self) -> FirstRunWizard:
        self.wizard = FirstRunWizard(self.settings.ln_url, self.settings.queen_url,
                                     self.finish_setup, self.window,
                                     logo=self.icons.pixmap("app", 48), tester=self.test_queen,
                                     cancel_work=self.models.cancel,
                                     demand_source=self.demand_source,
                                     held=lambda: {m.name for m in self.models.store.list()},
                                     hub_check=self.models.hub_problem)
        self.wizard.show_hardware(self.hardware, self.settings.vram_cap_mb)
        self.models.progress.connect(self.wizard.ready.show_progress)
        self.wizard.rejected.connect(self._wizard_closed)
        self.wizard.show()
        return self.wizard

    async def demand_source(self, url: str) -> Demand | None:
        """The wizard's demand: ``GET /worker/demand`` of the queen chosen (None: none)."""
        return await fetch_demand(url)

    async def test_queen(self, url: str) -> ProbeResult:
        """The wizard's "Test connection": the real handshake, with the hello a Start sends
        (this worker's key, hardware and models, and the payout address typed)."""
        ln_url = self.wizard.payout.field.value() if self.wizard is not None \
            else self.settings.ln_url
        return await self.probe_queen(url, ln_url)

    async def probe_queen(self, url: str, ln_url: str | None) -> ProbeResult:
        """Test connection (the wizard's and the Settings tab's): the real handshake with
        ``url``, saying ``ln_url`` as the payout address."""
        service = self.controller.service
        if (self.controller.link_state == "connected" and service is not None
                and url == self.settings.queen_url):
            # Connected to it now: a second session of the same key would replace this one.
            welcome = getattr(service.link, "welcome", None)
            who = f" (worker id {welcome.worker_id})" if welcome is not None else ""
            return ProbeResult(True, f"connected: this worker is earning on this queen now{who}",
                               "ok", welcome.worker_id if welcome is not None else None)
        settings = self.settings.model_copy(update={"queen_url": url, "ln_url": ln_url})
        try:
            service = WorkerService(settings, store=self.models.store, detector=self.detector,
                                    rpc=self.rpc)  # the app's one device probe, closed at quit
        except WorkerError as exc:
            return ProbeResult(False, str(exc), "error")
        try:
            return await probe_queen(url, service.hello_factory, timeout_s=PROBE_TIMEOUT_S)
        finally:
            await service.pool.close()

    async def finish_setup(self, choices: WizardChoices) -> str | None:
        """The wizard's Finish: save, get the model, start (if asked). None when it all
        worked, else why not, in plain words (the wizard shows it with Retry)."""
        try:
            self.settings_service.update(ln_url=choices.ln_url, queen_url=choices.queen_url,
                                         **choices.disk_settings())
        except WorkerError as exc:
            return f"Could not save your settings: {exc}"
        problem = await self._get_model(choices)
        if problem is not None:
            self._retry = choices
            return problem
        self._retry = None
        self.settings_service.update(first_run_done=True)  # only once it worked (issue 35)
        self.header.clear_problem()
        if choices.start:
            self._remember_start(True)  # the wizard's Start: earning resumes at each launch
            self.controller.start()
        return None

    async def _get_model(self, choices: WizardChoices) -> str | None:
        if choices.local_file is not None:
            self._say_in_wizard(f"Importing {choices.local_file.name} (copying and hashing)…")
            error = await self.models.import_file(Path(choices.local_file), choices.local_name)
            return None if error is None else \
                f"Could not use {choices.local_file.name}: {error}"
        model = choices.model
        if model is None or model.name in self.models.store:
            return None
        self._say_in_wizard(f"Downloading {model.label}…")
        pin = {"revision": model.revision, "expect_sha256": model.sha256} \
            if isinstance(model, InDemandModel) else {}
        outcome = await self.models.pull(model.name, force=True, **pin)
        if outcome == "done":
            return None
        if outcome == "cancelled":
            return "The download was cancelled. What was downloaded is kept: Retry goes on " \
                   "from there."
        return f"The model download failed: {self.models.last_message}."

    def _say_in_wizard(self, text: str) -> None:
        if self.wizard is not None:
            self.wizard.ready.working(text)

    def _wizard_closed(self) -> None:
        """Closed with a failure on show: Start was skipped, and the header says so."""
        wizard = self.wizard
        if wizard is not None and wizard.failure is not None and self._retry is not None:
            self.header.show_problem(f"Start was skipped: {wizard.failure}", "retry_download")

    async def retry_download(self) -> str | None:
        """The header's "Retry download": fetch the wizard's model again, then start."""
        choices = self._retry
        if choices is None:
            return None
        self.header.show_problem("Downloading the model again…", None)
        problem = await self.finish_setup(choices)
        if problem is not None:
            self.header.show_problem(f"Start was skipped: {problem}", "retry_download")
        return problem

    def fix(self, key: str) -> None:
        """A click on the header's fix button."""
        self.show_window()
        if key == "models":
            self.window.show_tab("Models")
        elif key == "settings":
            self.window.show_tab("Settings")
        elif key == "queen_url":
            self.window.show_tab("Settings")
            self.window.settings.queen.setFocus()
            self.window.settings.queen.selectAll()
        elif key == "payout":
            self.open_payout_setting()
        elif key == "retry":
            self.controller.retry_now()
        elif key == "resume":
            self.controller.resume()
        elif key == "retry_download":
            spawn(self.retry_download())

    # --- reactions --------------------------------------------------------------------------------

    def _on_hardware(self, report: HardwareReport) -> None:
        self.hardware = report
        self.hardware_view.show_report(report)
        self.models.update_demand()  # what fits follows the hardware
        if self.wizard is not None and self.wizard.isVisible():
            self.wizard.show_hardware(report, self.settings.vram_cap_mb)

    def open_payout_setting(self) -> None:
        """The Earnings tab's nudge: Settings, with the payout address field focused."""
        self.show_window()
        self.window.show_tab("Settings")
        self.window.settings.payout.edit.setFocus()

    def _on_welcome(self, welcome: Welcome) -> None:
        self.policy.queen_pays(welcome.pays_workers)
        self.earnings.set_welcome(welcome)

    def _on_earnings(self, earnings: WorkerEarnings) -> None:
        pays = self.earnings.pays
        self.policy.queen_pays(pays)
        self.header.show_today(earnings.today_msat, pays)
        self.policy.already_served(earnings.jobs_settled)
        if self.earnings.fresh and pays is not False:
            self._notify(self.policy.sats_waiting(
                earnings.available_msat + earnings.pending_msat,
                bool(self.settings.ln_url)))
        for notice in self.policy.payouts(earnings.recent_payouts):
            self._notify(notice)
        audit = self.earnings.audit  # the queen's audits: flagged shows in the header
        self.header.show_audit(audit_header_text(audit))
        self._notify(self.policy.audit(audit))

    def _on_settings(self, settings: WorkerSettings) -> None:
        self.controller.settings = settings
        self.models.apply_settings(settings)
        self.header.show_queen(settings.queen_url)
        self.window.settings.load(settings)
        self.earnings.republish()  # the payout nudge follows the address at once
        self.earnings.poke()

    def _on_running(self, running: bool) -> None:
        if not running:
            self.serving.stopped()
        self.show_serving()

    def show_serving(self) -> None:
        """The Hardware tab's serving figures: each loaded model's slots, jobs running and
        speeds (on every job's start and end, and each tick, as the last minute moves on)."""
        slots = loaded_slots(self.controller.service, self.controller.running)
        self.hardware_view.show_serving(serving_headline(slots),
                                        self.serving.figures(slots or {}))

    def _tick(self) -> None:
        self._notify(self.policy.tick(time.monotonic()))
        self.show_serving()

    def _notify(self, notice: Notice | None) -> None:
        if notice is not None:
            log.info("notification: %s: %s", notice.title, notice.message)
            self.tray.notify(notice)

    def _hidden(self) -> None:
        if not self._told_hidden:
            self._told_hidden = True
            self.tray.notify(Notice("Apiary is still running",
                                    "It keeps earning in the tray. Use Quit in the tray menu "
                                    "to stop it."))


def run_app(settings: WorkerSettings | None = None, argv: list[str] | None = None) -> int:
    """Open the desktop app; returns the exit code. A second launch raises the first window."""
    import qasync

    from desktop_worker.desktop.autostart import autostart_for_platform
    from desktop_worker.desktop.single_instance import SingleInstance, default_key
    qt_app = QApplication.instance() or QApplication(argv if argv is not None else sys.argv)
    assert isinstance(qt_app, QApplication)
    qt_app.setApplicationName("Apiary")
    qt_app.setQuitOnLastWindowClosed(False)
    # One instance per config dir: a second profile (APIARY_CONFIG_DIR) may run beside it.
    profile = hashlib.sha256(str(config_dir().resolve()).encode()).hexdigest()[:10]
    guard = SingleInstance(f"{default_key()}-{profile}")
    if not guard.acquire():
        log.info("Apiary is already running; asked it to show its window")
        return 0
    loop = qasync.QEventLoop(qt_app)
    asyncio.set_event_loop(loop)
    collector = GuiThreadCollector(qt_app)  # Qt objects are only ever freed on this thread
    collector.start()
    try:
        app = ApiaryApp(settings or WorkerSettings(), autostart=autostart_for_platform())
        qt_app.setWindowIcon(app.icons.app())
        guard.raise_requested.connect(app.raise_requested)
        for signum in (signal.SIGINT, signal.SIGTERM):  # Ctrl+C, logout: quit cleanly
            with contextlib.suppress(NotImplementedError, RuntimeError):  # Windows
                loop.add_signal_handler(signum, app.quit)
        app.launch()
        log.info("Apiary %s is running (settings in %s)", __version__, config_dir())
        with loop:
            code = loop.run_until_complete(app.run_until_quit())
        log.info("Apiary stopped")
        return code
    finally:
        collector.stop()
        guard.release()
