"""The desktop app: services, main window, tray, wizard and notifications on ONE qasync event loop.

``ApiaryApp`` wires the widget-free services to the views (tests build it directly);
``run_app`` adds the QApplication, the single-instance guard and the event loop. Closing the
window keeps earning in the tray; Quit stops the worker cleanly (jobs finish or are cancelled,
the link closes) before the loop ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import signal
import sys
import time

from PySide6.QtCore import QObject, QTimer
from PySide6.QtWidgets import QApplication

from desktop_worker import __version__
from desktop_worker.errors import WorkerError
from desktop_worker.gui.common import Icons, spawn
from desktop_worker.gui.notify import Notice, NotificationPolicy
from desktop_worker.gui.services.advice import CatalogModel
from desktop_worker.gui.services.earnings import EarningsService
from desktop_worker.gui.services.models import ModelsService
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
from desktop_worker.gui.wizard import FirstRunWizard
from desktop_worker.hardware import HardwareReport
from desktop_worker.identity import WorkerIdentity
from desktop_worker.service import Detector
from desktop_worker.settings import WorkerSettings, config_dir
from shared_schema import WorkerEarnings

log = logging.getLogger(__name__)

TICK_MS = 5000


class ApiaryApp(QObject):
    def __init__(
        self,
        settings: WorkerSettings,
        *,
        detector: Detector | None = None,
        autostart: AutostartLike | None = None,
        earnings_interval_s: float = 30.0,
    ) -> None:
        super().__init__()
        qt_app = QApplication.instance()
        if isinstance(qt_app, QApplication):
            qt_app.setQuitOnLastWindowClosed(False)  # closing the window keeps the tray app
        self.icons = Icons()
        self.hardware: HardwareReport | None = None
        self._identity: WorkerIdentity | None = None
        self.settings_service = SettingsService(settings, autostart)
        self.models = ModelsService(settings, hardware=lambda: self.hardware)
        self.controller = WorkerController(settings, store=lambda: self.models.store,
                                           detector=detector)
        self.earnings = EarningsService(lambda: self.settings.queen_url, self.identity,
                                        interval_s=earnings_interval_s)
        self.logs = LogBridge()
        self.logs.attach(logging.getLogger("desktop_worker"))
        self.policy = NotificationPolicy()
        self.wizard: FirstRunWizard | None = None

        self.header = Header(self.controller, self.icons)
        self.hardware_view = HardwareView()
        self.window = MainWindow(
            self.header, self.hardware_view, ModelsView(self.models),
            JobsView(self.controller, self.earnings), EarningsView(self.earnings),
            SettingsView(self.settings_service), LogsView(self.logs),
            on_hidden=self._hidden,
        )
        self.window.setWindowIcon(self.icons.app())
        self.tray = Tray(self.controller, self.earnings, self.icons,
                         open_window=self.show_window, quit_app=self.quit)
        self._told_hidden = False
        self._quit = asyncio.Event()
        self._ticker = QTimer(self)
        self._ticker.setInterval(TICK_MS)
        self._ticker.timeout.connect(self._tick)

        self.controller.hardware_detected.connect(self._on_hardware)
        self.controller.job_finished.connect(
            lambda record: self._notify(self.policy.job_finished(record.outcome)))
        self.controller.link_changed.connect(
            lambda state, _d: self._notify(self.policy.link(state, time.monotonic())))
        self.controller.failed.connect(lambda message: self._notify(self.policy.error(message)))
        self.earnings.updated.connect(self._on_earnings)
        self.settings_service.changed.connect(self._on_settings)
        self.hardware_view.refresh_button.clicked.connect(lambda: spawn(self.detect()))

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
        self.earnings.start()
        self._ticker.start()
        if not self.settings.first_run_done:
            self.open_wizard()
        elif self.settings.start_earning_at_launch:
            self.controller.start()

    async def detect(self) -> HardwareReport | None:
        try:
            return await self.controller.detect()
        except WorkerError as exc:
            self._notify(self.policy.error(str(exc)))
            return None

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
        await self.controller.stop_and_wait()
        await self.earnings.stop()
        self.logs.detach(logging.getLogger("desktop_worker"))
        self.tray.hide()
        if self.wizard is not None:
            self.wizard.close()
        self.window.quitting = True
        self.window.close()

    # --- first run --------------------------------------------------------------------------------

    def open_wizard(self) -> FirstRunWizard:
        self.wizard = FirstRunWizard(self.settings.ln_url, self._wizard_done, self.window,
                                     logo=self.icons.pixmap("app", 48))
        self.wizard.show_hardware(self.hardware, self.settings.vram_cap_mb)
        self.wizard.show()
        return self.wizard

    def _wizard_done(self, ln_url: str | None, model: CatalogModel | None, start: bool) -> None:
        try:
            self.settings_service.update(ln_url=ln_url, first_run_done=True)
        except WorkerError as exc:
            self._notify(self.policy.error(f"could not save your settings: {exc}"))
            return
        spawn(self._first_start(model, start))

    async def _first_start(self, model: CatalogModel | None, start: bool) -> None:
        if model is not None and model.name not in self.models.store:
            self.window.show_tab("Models")
            outcome = await self.models.pull(model.name, force=True)
            if outcome != "done":
                return
        if start:
            self.controller.start()

    # --- reactions --------------------------------------------------------------------------------

    def _on_hardware(self, report: HardwareReport) -> None:
        self.hardware = report
        self.hardware_view.show_report(report)
        if self.wizard is not None and self.wizard.isVisible():
            self.wizard.show_hardware(report, self.settings.vram_cap_mb)

    def _on_earnings(self, earnings: WorkerEarnings) -> None:
        self.header.show_today(earnings.today_msat)
        self.policy.already_served(earnings.jobs_settled)
        for notice in self.policy.payouts(earnings.recent_payouts):
            self._notify(notice)

    def _on_settings(self, settings: WorkerSettings) -> None:
        self.controller.settings = settings
        self.models.apply_settings(settings)
        self.header.show_queen(settings.queen_url)
        self.window.settings.load(settings)
        self.earnings.poke()

    def _tick(self) -> None:
        self._notify(self.policy.tick(time.monotonic()))

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
        guard.release()
