"""The Earnings tab: today, last 7 days and total; pending (escrow), available and paid; the
payout history and a chart of daily earnings. Zeros are labelled as such until the queen
answers."""

from __future__ import annotations

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

from desktop_worker.gui.format import sats
from desktop_worker.gui.services.earnings import EarningsService
from desktop_worker.gui.views.chart import DailyChart
from shared_schema import WorkerEarnings

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
        self.value = QLabel("0 sats")
        self.value.setStyleSheet("font-size: 20px; font-weight: 600; color: #78350f;")
        label = QLabel(title)
        label.setStyleSheet("color: #6b7280;")
        layout = QVBoxLayout(self)
        layout.addWidget(label)
        layout.addWidget(self.value)


class EarningsView(QWidget):
    def __init__(self, service: EarningsService, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.note = QLabel("Not connected to a queen yet: these figures are zeros until it "
                           "answers.")
        self.note.setStyleSheet("color: #92400e;")
        self.note.setWordWrap(True)
        self.cards = {key: Card(title) for key, title in CARDS}
        grid = QGridLayout()
        for i, (key, _) in enumerate(CARDS):
            grid.addWidget(self.cards[key], i // 3, i % 3)
        self.escrow = QLabel()
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
