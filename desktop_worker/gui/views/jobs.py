"""The Jobs tab: running and recent jobs, newest on top, with tokens, speed, sats and outcome.

The rows, what each cell shows and when a job's sats are known live in the widget-free
``JobsTableModel`` (``gui/jobs_table.py``); this view lays out a table over it, keeps this
session's totals and connects the worker's and the queen's news to the model.
"""

from __future__ import annotations

from PySide6.QtWidgets import (
    QAbstractItemView,
    QHeaderView,
    QTableView,
    QVBoxLayout,
    QWidget,
)

from desktop_worker.gui.common import plain_label
from desktop_worker.gui.jobs_table import JobsTableModel
from desktop_worker.gui.services.earnings import EarningsService
from desktop_worker.gui.services.worker import JobStart, WorkerController
from desktop_worker.jobs import JobRecord


class JobsView(QWidget):
    def __init__(self, controller: WorkerController, earnings: EarningsService,
                 parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.earnings = earnings
        self.model = JobsTableModel(self)
        self.summary = plain_label("No jobs yet. Click Start Earning and jobs appear here as the "
                              "queen sends them.")
        self.table = QTableView()
        self.table.setModel(self.model)
        self.table.verticalHeader().setVisible(False)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        header = self.table.horizontalHeader()
        header.setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        header.setSectionResizeMode(1, QHeaderView.ResizeMode.Stretch)
        layout = QVBoxLayout(self)
        layout.addWidget(self.summary)
        layout.addWidget(self.table, 1)
        self.served = 0
        self.tokens = 0
        controller.job_started.connect(self.on_started)
        controller.job_finished.connect(self.on_finished)
        earnings.updated.connect(lambda _e: self.fill_sats())

    def cell(self, job_id: str, column: str) -> str | None:
        return self.model.cell(job_id, column)

    def on_started(self, start: JobStart) -> None:
        self.model.job_started(start)

    def on_finished(self, record: JobRecord) -> None:
        self.model.job_finished(record)
        if record.outcome == "ok":
            self.served += 1
            self.tokens += record.completion_tokens
        self.summary.setText(f"{self.served} job(s) served this session, "
                             f"{self.tokens:,} tokens generated.")
        self.fill_sats()
        self.earnings.poke()

    def fill_sats(self) -> None:
        self.model.fill_sats(self.earnings.earned_for)
