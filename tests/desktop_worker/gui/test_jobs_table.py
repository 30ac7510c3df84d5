"""The Jobs tab's table model, without a window: rows, cells, colours and the sats rule.

``qtmodeltester`` (pytest-qt, Qt's ``QAbstractItemModelTester``) checks that the model keeps
Qt's rules for row counts, indexes and change signals as it changes, which a view relies on.
"""

from __future__ import annotations

import datetime as dt

import pytest
from PySide6.QtCore import QModelIndex, Qt
from PySide6.QtGui import QColor

from desktop_worker.gui.jobs_table import (
    AWAITING,
    COLUMNS,
    MAX_ROWS,
    OUTCOME,
    SATS,
    UNPAID_TIP,
    JobsTableModel,
)
from desktop_worker.gui.services.worker import JobStart
from desktop_worker.jobs import JobRecord

STARTED = dt.datetime(2026, 3, 1, 14, 5, 9).timestamp()


def start(job_id: str, model: str = "smollm2") -> JobStart:
    return JobStart(job_id, model, "chat", STARTED)


def record(job_id: str, outcome: str = "ok", completion_tokens: int = 40) -> JobRecord:
    return JobRecord(job_id, "smollm2", "chat", prompt_tokens=12,
                     completion_tokens=completion_tokens, seconds=2.0, outcome=outcome)


def shown(model: JobsTableModel, row: int, column: int, role: Qt.ItemDataRole
          = Qt.ItemDataRole.DisplayRole) -> object:
    return model.data(model.index(row, column), role)


@pytest.fixture
def model(qapp) -> JobsTableModel:
    return JobsTableModel()


def test_the_model_keeps_qt_rules_as_jobs_come_and_go(model, qtmodeltester) -> None:
    qtmodeltester.check(model)
    for n in range(3):
        model.job_started(start(f"job-{n}"))
    model.job_finished(record("job-1"))
    model.job_finished(record("job-9", outcome="error"))  # never seen start
    model.fill_sats({"job-1": 1500}.get)
    qtmodeltester.check(model)
    assert model.rowCount() == 4
    assert model.columnCount() == len(COLUMNS)
    assert model.rowCount(model.index(0, 0)) == 0  # a table: no children


def test_headers_are_the_columns(model) -> None:
    headers = [model.headerData(n, Qt.Orientation.Horizontal) for n in range(len(COLUMNS))]
    assert headers == list(COLUMNS)
    assert model.headerData(0, Qt.Orientation.Vertical) is None


def test_a_started_job_is_on_top_and_running(model) -> None:
    model.job_started(start("old"))
    model.job_started(start("new", model="qwen"))
    assert model.job_ids == ["new", "old"]
    assert model.cell("new", "Started") == "14:05:09"
    assert model.cell("new", "Model") == "qwen"
    assert model.cell("new", "Outcome") == "running"
    for column in ("Prompt tokens", "Completion tokens", "Tokens/s", "Duration", "Sats"):
        assert model.cell("new", column) == ""
    assert shown(model, 0, OUTCOME, Qt.ItemDataRole.ForegroundRole) == QColor("#1d4ed8")
    assert shown(model, 0, 0, Qt.ItemDataRole.ToolTipRole) == "new"
    assert model.cell("missing", "Model") is None


def test_a_finished_job_shows_its_numbers_and_awaits_its_sats(model) -> None:
    model.job_started(start("a"))
    model.job_started(start("b"))
    changed: list[tuple[int, int, int, int]] = []
    model.dataChanged.connect(lambda first, last, _roles=(): changed.append(
        (first.row(), first.column(), last.row(), last.column())))
    model.job_finished(record("a"))
    model.job_finished(record("b", outcome="error"))
    assert [model.cell("a", c) for c in COLUMNS[2:]] == ["12", "40", "20.0", "2.00 s", AWAITING,
                                                         "ok"]
    assert shown(model, 1, OUTCOME, Qt.ItemDataRole.ForegroundRole) == QColor("#166534")
    assert shown(model, 0, OUTCOME, Qt.ItemDataRole.ForegroundRole) == QColor("#b91c1c")
    assert changed == [(1, 0, 1, len(COLUMNS) - 1), (0, 0, 0, len(COLUMNS) - 1)]


def test_numbers_are_right_aligned_and_words_are_not(model) -> None:
    model.job_started(start("a"))
    right = Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter
    aligned = [shown(model, 0, n, Qt.ItemDataRole.TextAlignmentRole) for n in range(len(COLUMNS))]
    assert aligned == [None, None, right, right, right, right, right, None]


def test_a_job_finished_unseen_gets_a_row_started_seconds_ago(model) -> None:
    model.job_started(start("a"))
    before = dt.datetime.now().timestamp()
    model.job_finished(record("late"))
    assert model.job_ids == ["late", "a"]
    about = {dt.datetime.fromtimestamp(before - 2.0 + late).strftime("%H:%M:%S")
             for late in (0, 1, 2)}
    assert model.cell("late", "Started") in about
    assert model.cell("late", "Outcome") == "ok"


def test_the_oldest_rows_go_past_the_limit(model, qtmodeltester) -> None:
    qtmodeltester.check(model)
    for n in range(MAX_ROWS + 5):
        model.job_started(start(f"job-{n}"))
    assert model.rowCount() == MAX_ROWS
    assert model.job_ids[0] == f"job-{MAX_ROWS + 4}"
    assert model.job_ids[-1] == "job-5"


def test_sats_fill_in_as_the_queen_settles_jobs_in_order(model) -> None:
    for job_id in ("first", "second", "third", "running"):
        model.job_started(start(job_id))
    for job_id in ("first", "second", "third"):
        model.job_finished(record(job_id))
    earned: dict[str, int] = {}
    model.fill_sats(earned.get)  # nothing settled yet
    assert [model.cell(j, "Sats") for j in model.job_ids] == ["", AWAITING, AWAITING, AWAITING]

    earned["second"] = 42  # msat: a fraction of a sat
    model.fill_sats(earned.get)
    # "third" is newer than any settled job: still awaited. "first" is older than a settled job
    # and has no earnings: it earned nothing (a new worker's unpaid first job).
    assert [model.cell(j, "Sats") for j in model.job_ids] == ["", AWAITING, "0.042", "0"]
    assert shown(model, 3, SATS, Qt.ItemDataRole.ToolTipRole) == UNPAID_TIP
    assert shown(model, 2, SATS, Qt.ItemDataRole.ToolTipRole) is None

    earned["third"] = 2_000
    earned["first"] = 5_000  # too late: a job shown as unpaid stays so
    model.fill_sats(earned.get)
    assert [model.cell(j, "Sats") for j in model.job_ids] == ["", "2", "0.042", "0"]


def test_an_invalid_index_shows_nothing(model) -> None:
    model.job_started(start("a"))
    assert model.data(QModelIndex()) is None
    assert model.data(model.index(5, 0)) is None


def test_a_training_job_shows_its_progress_then_its_end(qtmodeltester) -> None:
    """Issue 37: while it trains, the row says how far it is and the tokens trained so far;
    once finished, its final numbers stay, whatever report comes late."""
    from desktop_worker.jobs import JobProgress

    model = JobsTableModel()
    qtmodeltester.check(model)
    job = "train-ftjob-abc-1"
    model.job_started(JobStart(job, "fine-tuning smollm2", "train", STARTED))
    model.job_progress(JobProgress(job, "smollm2", 12, 40, 1, 0.834, 1234))
    assert model.cell(job, "Outcome") == "training: step 12/40 (30 %), epoch 1, loss 0.83"
    assert model.cell(job, "Prompt tokens") == "1,234"
    assert shown(model, 0, OUTCOME, Qt.ItemDataRole.ForegroundRole) == QColor("#1d4ed8")
    model.job_progress(JobProgress(job, "smollm2", 40, 40, 4, 0.12, 4000))
    assert model.cell(job, "Outcome") == "training: step 40/40 (100 %), epoch 4, loss 0.12"
    model.job_finished(JobRecord(job, "fine-tuning smollm2", "train", prompt_tokens=4000,
                                 completion_tokens=0, seconds=90.0, outcome="ok"))
    model.job_progress(JobProgress(job, "smollm2", 39, 40, 4, 0.2, 3900))  # late: dropped
    assert model.cell(job, "Outcome") == "ok"
    assert model.cell(job, "Prompt tokens") == "4000"
    model.job_progress(JobProgress("train-unknown-1", "smollm2", 1, 2, 1, 1.0, 5))
    assert model.job_ids == [job]


def png_b64(width: int, height: int) -> str:
    import base64
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (width, height), (200, 120, 40)).save(out, "PNG")
    return base64.b64encode(out.getvalue()).decode("ascii")


def test_an_image_job_shows_a_thumbnail_and_its_images(model) -> None:
    """Issue 38: the first image, small, beside its model; its images where a text job shows
    completion tokens; a picture that does not decode shows no thumbnail and breaks nothing."""
    from desktop_worker.image_jobs import RenderedJob

    model.job_started(JobStart("img-1", "image 128x64: tiny-sd", "image", 0.0))
    model.job_rendered(RenderedJob("img-1", "tiny-sd", 128, 64, 2, 1.5, png_b64(128, 64)))
    model.job_finished(JobRecord("img-1", "tiny-sd", "image", 0, 0, 1.7, "ok"))
    assert model.cell("img-1", "Model") == "image 128x64: tiny-sd"
    assert model.cell("img-1", "Completion tokens") == "2 images"
    assert model.cell("img-1", "Prompt tokens") == ""
    assert model.cell("img-1", "Duration") == "1.70 s"
    thumbnail = shown(model, 0, 1, Qt.ItemDataRole.DecorationRole)
    assert (thumbnail.width(), thumbnail.height()) == (48, 24)
    assert shown(model, 0, 2, Qt.ItemDataRole.DecorationRole) is None
    model.job_started(JobStart("img-2", "image 64x64: tiny-sd", "image", 0.0))
    model.job_rendered(RenderedJob("img-2", "tiny-sd", 64, 64, 1, 0.5, "bm90IGFuIGltYWdl"))
    assert shown(model, 0, 1, Qt.ItemDataRole.DecorationRole) is None
    model.job_rendered(RenderedJob("gone", "tiny-sd", 64, 64, 1, 0.5, png_b64(64, 64)))
