"""The Jobs tab's rows as a Qt table model: running and recent jobs, newest on top.

Widget-free (QtCore and QtGui only), so it is tested without a window: the rows, what each cell
shows and the sats rule live here, and ``views/jobs.py`` only lays out a ``QTableView`` over it.

The line above the table (``jobs_summary``) says what is true (issue 35): this session's jobs,
or none since the app opened while the queen has settled earlier ones (the header's sats), and
it points at Start Earning only while the worker is not earning.

A training job (issue 37) shows its progress while it runs: its outcome cell the step, share,
epoch and loss of its latest report, its prompt-tokens cell the tokens trained so far. An image
job (issue 38) shows a thumbnail of its first image beside its model once rendered, and its
images where a text job shows its completion tokens.

Sats come from the queen (``recent_jobs`` in the earnings answer), joined on the job's request
id once it is settled. Jobs settle in order, so a finished job older than a settled one that the
queen lists no earnings for earned nothing (a new worker's first job is its proof of work).
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from PySide6.QtCore import QAbstractTableModel, QModelIndex, QPersistentModelIndex, Qt
from PySide6.QtGui import QColor, QImage

from desktop_worker.gui.services.worker import JobStart
from desktop_worker.gui.units import sats_number
from desktop_worker.image_jobs import RenderedJob
from desktop_worker.jobs import JobProgress, JobRecord

COLUMNS = ("Started", "Model", "Prompt tokens", "Completion tokens", "Tokens/s", "Duration",
           "Sats", "Outcome")
MAX_ROWS = 200
SATS = COLUMNS.index("Sats")
OUTCOME = COLUMNS.index("Outcome")
#: Numbers, right-aligned: the token counts, speed, duration and sats.
NUMBERS = range(COLUMNS.index("Prompt tokens"), SATS + 1)

RUNNING = "running"
#: The sats of a finished job the queen has not settled yet.
AWAITING = "…"
UNPAID_TIP = ("Nothing earned: a new worker's first job is its proof of work, or the job "
              "failed")
OUTCOME_COLOURS = {RUNNING: "#1d4ed8", "ok": "#166534"}
FAILED_COLOUR = "#b91c1c"
THUMBNAIL_PX = 24  # an image job's thumbnail, this tall, beside its model

Index = QModelIndex | QPersistentModelIndex


def jobs_summary(*, served: int, tokens: int, earning: bool, settled_before: bool) -> str:
    """The Jobs tab's line: this session's count, else why the table is empty. ``earning``:
    the worker runs; ``settled_before``: the queen has settled jobs of this worker (earlier
    sessions, shown in the Earnings tab and the header's Today)."""
    if served:
        return f"{served:,} job(s) served since the app opened, {tokens:,} tokens generated."
    if settled_before:
        head = "No jobs since the app opened; earlier ones are in the Earnings tab."
    else:
        head = "No jobs yet."
    if earning:
        return f"{head} Jobs appear here as the queen sends them."
    return f"{head} Click Start Earning and jobs appear here as the queen sends them."


TRAINING = "training"


def training_text(progress: JobProgress) -> str:
    """A running training job's outcome cell: "training: step 12/40 (30 %), epoch 1, loss
    0.83"."""
    share = round(100 * progress.step / progress.total_steps) if progress.total_steps else 0
    return (f"{TRAINING}: step {progress.step:,}/{progress.total_steps:,} ({share} %), "
            f"epoch {progress.epoch}, loss {progress.loss:.2f}")


@dataclass
class JobRow:
    """One job in the table; the finished fields stay empty while it runs."""

    job_id: str
    model: str
    started: float
    outcome: str = RUNNING
    finished: tuple[str, str, str, str] = ("", "", "", "")  # tokens in, out, tokens/s, time
    sats: str = ""  # empty while running, AWAITING until settled, then the sats
    sats_tip: str | None = None
    images: int = 0  # an image job's images, once rendered
    thumbnail: QImage | None = None

    def text(self, column: int) -> str:
        if column == 0:
            return dt.datetime.fromtimestamp(self.started).strftime("%H:%M:%S")
        if column == 1:
            return self.model
        if column == SATS:
            return self.sats
        if column == OUTCOME:
            return self.outcome
        return self.finished[column - 2]


class JobsTableModel(QAbstractTableModel):
    """The rows of the Jobs tab, newest first, at most ``MAX_ROWS``."""

    def __init__(self, parent: Any = None) -> None:
        super().__init__(parent)
        self._rows: list[JobRow] = []

    # --- reading --------------------------------------------------------------------------------

    @property
    def job_ids(self) -> list[str]:
        """The jobs' ids, top row first."""
        return [row.job_id for row in self._rows]

    def row_of(self, job_id: str) -> int | None:
        for number, row in enumerate(self._rows):
            if row.job_id == job_id:
                return number
        return None

    def cell(self, job_id: str, column: str) -> str | None:
        """What the table shows for ``job_id`` under the heading ``column`` (None: no such job)."""
        number = self.row_of(job_id)
        return None if number is None else self._rows[number].text(COLUMNS.index(column))

    def rowCount(self, parent: Index = QModelIndex()) -> int:  # noqa: B008 (Qt's signature)
        return 0 if parent.isValid() else len(self._rows)

    def columnCount(self, parent: Index = QModelIndex()) -> int:  # noqa: B008
        return 0 if parent.isValid() else len(COLUMNS)

    def headerData(self, section: int, orientation: Qt.Orientation,
                   role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if (orientation == Qt.Orientation.Horizontal and role == Qt.ItemDataRole.DisplayRole
                and 0 <= section < len(COLUMNS)):
            return COLUMNS[section]
        return None

    def data(self, index: Index, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if not index.isValid() or not 0 <= index.row() < len(self._rows):
            return None
        row, column = self._rows[index.row()], index.column()
        if role == Qt.ItemDataRole.DisplayRole:
            return row.text(column)
        if role == Qt.ItemDataRole.DecorationRole and column == 1:
            return row.thumbnail
        if role == Qt.ItemDataRole.TextAlignmentRole and column in NUMBERS:
            return Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter
        if role == Qt.ItemDataRole.ForegroundRole and column == OUTCOME:
            outcome = RUNNING if row.outcome.startswith(TRAINING) else row.outcome
            return QColor(OUTCOME_COLOURS.get(outcome, FAILED_COLOUR))
        if role == Qt.ItemDataRole.ToolTipRole:
            if column == 0:
                return row.job_id
            if column == SATS:
                return row.sats_tip
        return None

    # --- changes --------------------------------------------------------------------------------

    def job_started(self, start: JobStart) -> None:
        """A new row on top, running; the oldest rows past ``MAX_ROWS`` go."""
        self.beginInsertRows(QModelIndex(), 0, 0)
        self._rows.insert(0, JobRow(start.job_id, start.model, start.started))
        self.endInsertRows()
        if len(self._rows) > MAX_ROWS:
            self.beginRemoveRows(QModelIndex(), MAX_ROWS, len(self._rows) - 1)
            del self._rows[MAX_ROWS:]
            self.endRemoveRows()

    def job_progress(self, progress: JobProgress) -> None:
        """A training job's latest report (issue 37): its outcome cell says how far it is
        (step, share, epoch, loss) and its prompt-tokens cell the tokens trained so far. A
        report for a row the table no longer has (or never had) is dropped."""
        number = self.row_of(progress.job_id)
        if number is None:
            return
        row = self._rows[number]
        if row.outcome != RUNNING and not row.outcome.startswith(TRAINING):
            return  # it finished meanwhile: its final numbers stay
        row.outcome = training_text(progress)
        row.finished = (f"{progress.trained_tokens:,}", "", "", "")
        self._changed(number)

    def job_finished(self, record: JobRecord) -> None:
        """The job's numbers and outcome, its sats awaiting the queen. A job never seen start
        gets its row now (started ``seconds`` ago)."""
        number = self.row_of(record.job_id)
        if number is None:
            self.job_started(JobStart(record.job_id, record.model, record.kind,
                                      dt.datetime.now().timestamp() - record.seconds))
            number = 0
        row = self._rows[number]
        if record.kind == "image":  # images, not tokens (issue 38)
            made = f"{row.images} image{'s' if row.images != 1 else ''}" if row.images else ""
            row.finished = ("", made, "", f"{record.seconds:.2f} s")
        else:
            row.finished = (str(record.prompt_tokens), str(record.completion_tokens),
                            f"{record.tokens_per_s:.1f}", f"{record.seconds:.2f} s")
        row.sats = AWAITING
        row.outcome = record.outcome
        self._changed(number)

    def job_rendered(self, done: RenderedJob) -> None:
        """An image job's images are made (issue 38): its row keeps their count and a
        thumbnail of the first (a picture that will not decode shows none)."""
        number = self.row_of(done.job_id)
        if number is None:
            return
        row = self._rows[number]
        row.images = done.images
        try:
            picture = QImage.fromData(base64.b64decode(done.first_image_b64, validate=True))
        except (binascii.Error, ValueError):
            picture = QImage()
        row.thumbnail = (None if picture.isNull() else picture.scaledToHeight(
            THUMBNAIL_PX, Qt.TransformationMode.SmoothTransformation))
        self._changed(number)

    def fill_sats(self, earned_for: Callable[[str], int | None]) -> None:
        """Sats for the settled jobs, from ``earned_for(job_id)`` (msat, or None while the
        queen lists no earnings for it)."""
        later_settled = False
        for number, row in enumerate(self._rows):  # newest first
            if row.sats == "":
                continue  # still running
            earned = earned_for(row.job_id)
            if earned is not None:
                later_settled = True
                if row.sats == AWAITING:
                    row.sats = sats_number(earned)
                    self._changed(number)
            elif later_settled and row.sats == AWAITING:
                row.sats = "0"
                row.sats_tip = UNPAID_TIP
                self._changed(number)

    def _changed(self, number: int) -> None:
        self.dataChanged.emit(self.index(number, 0), self.index(number, len(COLUMNS) - 1))
