"""The Earnings tab: today, last 7 days and total; pending (escrow), available and paid; the
payout history and a chart of daily earnings, painted with QPainter (the app ships without
QtCharts). Zeros are labelled as such until the queen answers."""

from __future__ import annotations

from datetime import date

from PySide6.QtCore import QRectF, QSize, Qt
from PySide6.QtGui import QColor, QFont, QPainter, QPaintEvent, QPen
from PySide6.QtWidgets import (
    QAbstractItemView,
    QFrame,
    QGridLayout,
    QHeaderView,
    QLabel,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from desktop_worker.gui.common import plain_label, sats
from desktop_worker.gui.services.earnings import EarningsService
from shared_schema import WorkerEarnings

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


CARDS = (
    ("today", "Today"),
    ("week", "Last 7 days"),
    ("total", "Total earned"),
    ("pending", "Pending (escrow)"),
    ("available", "Available to pay"),
    ("paid", "Paid to you"),
)


class Card(QFrame):
    def __init__(self, title: str, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("card")
        self.setStyleSheet("#card { background: #fffbeb; border: 1px solid #fde68a; "
                           "border-radius: 8px; }")
        self.value = plain_label("0 sats")
        self.value.setStyleSheet("font-size: 20px; font-weight: 600; color: #78350f;")
        label = QLabel(title)
        label.setStyleSheet("color: #6b7280;")
        layout = QVBoxLayout(self)
        layout.addWidget(label)
        layout.addWidget(self.value)


class EarningsView(QWidget):
    def __init__(self, service: EarningsService, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.note = plain_label("Not connected to a queen yet: these figures are zeros until it "
                           "answers.")
        self.note.setStyleSheet("color: #92400e;")
        self.note.setWordWrap(True)
        self.cards = {key: Card(title) for key, title in CARDS}
        grid = QGridLayout()
        for i, (key, _) in enumerate(CARDS):
            grid.addWidget(self.cards[key], i // 3, i % 3)
        self.escrow = plain_label()
        self.escrow.setStyleSheet("color: #4b5563;")
        self.chart = DailyChart()
        self.payouts = QTableWidget(0, 4)
        self.payouts.setHorizontalHeaderLabels(("When", "Amount", "State", "Detail"))
        self.payouts.verticalHeader().setVisible(False)
        self.payouts.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.payouts.horizontalHeader().setSectionResizeMode(
            QHeaderView.ResizeMode.ResizeToContents)
        self.payouts.horizontalHeader().setStretchLastSection(True)
        self.payouts.setMaximumHeight(150)
        layout = QVBoxLayout(self)
        layout.addWidget(self.note)
        layout.addLayout(grid)
        layout.addWidget(self.escrow)
        layout.addWidget(QLabel("<b>Daily earnings, last 30 days</b>"))
        layout.addWidget(self.chart, 1)
        layout.addWidget(QLabel("<b>Payouts</b>"))
        layout.addWidget(self.payouts)
        service.updated.connect(self.show_earnings)
        service.note.connect(self.show_note)

    def show_note(self, text: str) -> None:
        self.note.setText(text + (" The figures shown are the last known ones (zeros if none)."
                                  if text else ""))
        self.note.setVisible(bool(text))

    def show_earnings(self, earnings: WorkerEarnings) -> None:
        values = {"today": earnings.today_msat, "week": earnings.week_msat,
                  "total": earnings.total_msat, "pending": earnings.pending_msat,
                  "available": earnings.available_msat, "paid": earnings.paid_msat}
        for key, msat in values.items():
            self.cards[key].value.setText(sats(msat))
        if earnings.escrow_jobs_left:
            self.escrow.setText(f"{earnings.jobs_settled} job(s) settled. A new worker's first "
                                f"jobs are held in escrow: {earnings.escrow_jobs_left} more "
                                "until pending earnings become available.")
        else:
            self.escrow.setText(f"{earnings.jobs_settled} job(s) settled.")
        self.chart.set_days([(d.day, d.earned_msat / 1000) for d in earnings.daily])
        self.payouts.setRowCount(len(earnings.recent_payouts))
        for row, payout in enumerate(earnings.recent_payouts):
            cells = (payout.updated_at.strftime("%Y-%m-%d %H:%M"), sats(payout.amount_msat),
                     payout.state, payout.detail)
            for column, text in enumerate(cells):
                self.payouts.setItem(row, column, QTableWidgetItem(text))
