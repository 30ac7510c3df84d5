"""What the views share: how numbers read (sats, sizes, durations), the app's icons, and
starting coroutines from Qt slots on the app's qasync loop, and labels that show text as
plain text (``plain_label``: what the queen or the hub sends must never be read as HTML)."""

from __future__ import annotations

import asyncio
import html
import logging
import math
import sys
from collections.abc import Coroutine
from typing import Any

from PySide6.QtCore import QSize, Qt
from PySide6.QtGui import QIcon, QPixmap
from PySide6.QtWidgets import QLabel

from desktop_worker.resources import resource_path

log = logging.getLogger(__name__)

# --- numbers --------------------------------------------------------------------------------------


def size(n: int | float | None) -> str:
    """Bytes in binary units (``1.5 GB`` means GiB, as the rest of the worker counts)."""
    if n is None:
        return "?"
    value = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if abs(value) < 1024 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TB"


def duration(seconds: float | None) -> str:
    """``42 s``, ``3 min 5 s``, ``2 h 10 min``; ``?`` when unknown."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "?"
    if seconds < 10:
        return f"{seconds:.1f} s"
    whole = round(seconds)
    if whole < 60:
        return f"{whole} s"
    minutes, secs = divmod(whole, 60)
    if minutes < 60:
        return f"{minutes} min {secs} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min"


def speed(bytes_per_s: float | None) -> str:
    return "?" if bytes_per_s is None else f"{size(bytes_per_s)}/s"


# --- text from elsewhere -----------------------------------------------------------------------


def plain_label(text: str = "") -> QLabel:
    """A label that shows its text literally. QLabel's default (AutoText) renders a string
    that looks like HTML, so a refusal reason such as ``<img src=...>`` from a queen would
    become markup (an image fetched, a fake link): every label showing text that came from
    the queen, the hub or an error message is made with this."""
    label = QLabel()
    label.setTextFormat(Qt.TextFormat.PlainText)
    label.setText(text)
    return label


def notification_text(text: str, platform: str = sys.platform) -> str:
    """``text`` for a tray notification's body, shown literally. Linux desktops'
    notification servers (freedesktop) may read the body as markup, so there it is
    escaped; elsewhere the body is plain text already."""
    return html.escape(text, quote=False) if platform.startswith("linux") else text


# --- icons ----------------------------------------------------------------------------------------

STATES = ("stopped", "connecting", "idle", "working", "paused", "error")


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


# --- tasks ----------------------------------------------------------------------------------------

_RUNNING: set[asyncio.Task[Any]] = set()


def spawn(coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
    task = asyncio.ensure_future(coro)
    _RUNNING.add(task)
    task.add_done_callback(_done)
    return task


def _done(task: asyncio.Task[Any]) -> None:
    _RUNNING.discard(task)
    if not task.cancelled() and task.exception() is not None:
        log.error("background task failed", exc_info=task.exception())
