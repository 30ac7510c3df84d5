"""The Jobs tab: running and recent jobs, newest on top, with tokens, speed, sats and outcome.

Sats come from the queen (``recent_jobs`` in the earnings answer), joined on the job's request
id once it is settled.
"""

from __future__ import annotations

import datetime as dt

from PySide6.QtCore import Qt
from PySide6.QtGui import QColor
from PySide6.QtWidgets import (
    QAbstractItemView,
    QHeaderView,
    QLabel,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from desktop_worker.gui.common import sats_number
from desktop_worker.gui.services.earnings import EarningsService
from desktop_worker.gui.services.worker import JobStart, WorkerController
from desktop_worker.jobs import JobRecord

COLUMNS = ("Started", "Model", "Prompt tokens", "Completion tokens", "Tokens/s", "Duration",
           "Sats", "Outcome")
MAX_ROWS = 200
SATS = COLUMNS.index("Sats")
OUTCOME = COLUMNS.index("Outcome")


class JobsView(QWidget):
    def __init__(self, controller: WorkerController, earnings: EarningsService,
                 parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.earnings = earnings
        self.summary = QLabel("No jobs yet. Click Start Earning and jobs appear here as the "
                              "queen sends them.")
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.verticalHeader().setVisible(False)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        header = self.table.horizontalHeader()
        header.setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        header.setSectionResizeMode(1, QHeaderView.ResizeMode.Stretch)
        layout = QVBoxLayout(self)
        layout.addWidget(self.summary)
        layout.addWidget(self.table, 1)
        self._rows: list[str] = []  # job ids, top row first
        self.served = 0
        self.tokens = 0
        controller.job_started.connect(self.on_started)
        controller.job_finished.connect(self.on_finished)
        earnings.updated.connect(lambda _e: self.fill_sats())

    def row_of(self, job_id: str) -> int | None:
        try:
            return self._rows.index(job_id)
        except ValueError:
            return None

    def cell(self, job_id: str, column: str) -> str | None:
        row = self.row_of(job_id)
        if row is None:
            return None
        item = self.table.item(row, COLUMNS.index(column))
        return item.text() if item else None

    def _set(self, row: int, column: int, text: str, right: bool = False) -> None:
        item = QTableWidgetItem(text)
        if right:
            item.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        self.table.setItem(row, column, item)

    def on_started(self, start: JobStart) -> None:
        self.table.insertRow(0)
        self._rows.insert(0, start.job_id)
        started = dt.datetime.fromtimestamp(start.started).strftime("%H:%M:%S")
        for column, text in enumerate((started, start.model, "", "", "", "", "", "running")):
            self._set(0, column, text, right=2 <= column <= 6)
        self.table.item(0, OUTCOME).setForeground(QColor("#1d4ed8"))
        self.table.item(0, 0).setToolTip(start.job_id)
        while len(self._rows) > MAX_ROWS:
            self._rows.pop()
            self.table.removeRow(self.table.rowCount() - 1)

    def on_finished(self, record: JobRecord) -> None:
        row = self.row_of(record.job_id)
        if row is None:
            self.on_started(JobStart(record.job_id, record.model, record.kind,
                                     dt.datetime.now().timestamp() - record.seconds))
            row = 0
        values = (str(record.prompt_tokens), str(record.completion_tokens),
                  f"{record.tokens_per_s:.1f}", f"{record.seconds:.2f} s")
        for offset, text in enumerate(values):
            self._set(row, 2 + offset, text, right=True)
        self._set(row, SATS, "…", right=True)
        self._set(row, OUTCOME, record.outcome)
        colour = "#166534" if record.outcome == "ok" else "#b91c1c"
        self.table.item(row, OUTCOME).setForeground(QColor(colour))
        if record.outcome == "ok":
            self.served += 1
            self.tokens += record.completion_tokens
        self.summary.setText(f"{self.served} job(s) served this session, "
                             f"{self.tokens:,} tokens generated.")
        self.fill_sats()
        self.earnings.poke()

    def fill_sats(self) -> None:
        """Sats for the settled jobs. Jobs settle in order, so a job older than a settled one
        that the queen lists no earnings for earned nothing (a new worker's first job)."""
        later_settled = False
        for row, job_id in enumerate(self._rows):  # newest first
            item = self.table.item(row, SATS)
            if item is None or item.text() == "":
                continue  # still running
            earned = self.earnings.earned_for(job_id)
            if earned is not None:
                later_settled = True
                if item.text() == "…":
                    self._set(row, SATS, sats_number(earned), right=True)
            elif later_settled and item.text() == "…":
                self._set(row, SATS, "0", right=True)
                self.table.item(row, SATS).setToolTip(
                    "Nothing earned: a new worker's first job is its proof of work, or the "
                    "job failed")
