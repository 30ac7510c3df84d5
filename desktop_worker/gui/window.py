"""The main window: the header over the tabs. Closing it hides it; the app keeps earning in the
tray until Quit."""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtCore import Qt
from PySide6.QtGui import QCloseEvent
from PySide6.QtWidgets import QMainWindow, QTabWidget, QVBoxLayout, QWidget

from desktop_worker.gui.views.earnings import EarningsView
from desktop_worker.gui.views.hardware import HardwareView
from desktop_worker.gui.views.header import Header
from desktop_worker.gui.views.jobs import JobsView
from desktop_worker.gui.views.logs import LogsView
from desktop_worker.gui.views.models import ModelsView
from desktop_worker.gui.views.settings import SettingsView

TABS = ("Hardware", "Models", "Jobs", "Earnings", "Settings", "Logs")


class MainWindow(QMainWindow):
    def __init__(
        self,
        header: Header,
        hardware: HardwareView,
        models: ModelsView,
        jobs: JobsView,
        earnings: EarningsView,
        settings: SettingsView,
        logs: LogsView,
        *,
        on_hidden: Callable[[], None] = lambda: None,
    ) -> None:
        super().__init__()
        self.setWindowTitle("Apiary")
        self.header = header
        self.hardware = hardware
        self.models = models
        self.jobs = jobs
        self.earnings = earnings
        self.settings = settings
        self.logs = logs
        self.tabs = QTabWidget()
        for view, title in zip((hardware, models, jobs, earnings, settings, logs), TABS,
                               strict=True):
            self.tabs.addTab(view, title)
        body = QWidget()
        layout = QVBoxLayout(body)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(0)
        layout.addWidget(header)
        tabs_box = QWidget()
        tabs_layout = QVBoxLayout(tabs_box)
        tabs_layout.setContentsMargins(10, 10, 10, 10)
        tabs_layout.addWidget(self.tabs)
        layout.addWidget(tabs_box, 1)
        self.setCentralWidget(body)
        self.resize(920, 640)
        self.quitting = False
        self.on_hidden = on_hidden

    def show_tab(self, title: str) -> None:
        self.tabs.setCurrentIndex(TABS.index(title))

    def bring_up(self) -> None:
        self.show()
        self.setWindowState(self.windowState() & ~Qt.WindowState.WindowMinimized)
        self.raise_()
        self.activateWindow()

    def closeEvent(self, event: QCloseEvent) -> None:
        if self.quitting:
            event.accept()
            return
        event.ignore()
        self.hide()
        self.on_hidden()
