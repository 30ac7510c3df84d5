"""A small bar chart of daily earnings, painted with QPainter (the app ships without QtCharts)."""

from __future__ import annotations

from datetime import date

from PySide6.QtCore import QRectF, QSize, Qt
from PySide6.QtGui import QColor, QFont, QPainter, QPaintEvent, QPen
from PySide6.QtWidgets import QWidget

BAR = QColor("#f59e0b")
TODAY = QColor("#d97706")
AXIS = QColor("#9ca3af")
TEXT = QColor("#4b5563")


def nice_ceiling(value: float) -> float:
    """The smallest of 1, 2, 2.5, 5 x 10^n at or above ``value`` (the chart's top line)."""
    if value <= 0:
        return 1.0
    scale = 1.0
    while scale * 10 <= value:
        scale *= 10
    while scale > value:
        scale /= 10
    for step in (1, 2, 2.5, 5, 10):
        if step * scale >= value:
            return step * scale
    return 10 * scale


class DailyChart(QWidget):
    """Bars of sats per day; the last bar is today."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.days: list[tuple[date, float]] = []
        self.setMinimumHeight(170)

    def sizeHint(self) -> QSize:
        return QSize(520, 200)

    def set_days(self, days: list[tuple[date, float]]) -> None:
        self.days = days
        self.update()

    def paintEvent(self, _event: QPaintEvent) -> None:
        painter = QPainter(self)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        font = QFont(self.font())
        font.setPointSizeF(max(7.0, font.pointSizeF() * 0.85))
        painter.setFont(font)
        left, right, top, bottom = 46.0, 8.0, 10.0, 22.0
        width = self.width() - left - right
        height = self.height() - top - bottom
        values = [v for _, v in self.days]
        peak = nice_ceiling(max(values, default=0))
        painter.setPen(QPen(AXIS, 1))
        for fraction in (0.0, 0.5, 1.0):
            y = top + height * (1 - fraction)
            painter.drawLine(int(left), int(y), int(left + width), int(y))
            painter.setPen(TEXT)
            painter.drawText(QRectF(0, y - 8, left - 6, 16),
                             Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter,
                             f"{peak * fraction:,.0f}" if peak >= 10 else f"{peak * fraction:g}")
            painter.setPen(QPen(AXIS, 1))
        if not self.days:
            painter.setPen(TEXT)
            painter.drawText(QRectF(left, top, width, height), Qt.AlignmentFlag.AlignCenter,
                             "No earnings yet")
            return
        slot = width / len(self.days)
        for i, (day, value) in enumerate(self.days):
            bar_h = height * (value / peak) if peak else 0
            rect = QRectF(left + i * slot + slot * 0.15, top + height - bar_h, slot * 0.7, bar_h)
            painter.fillRect(rect, TODAY if i == len(self.days) - 1 else BAR)
            if i % 7 == (len(self.days) - 1) % 7:
                painter.setPen(TEXT)
                painter.drawText(QRectF(left + i * slot - 20, top + height + 3, slot + 40, 16),
                                 Qt.AlignmentFlag.AlignCenter, day.strftime("%b %d"))
        painter.setPen(TEXT)
        painter.drawText(QRectF(left + 4, top, width, 14), Qt.AlignmentFlag.AlignLeft, "sats/day")
