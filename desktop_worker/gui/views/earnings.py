"""The Earnings tab: today, last 7 days and total; pending (escrow), available and paid; the
payout history and a chart of daily earnings, painted with QPainter (the app ships without
QtCharts). Zeros are labelled as such until the queen answers. It explains itself: on a queen
that does not pay it says so (and shows no figures), the first job's proof of work is a row of
the jobs table, the payout threshold and an estimate of the next payout are shown, and with no
payout address a nudge opens Settings at the field. Beside the escrow line, the queen's audits
of this worker's answers (on a queen that says): not checked yet, checked and matching, or, in
a red box, flagged with what to do. On a queen that says how it pays (issue 35), who pays and
how comes first ("Paid to you@wallet.example over Lightning, automatically", "This queen's
operator pays by hand: ask them how and when", with the operator's note), each payout's state
is in words, and each of this worker's models says what it earns here and why."""

from __future__ import annotations

from datetime import UTC, date, datetime

from PySide6.QtCore import QRectF, QSize, Qt, Signal
from PySide6.QtGui import QColor, QFont, QPainter, QPaintEvent, QPen
from PySide6.QtWidgets import (
    QAbstractItemView,
    QFrame,
    QGridLayout,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QPushButton,
    QScrollArea,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from desktop_worker.gui.common import plain_label
from desktop_worker.gui.services.audit import AuditStanding, audit_text
from desktop_worker.gui.services.earnings import (
    NOT_PAYING_DETAIL,
    EarningsService,
    address_nudge,
    escrow_text,
    payout_cells,
    payout_terms_text,
    prices_text,
    proof_of_work_row,
)
from desktop_worker.gui.services.payout_estimate import payout_outlook
from desktop_worker.gui.units import sats, sats_number
from desktop_worker.gui.views.jobs import SETTLED_ROWS_SHOWN, show_rows
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


AUDIT_STYLE = "color: #166534;"
FLAGGED_STYLE = ("font-weight: 600; color: #991b1b; background: #fee2e2; border-radius: 6px; "
                 "padding: 8px;")
TERMS_STYLE = ("font-weight: 600; color: #78350f; background: #fef3c7; border-radius: 6px; "
               "padding: 8px;")
NUDGE_STYLE = ("QPushButton { background: #fde68a; color: #78350f; font-weight: 600; "
               "border-radius: 6px; padding: 4px 12px; }")


def _table(columns: tuple[str, ...], height: int) -> QTableWidget:
    table = QTableWidget(0, len(columns))
    table.setHorizontalHeaderLabels(columns)
    table.verticalHeader().setVisible(False)
    table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
    table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
    table.horizontalHeader().setStretchLastSection(True)
    table.setMaximumHeight(height)
    return table


class EarningsView(QWidget):
    add_address_requested = Signal()  # the nudge's button: open Settings at the payout field

    def __init__(self, service: EarningsService, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.service = service
        self.note = plain_label("Not connected to a queen yet: these figures are zeros until it "
                           "answers.")
        self.note.setStyleSheet("color: #92400e;")
        self.note.setWordWrap(True)
        self.not_paying = plain_label(NOT_PAYING_DETAIL)
        self.not_paying.setObjectName("not_paying")
        self.not_paying.setWordWrap(True)
        self.not_paying.setStyleSheet("font-size: 15px; font-weight: 600; color: #92400e; "
                                      "background: #fef3c7; border-radius: 6px; padding: 10px;")
        self.not_paying.setVisible(False)
        self.nudge = plain_label()
        self.nudge.setWordWrap(True)
        self.nudge.setStyleSheet("color: #92400e;")
        self.nudge_button = QPushButton("Add a payout address")
        self.nudge_button.setStyleSheet(NUDGE_STYLE)
        self.nudge_button.clicked.connect(self.add_address_requested.emit)
        nudge_row = QHBoxLayout()
        nudge_row.addWidget(self.nudge, 1)
        nudge_row.addWidget(self.nudge_button)
        self.nudge_box = QWidget()
        self.nudge_box.setLayout(nudge_row)
        self.nudge_box.setVisible(False)
        self.terms = plain_label()  # who pays and how (a queen that says)
        self.terms.setObjectName("payout_terms")
        self.terms.setWordWrap(True)
        self.terms.setStyleSheet(TERMS_STYLE)
        self.terms.setVisible(False)
        self.cards = {key: Card(title) for key, title in CARDS}
        grid = QGridLayout()
        for i, (key, _) in enumerate(CARDS):
            grid.addWidget(self.cards[key], i // 3, i % 3)
        self.escrow = plain_label()
        self.escrow.setStyleSheet("color: #4b5563;")
        self.escrow.setWordWrap(True)
        self.audit = plain_label()  # the queen's audits of this worker's answers
        self.audit.setObjectName("audit")
        self.audit.setWordWrap(True)
        self.audit.setVisible(False)
        self.threshold = plain_label()
        self.threshold.setStyleSheet("color: #4b5563;")
        self.eta = plain_label()
        self.eta.setStyleSheet("color: #4b5563; font-weight: 600;")
        self.model_prices = plain_label()  # what each of this worker's models earns, and why
        self.model_prices.setObjectName("model_prices")
        self.model_prices.setWordWrap(True)
        self.model_prices.setStyleSheet("color: #4b5563;")
        self.model_prices.setVisible(False)
        self.chart = DailyChart()
        self.jobs = _table(("Settled", "Job", "Sats"), 150)
        show_rows(self.jobs, SETTLED_ROWS_SHOWN)  # never two rows and a scrollbar (issue 35)
        self.payouts = _table(("When", "Amount", "State", "Detail"), 120)
        self.figures = QWidget()  # everything that means nothing on a queen that pays nothing
        figures = QVBoxLayout(self.figures)
        figures.setContentsMargins(0, 0, 0, 0)
        figures.addWidget(self.terms)
        figures.addWidget(self.nudge_box)
        figures.addLayout(grid)
        figures.addWidget(self.escrow)
        figures.addWidget(self.audit)
        figures.addWidget(self.threshold)
        figures.addWidget(self.eta)
        figures.addWidget(self.model_prices)
        figures.addWidget(QLabel("<b>Daily earnings, last 30 days</b>"))
        figures.addWidget(self.chart, 1)
        figures.addWidget(QLabel("<b>Settled jobs</b>"))
        figures.addWidget(self.jobs)
        figures.addWidget(QLabel("<b>Payouts</b>"))
        figures.addWidget(self.payouts)
        # The figures keep the room they need (the chart, the tables' rows); a small window
        # scrolls them rather than drawing one over another.
        self.scroll = QScrollArea()
        self.scroll.setWidget(self.figures)
        self.scroll.setWidgetResizable(True)
        self.scroll.setFrameShape(QFrame.Shape.NoFrame)
        self.scroll.viewport().setAutoFillBackground(False)  # the tab's own background
        self.figures.setAutoFillBackground(False)
        layout = QVBoxLayout(self)
        layout.addWidget(self.note)
        layout.addWidget(self.not_paying, 0, Qt.AlignmentFlag.AlignTop)
        layout.addWidget(self.scroll, 1)
        service.updated.connect(self.show_earnings)
        service.note.connect(self.show_note)

    def show_note(self, text: str) -> None:
        self.note.setText(text + (" The figures shown are the last known ones (zeros if none)."
                                  if text else ""))
        self.note.setVisible(bool(text))

    def show_earnings(self, earnings: WorkerEarnings) -> None:
        paying = self.service.pays is not False
        self.not_paying.setVisible(not paying)
        self.scroll.setVisible(paying)
        self.figures.setVisible(paying)
        if not paying:
            self.note.setVisible(False)
            return
        values = {"today": earnings.today_msat, "week": earnings.week_msat,
                  "total": earnings.total_msat, "pending": earnings.pending_msat,
                  "available": earnings.available_msat, "paid": earnings.paid_msat}
        for key, msat in values.items():
            self.cards[key].value.setText(sats(msat))
        nudge = address_nudge(earnings, bool(self.service.payout_address()))
        self.nudge.setText(nudge)
        self.nudge_box.setVisible(bool(nudge))
        self.escrow.setText(escrow_text(earnings))
        self.show_audit(self.service.audit)
        mode = self.service.payout_mode
        terms = payout_terms_text(mode, earnings.payout_address, earnings.payout_note)
        self.terms.setText(terms)
        self.terms.setVisible(bool(terms))
        outlook = payout_outlook(earnings, self.service.threshold_msat,
                                 datetime.now(UTC).date(), mode, earnings.payout_interval_s)
        self.threshold.setText(outlook.threshold if outlook else "")
        self.eta.setText(outlook.eta if outlook else "")
        self.threshold.setVisible(outlook is not None)
        self.eta.setVisible(outlook is not None)
        prices = prices_text(self.service.prices, self.service.pays)
        self.model_prices.setText(prices)
        self.model_prices.setVisible(bool(prices))
        self.chart.set_days([(d.day, d.earned_msat / 1000) for d in earnings.daily])
        rows = [(job.settled_at.strftime("%Y-%m-%d %H:%M"), job.job_id,
                 sats_number(job.earned_msat)) for job in earnings.recent_jobs]
        rows.append(proof_of_work_row(earnings))  # the oldest: the first job, unpaid
        self.jobs.setRowCount(len(rows))
        for row, cells in enumerate(rows):
            for column, text in enumerate(cells):
                self.jobs.setItem(row, column, QTableWidgetItem(text))
        self.payouts.setRowCount(len(earnings.recent_payouts))
        for row, payout in enumerate(earnings.recent_payouts):
            for column, text in enumerate(payout_cells(payout)):
                self.payouts.setItem(row, column, QTableWidgetItem(text))

    def show_audit(self, standing: AuditStanding | None) -> None:
        """The audit line: hidden when the queen has not said; a red box when flagged."""
        self.audit.setVisible(standing is not None)
        if standing is None:
            self.audit.setText("")
            return
        self.audit.setText(audit_text(standing))
        self.audit.setStyleSheet(FLAGGED_STYLE if standing.flagged else AUDIT_STYLE)

    def job_rows(self) -> list[tuple[str, ...]]:
        """The settled-jobs table's text, row by row (for tests and screenshots)."""
        return _rows(self.jobs)

    def payout_rows(self) -> list[tuple[str, ...]]:
        """The payouts table's text, row by row (for tests and screenshots)."""
        return _rows(self.payouts)


def _rows(table: QTableWidget) -> list[tuple[str, ...]]:
    return [tuple(table.item(r, c).text() for c in range(table.columnCount()))
            for r in range(table.rowCount())]
