"""The tray icon: one icon per state, a tooltip with the status and today's sats, and a menu
(Start/Stop Earning, Pause/Resume Earning, Open Apiary, today's sats, Quit) rebuilt every time
it opens. Start and Stop are the app's (``toggle``: it remembers whether to start at the next
launch). Pause (issue 35) pauses this run only (``WorkerController.pause``, ``TRAY_PAUSE``), the
queen told why, until Resume or the next Stop; it is offered while earning and not paused by
the owner's settings, whose pauses lift by themselves. While the
owner's controls pause the worker (issue 17), the icon is the paused one and the tooltip and
the menu say why ("Paused: on battery"). While the worker serves a model group (issue 19), the
tooltip and the menu say what it does for it, the queen's model name kept from being read as
markup (``tooltip_safe``)."""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtCore import QObject
from PySide6.QtGui import QAction
from PySide6.QtWidgets import QMenu, QSystemTrayIcon

from desktop_worker.gui.common import Icons, notification_text
from desktop_worker.gui.notify import Notice
from desktop_worker.gui.services.earnings import EarningsService, today_text
from desktop_worker.gui.services.groups import tooltip_safe
from desktop_worker.gui.services.worker import (
    TRAY_PAUSE,
    TrayState,
    WorkerController,
    status_text,
)

LEVELS = {
    "info": QSystemTrayIcon.MessageIcon.Information,
    "warning": QSystemTrayIcon.MessageIcon.Warning,
    "error": QSystemTrayIcon.MessageIcon.Critical,
}


class Tray(QObject):
    def __init__(
        self,
        controller: WorkerController,
        earnings: EarningsService,
        icons: Icons,
        *,
        open_window: Callable[[], None],
        quit_app: Callable[[], None],
        toggle: Callable[[], None] | None = None,
        parent: QObject | None = None,
    ) -> None:
        """``toggle``: Start/Stop Earning (None: the controller's own)."""
        super().__init__(parent)
        self.controller = controller
        self.toggle = toggle or controller.toggle
        self.earnings = earnings
        self.icons = icons
        self.open_window = open_window
        self.quit_app = quit_app
        self.icon = QSystemTrayIcon(icons.state("stopped"), self)
        self.menu = QMenu()
        self.menu.aboutToShow.connect(self.rebuild)
        self.icon.setContextMenu(self.menu)
        self.icon.activated.connect(self._activated)
        self.actions: dict[str, QAction] = {}
        self.notices: list[Notice] = []
        controller.state_changed.connect(lambda *_: self.refresh())
        controller.paused_changed.connect(lambda _why: self.refresh())
        controller.group_changed.connect(lambda _group: self.refresh())
        earnings.updated.connect(lambda _e: self.refresh())
        self.rebuild()
        self.refresh()

    @property
    def state(self) -> str:
        return self.controller.state.value

    def show(self) -> None:
        self.icon.show()

    def hide(self) -> None:
        self.icon.hide()

    def refresh(self) -> None:
        """Icon and tooltip for the current state."""
        self.icon.setIcon(self.icons.state(self.state))
        self.icon.setToolTip(self.tooltip())

    def tooltip(self) -> str:
        status = self.group_text() or status_text(TrayState(self.state))
        why = self.paused_text()
        if why:
            status = why
        return f"Apiary: {status}\n{self.today_text()}"

    def paused_text(self) -> str:
        """"Paused: <why>" while the owner's controls pause the worker, else ""."""
        reason = self.controller.paused
        if self.state != TrayState.PAUSED.value or not reason:
            return ""
        return "Paused from the tray" if reason == TRAY_PAUSE else f"Paused: {reason}"

    def pause_action(self) -> str | None:
        """"Pause Earning" while earning unpaused, "Resume Earning" after the tray's Pause;
        None otherwise (stopped, starting, or paused by the owner's settings)."""
        if self.state == TrayState.PAUSED.value:
            return "Resume Earning" if self.controller.paused == TRAY_PAUSE else None
        if self.state in (TrayState.IDLE.value, TrayState.WORKING.value,
                          TrayState.CONNECTING.value) and self.controller.service is not None:
            return "Pause Earning"
        return None

    def pause_or_resume(self) -> None:
        if self.state == TrayState.PAUSED.value:
            self.controller.resume()
        else:
            self.controller.pause(TRAY_PAUSE)

    def group_text(self) -> str:
        """What the worker does for a model group, while earning in one, else ""."""
        group = self.controller.group
        if group is None or self.state not in (TrayState.IDLE.value, TrayState.WORKING.value):
            return ""
        return tooltip_safe(status_text(TrayState(self.state), group))

    def today_text(self) -> str:
        return today_text(self.earnings.earnings.today_msat, self.earnings.pays)

    def rebuild(self) -> None:
        """The menu, as it should read now (connected to ``aboutToShow``)."""
        self.menu.clear()
        running = self.controller.running
        toggle = self.menu.addAction("Stop Earning" if running else "Start Earning")
        toggle.triggered.connect(self.toggle)
        pause_text = self.pause_action()
        pause = self.menu.addAction(pause_text) if pause_text else None
        if pause is not None:
            pause.triggered.connect(self.pause_or_resume)
        open_action = self.menu.addAction("Open Apiary")
        open_action.triggered.connect(self.open_window)
        today = self.menu.addAction(self.today_text())
        today.setEnabled(False)
        group_line = self.group_text()
        group = self.menu.addAction(group_line) if group_line else None
        if group is not None:
            group.setEnabled(False)
        paused = self.paused_text()
        why = self.menu.addAction(paused) if paused else None
        if why is not None:
            why.setEnabled(False)
        self.menu.addSeparator()
        quit_action = self.menu.addAction("Quit Apiary")
        quit_action.triggered.connect(self.quit_app)
        self.actions = {"toggle": toggle, "open": open_action, "today": today,
                        "quit": quit_action}
        if why is not None:
            self.actions["paused"] = why
        if pause is not None:
            self.actions["pause"] = pause
        if group is not None:
            self.actions["group"] = group

    def notify(self, notice: Notice) -> None:
        self.notices.append(notice)
        level = LEVELS.get(notice.level, QSystemTrayIcon.MessageIcon.Information)
        self.icon.showMessage(notice.title, notification_text(notice.message), level, 8000)

    def _activated(self, reason: QSystemTrayIcon.ActivationReason) -> None:
        if reason in (QSystemTrayIcon.ActivationReason.Trigger,
                      QSystemTrayIcon.ActivationReason.DoubleClick):
            self.open_window()
