"""The app's icons, one per tray state, from ``resources/icons/`` (SVG, rendered by QtSvg)."""

from __future__ import annotations

from PySide6.QtCore import QSize
from PySide6.QtGui import QIcon, QPixmap

from desktop_worker.resources import resource_path

STATES = ("stopped", "connecting", "idle", "working", "error")


class Icons:
    """Loads each icon once. Raises ``ResourceMissing`` for a broken install."""

    def __init__(self) -> None:
        self._cache: dict[str, QIcon] = {}

    def get(self, name: str) -> QIcon:
        icon = self._cache.get(name)
        if icon is None:
            icon = QIcon(str(resource_path("icons", f"{name}.svg")))
            self._cache[name] = icon
        return icon

    def app(self) -> QIcon:
        return self.get("app")

    def state(self, state: str) -> QIcon:
        return self.get(state if state in STATES else "error")

    def pixmap(self, name: str, size: int) -> QPixmap:
        return self.get(name).pixmap(QSize(size, size))
