"""The main window: the header (the big Start Earning / Stop toggle, the status with its reason
and a live reconnect countdown, a button for the fix when something needs the owner, the
queen's address, today's sats) over the tabs. Closing it hides it; the app keeps earning in the
tray until Quit.

While the owner's pause settings pause the worker (issue 17), the header says "Paused" and why,
in violet, and that earning resumes by itself (``paused_detail``); after the tray's Pause, that
Resume takes jobs again, with a Resume button.

While the worker serves a model group (issue 19), the status says what it does for it
("Serving 12 layers of SmolLM2 for a group") and the detail line why no jobs of its own arrive
(``status_text``, ``group_detail``), unless a pause, an audit flag or an error has more to say.

Whenever it is not earning, the detail says why in whole sentences, with the fix beside it
(issue 35): Add a model, Fix the queen URL, Retry now while it waits to reconnect, or the Start
Earning toggle itself (``not_earning``). The header never changes size: the reason has three
lines reserved and is fitted to them a sentence at a time (``fitted.ReasonLabel``, the whole
text in its tooltip), and the status, queen and today lines are elided rather than widen the
window (``fitted.ElidedLabel``), so nothing below it (the Settings tab's Save) moves when its
text grows."""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QCloseEvent
from PySide6.QtWidgets import (
    QFrame,
    QGridLayout,
    QLabel,
    QMainWindow,
    QPushButton,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from desktop_worker.gui.common import Icons
from desktop_worker.gui.fitted import ElidedLabel, ReasonLabel, relayout
from desktop_worker.gui.services.earnings import today_text
from desktop_worker.gui.services.groups import group_detail
from desktop_worker.gui.services.worker import (
    FIX_LABELS,
    TRAY_PAUSE,
    TrayState,
    WorkerController,
    as_sentence,
    countdown_text,
    paused_detail,
    reconnect_fix,
    status_text,
)
from desktop_worker.gui.views.earnings import EarningsView
from desktop_worker.gui.views.hardware import HardwareView
from desktop_worker.gui.views.jobs import JobsView
from desktop_worker.gui.views.logs import LogsView
from desktop_worker.gui.views.models import ModelsView
from desktop_worker.gui.views.settings import SettingsView

__all__ = ["PAUSED_STYLE", "REASON_LINES", "Header", "MainWindow"]

START_STYLE = ("QPushButton { background: #16a34a; color: white; font-size: 17px; "
               "font-weight: 600; border-radius: 8px; padding: 10px 26px; }"
               "QPushButton:hover { background: #15803d; }")
STOP_STYLE = ("QPushButton { background: #e5e7eb; color: #111827; font-size: 17px; "
              "font-weight: 600; border-radius: 8px; padding: 10px 26px; }"
              "QPushButton:hover { background: #d1d5db; }")


FIX_STYLE = ("QPushButton { background: #fde68a; color: #78350f; font-weight: 600; "
             "border-radius: 6px; padding: 6px 14px; }"
             "QPushButton:hover { background: #fcd34d; }")
DETAIL_STYLE = "color: #4b5563;"
FLAG_STYLE = "color: #b91c1c; font-weight: 600;"
PAUSED_STYLE = "color: #6d28d9; font-weight: 600;"
REASON_LINES = 3  # the reason area's height, in lines: it never grows


class Header(QFrame):
    fix_requested = Signal(str)  # a FIX_LABELS key
    toggle_requested = Signal()  # the owner clicked Start Earning / Stop

    def __init__(self, controller: WorkerController, icons: Icons,
                 parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.controller = controller
        self.icons = icons
        self.setObjectName("header")
        self.setStyleSheet("#header { background: #fffbeb; border-bottom: 1px solid #fcd34d; }")
        self.icon = QLabel()
        self.status = ElidedLabel()
        self.status.setObjectName("status")
        self.status.setStyleSheet("font-size: 16px; font-weight: 600;")
        # Why (not) earning, refusals and errors, in lines reserved whatever the text: the
        # header never changes height, nor widens the window (the text is fitted instead).
        self.detail = ReasonLabel(REASON_LINES)
        self.detail.setStyleSheet(DETAIL_STYLE)
        self.fix = QPushButton()
        self.fix.setObjectName("fix")
        self.fix.setStyleSheet(FIX_STYLE)
        self.fix.setVisible(False)
        self.fix.clicked.connect(lambda: self.fix_requested.emit(self.fix_key or ""))
        self.fix_key: str | None = None
        self.problem: str | None = None  # the app's own (a download that failed), until Start
        self.problem_fix: str | None = None
        self.audit_warning = ""  # the queen's audits flagged this worker ("" when not)
        self.ticker = QTimer(self)
        self.ticker.setInterval(1000)
        self.ticker.timeout.connect(self.tick)
        self.queen = ElidedLabel()
        self.queen.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.queen.setStyleSheet("color: #4b5563;")
        self.today = ElidedLabel()
        self.today.setStyleSheet("font-size: 15px; color: #92400e; font-weight: 600;")
        self.toggle = QPushButton()
        self.toggle.setObjectName("toggle")
        self.toggle.setMinimumWidth(190)
        self.toggle.setCursor(Qt.CursorShape.PointingHandCursor)
        self.toggle.clicked.connect(self.toggle_requested.emit)

        # The status beside today's sats; the reason beside the fix and the toggle; the queen
        # under both, so each line has the most room the header can give it.
        grid = QGridLayout(self)
        grid.setContentsMargins(16, 12, 16, 12)
        grid.setHorizontalSpacing(12)
        grid.setVerticalSpacing(2)
        grid.addWidget(self.icon, 0, 0, 3, 1, Qt.AlignmentFlag.AlignTop)
        grid.addWidget(self.status, 0, 1, 1, 2)
        grid.addWidget(self.today, 0, 3, Qt.AlignmentFlag.AlignRight)
        grid.addWidget(self.detail, 1, 1)
        grid.addWidget(self.fix, 1, 2, Qt.AlignmentFlag.AlignVCenter)
        grid.addWidget(self.toggle, 1, 3, Qt.AlignmentFlag.AlignVCenter)
        grid.addWidget(self.queen, 2, 1, 1, 3)
        grid.setColumnStretch(1, 1)

        controller.state_changed.connect(self.show_state)
        controller.running_changed.connect(self.show_running)
        controller.group_changed.connect(lambda _group: self.refresh())
        self.show_state(controller.state.value, controller.detail)
        self.show_running(controller.running)
        self.show_queen(controller.settings.queen_url)
        self.show_today(0)

    def refresh(self) -> None:
        """Say it again from the controller's state (what it depends on may have changed: a
        model added, the start-at-launch setting)."""
        self.show_state(self.controller.state.value, self.controller.detail)

    def show_state(self, state: str, detail: str) -> None:
        controller = self.controller
        self.icon.setPixmap(self.icons.pixmap(state, 44))
        self.status.set_full_text(status_text(TrayState(state), controller.group))
        fix = controller.fix if state == TrayState.ERROR.value else None
        if state == TrayState.ERROR.value:
            detail = as_sentence(detail)
        elif state == TrayState.STOPPED.value and self.problem is not None:
            detail, fix = self.problem, self.problem_fix
        elif state == TrayState.STOPPED.value and controller.running:
            detail = "Starting…"
        elif state == TrayState.STOPPED.value:
            detail = ""  # why not: ``not_earning``, unless the audits' flag has it
        elif controller.link_state == "disconnected":
            fix = reconnect_fix(controller.reason_kind)  # Retry now cuts the wait short
        flagged = bool(self.audit_warning) and state != TrayState.ERROR.value and (
            state in (TrayState.IDLE.value, TrayState.WORKING.value) or not detail)
        if flagged:  # nothing more urgent to say (an error, a reconnect): the flag
            detail = self.audit_warning
        if state == TrayState.STOPPED.value and not detail:
            detail, fix = controller.not_earning()
        group = controller.group
        if group is not None and not flagged and state in (TrayState.IDLE.value,
                                                           TrayState.WORKING.value):
            detail = group_detail(group)  # why no jobs of its own arrive
        paused = state == TrayState.PAUSED.value and bool(controller.paused)
        if paused:  # why, whatever the link said last
            detail = paused_detail(controller.paused or "")
            fix = "resume" if controller.paused == TRAY_PAUSE else None
        self.detail.setStyleSheet(PAUSED_STYLE if paused else
                                  FLAG_STYLE if flagged else DETAIL_STYLE)
        self._show_fix(fix)
        relayout(self)  # the fix button takes its room first
        self.detail.set_reason(detail)
        if controller.retry_at is not None:
            self.ticker.start()
        else:
            self.ticker.stop()

    def tick(self) -> None:
        """Once a second while the link waits to reconnect: the countdown, live."""
        controller = self.controller
        if controller.retry_at is None:
            self.ticker.stop()
            return
        self.detail.set_reason(countdown_text(controller.reason, controller.retry_at,
                                              controller.clock()))

    def show_problem(self, text: str, fix: str | None) -> None:
        """Something the app itself could not do (Start was skipped): why, and the fix."""
        self.problem = text
        self.problem_fix = fix
        self.refresh()

    def show_audit(self, warning: str) -> None:
        """The queen's audits flagged this worker (``audit_header_text``; "" when not). It
        takes the detail line whenever no error, problem of the app's own or reconnect
        countdown is on show."""
        if warning != self.audit_warning:
            self.audit_warning = warning
            self.refresh()

    def clear_problem(self) -> None:
        if self.problem is not None:
            self.problem = None
            self.refresh()

    def _show_fix(self, fix: str | None) -> None:
        self.fix_key = fix
        self.fix.setText(FIX_LABELS.get(fix or "", ""))
        self.fix.setVisible(fix in FIX_LABELS)

    def show_running(self, running: bool) -> None:
        if running:
            self.clear_problem()
        self.toggle.setText("Stop" if running else "Start Earning")
        self.toggle.setStyleSheet(STOP_STYLE if running else START_STYLE)
        self.refresh()

    def show_queen(self, url: str) -> None:
        self.queen.set_full_text(f"Queen: {url}")

    def show_today(self, msat: int, pays: bool | None = None) -> None:
        """Today's sats; on a queen that said it pays nothing, that instead of a zero."""
        self.today.set_full_text(today_text(msat, pays))


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
