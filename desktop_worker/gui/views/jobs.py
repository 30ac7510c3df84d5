"""The Jobs tab: running and recent jobs, newest on top, with tokens, speed, sats and outcome
(a training job's progress while it runs).

The rows, what each cell shows and when a job's sats are known live in the widget-free
``JobsTableModel`` (``gui/jobs_table.py``); this view lays out a table over it, keeps this
session's totals and connects the worker's and the queen's news to the model. Its line above
the table (``jobs_summary``) follows whether the worker earns and what the queen has settled.

``show_rows`` gives a table room for a number of rows before it scrolls (the Earnings tab's
Settled jobs uses it too).
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
from desktop_worker.gui.jobs_table import JobsTableModel, jobs_summary
from desktop_worker.gui.services.earnings import EarningsService
from desktop_worker.gui.services.worker import JobStart, WorkerController
from desktop_worker.jobs import JobRecord

ROW_PADDING_PX = 8  # a compact row: the text's height and this much room
SETTLED_ROWS_SHOWN = 5  # the Earnings tab's Settled jobs: rows shown before it scrolls


def show_rows(table: QTableView, rows: int) -> int:
    """Make ``table`` tall enough for ``rows`` compact rows under its header before it scrolls
    (its minimum height, which is returned), never shorter than that however the page above
    it grows."""
    vertical = table.verticalHeader()
    vertical.setMinimumSectionSize(1)
    vertical.setDefaultSectionSize(table.fontMetrics().height() + ROW_PADDING_PX)
    header = table.horizontalHeader().sizeHint().height()
    height = header + rows * vertical.defaultSectionSize() + 2 * table.frameWidth()
    table.setMinimumHeight(height)
    table.setMaximumHeight(max(table.maximumHeight(), height))
    return height


class JobsView(QWidget):
    def __init__(self, controller: WorkerController, earnings: EarningsService,
                 parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.controller = controller
        self.earnings = earnings
        self.model = JobsTableModel(self)
        self.summary = plain_label()
        self.summary.setWordWrap(True)
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
        controller.job_progress.connect(self.model.job_progress)
        controller.job_rendered.connect(self.model.job_rendered)
        controller.running_changed.connect(lambda _running: self.show_summary())
        earnings.updated.connect(lambda _e: self.fill_sats())
        earnings.updated.connect(lambda _e: self.show_summary())
        self.show_summary()

    def show_summary(self) -> None:
        self.summary.setText(jobs_summary(
            served=self.served, tokens=self.tokens, earning=self.controller.running,
            settled_before=self.earnings.earnings.jobs_settled > 0))

    def cell(self, job_id: str, column: str) -> str | None:
        return self.model.cell(job_id, column)

    def on_started(self, start: JobStart) -> None:
        self.model.job_started(start)

    def on_finished(self, record: JobRecord) -> None:
        self.model.job_finished(record)
        if record.outcome == "ok":
            self.served += 1
            self.tokens += record.completion_tokens
        self.show_summary()
        self.fill_sats()
        self.earnings.poke()

    def fill_sats(self) -> None:
        self.model.fill_sats(self.earnings.earned_for)
