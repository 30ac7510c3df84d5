"""The first-run wizard's pages (``wizard.py`` puts them together): the payout address, which
queen (with a real test of the connection), the hardware and the disk quota, a model, and the
Ready page with the work's progress. Thin views: what they say and decide comes from
``services/first_run.py`` and ``services/advice.py``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

from PySide6.QtWidgets import (
    QButtonGroup,
    QCheckBox,
    QDoubleSpinBox,
    QFileDialog,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QProgressBar,
    QPushButton,
    QRadioButton,
    QVBoxLayout,
    QWizardPage,
)

from desktop_worker.errors import QueenAddressError
from desktop_worker.gui.common import plain_label, size, spawn
from desktop_worker.gui.services.advice import CatalogModel
from desktop_worker.gui.services.first_run import (
    BUNDLED_LABEL,
    QUEEN_EMPTY,
    QUEEN_PLACEHOLDER,
    QUEEN_TEST_NOTE,
    next_blocked_by,
    probe_outcome_text,
)
from desktop_worker.gui.views.settings import BAD, IMAGES_LABEL, OK, PayoutField
from desktop_worker.hardware import HardwareReport
from desktop_worker.link_probe import ProbeResult
from desktop_worker.queen_url import normalise_queen_url
from desktop_worker.store import PullProgress
from desktop_worker.store.disk import GIB, default_quota_gb

__all__ = [
    "HardwarePage",
    "ModelPage",
    "PayoutPage",
    "QueenPage",
    "ReadyPage",
    "hardware_summary",
]

INTRO = ("Apiary lends this computer's spare GPU to a swarm that answers AI requests, and pays "
         "you in bitcoin over Lightning for every job it serves.")
GREY = "color: #6b7280;"
NOTE = "color: #4b5563;"
WARN = "color: #92400e;"
DISK_NOTE = ("Models downloaded for the swarm stay within this. Whatever you set, Apiary always "
             "leaves at least 10 GB of the disk free (a tenth of it, on a large disk). Change "
             "either later in Settings.")


class PayoutPage(QWizardPage):
    def __init__(self, current: str | None) -> None:
        super().__init__()
        self.setTitle("Welcome to Apiary")
        self.setSubTitle("Where should your earnings go?")
        intro = QLabel(INTRO)
        intro.setWordWrap(True)
        self.field = PayoutField()
        self.field.edit.setText(current or "")
        hint = QLabel("A Lightning address (you@wallet.example) or an LNURL. Leave it empty to "
                      "skip: you can add it later in Settings, and until then this worker is "
                      "not paid.")
        hint.setWordWrap(True)
        hint.setStyleSheet(GREY)
        layout = QVBoxLayout(self)
        layout.addWidget(intro)
        layout.addSpacing(8)
        layout.addWidget(self.field)
        layout.addWidget(hint)
        layout.addStretch(1)
        self.field.edit.textChanged.connect(lambda _t: self.completeChanged.emit())

    def isComplete(self) -> bool:
        return self.field.valid


class QueenPage(QWizardPage):
    """Which queen: the address as people paste it, normalised live, and a real handshake. The
    test is optional; one that fails holds Next until the address changes or a test passes."""

    def __init__(self, current: str,
                 tester: Callable[[str], Awaitable[ProbeResult]] | None) -> None:
        super().__init__()
        self.setTitle("Which queen?")
        self.setSubTitle("The queen is the server that sends this computer jobs and pays for "
                         "them. Paste the address its operator gave you.")
        self.edit = QLineEdit(current)
        self.edit.setPlaceholderText(QUEEN_PLACEHOLDER)
        self.verdict = plain_label()
        self.verdict.setWordWrap(True)
        self.test = QPushButton("Test connection")
        self.result = plain_label()
        self.result.setWordWrap(True)
        self.note = plain_label(QUEEN_TEST_NOTE)
        self.note.setWordWrap(True)
        self.note.setStyleSheet(GREY)
        self._tester = tester
        self.url: str | None = None
        self.last: ProbeResult | None = None  # the last test of the address shown
        row = QHBoxLayout()
        row.addWidget(self.edit, 1)
        row.addWidget(self.test)
        layout = QVBoxLayout(self)
        layout.addLayout(row)
        layout.addWidget(self.verdict)
        layout.addSpacing(8)
        layout.addWidget(self.result)
        layout.addStretch(1)
        layout.addWidget(self.note)
        self.edit.textChanged.connect(self.check)
        self.test.clicked.connect(lambda: spawn(self.run_test()))
        self.test.setEnabled(tester is not None)
        self.check(current)

    def check(self, text: str) -> None:
        before = self.url
        if not text.strip():
            self.url = None
            self.verdict.setText(QUEEN_EMPTY)
            self.verdict.setStyleSheet(GREY)
        else:
            try:
                self.url = normalise_queen_url(text)
            except QueenAddressError as exc:
                self.url = None
                self.verdict.setText(str(exc))
                self.verdict.setStyleSheet(BAD)
            else:
                self.verdict.setText(f"Apiary will connect to {self.url}")
                self.verdict.setStyleSheet(GREY)
        if self.url != before:  # another address: the last test was of the old one
            self.last = None
            self.result.setText("")
        self.test.setEnabled(self._tester is not None and self.url is not None)
        self.completeChanged.emit()

    async def run_test(self) -> ProbeResult | None:
        """The real handshake with the queen typed, its outcome in plain words under it."""
        url = self.url
        if url is None or self._tester is None:
            return None
        self.test.setEnabled(False)
        self.result.setStyleSheet(GREY)
        self.result.setText(f"Testing {url}…")
        try:
            outcome = await self._tester(url)
        finally:
            self.test.setEnabled(self.url is not None)
        if self.url == url:  # the owner may have typed on meanwhile
            self.last = outcome
            self.result.setText(probe_outcome_text(outcome))
            self.result.setStyleSheet(OK if outcome.ok else BAD)
            self.completeChanged.emit()
        return outcome

    def isComplete(self) -> bool:
        return self.url is not None and not next_blocked_by(self.last)


def hardware_summary(report: HardwareReport | None) -> str:
    if report is None:
        return "Detecting this machine's hardware…"
    gpus = [*report.nvidia.gpus, *report.opencl.gpus] if not report.nvidia.gpus \
        else list(report.nvidia.gpus)
    lines = [f"<b>{g.name}</b>: {g.memory_total_mb:,} MB of VRAM" for g in gpus] or [
        "No GPU found: models run on the CPU (slower, so a small model is suggested)."]
    lines.append(f"{report.cpu_count} CPU threads, {report.total_ram_mb:,} MB of RAM, "
                 f"{report.disk_space:,} GB free disk")
    return "<br>".join(lines)


class HardwarePage(QWizardPage):
    """The hardware found, and the quota for models on the disk (issue 34)."""

    def __init__(self, quota_gb: float | None = None) -> None:
        super().__init__()
        self.setTitle("Your hardware")
        self.setSubTitle("This is what Apiary found and tells the queen.")
        self.summary = QLabel()
        self.summary.setWordWrap(True)
        self.summary.setStyleSheet("font-size: 14px; line-height: 150%;")
        self.quota = QDoubleSpinBox()
        self.quota.setRange(0, 100_000)
        self.quota.setDecimals(0)
        self.quota.setSuffix(" GB")
        self.quota.setSpecialValueText("no limit")
        self.quota.setEnabled(quota_gb is not None)
        self.disk_note = plain_label(DISK_NOTE)
        self.disk_note.setWordWrap(True)
        self.disk_note.setStyleSheet(GREY)
        # Images (issue 38): the owner opts in here or later in Settings.
        self.images = QCheckBox(IMAGES_LABEL)
        # The owner's own value is kept when the hardware is detected again.
        self.quota_chosen = quota_gb is not None
        if quota_gb is not None:
            self.quota.setValue(quota_gb)
        self.quota.valueChanged.connect(self._edited)
        row = QHBoxLayout()
        row.addWidget(QLabel("Models may use up to"))
        row.addWidget(self.quota)
        row.addWidget(QLabel("of this disk"))
        row.addStretch(1)
        layout = QVBoxLayout(self)
        layout.addWidget(self.summary)
        layout.addSpacing(8)
        layout.addLayout(row)
        layout.addWidget(self.disk_note)
        layout.addSpacing(8)
        layout.addWidget(self.images)
        layout.addStretch(1)
        self._filling = False

    def show_disk(self, report: HardwareReport | None) -> None:
        """Fill in the default quota (half the free disk) once it is known, unless chosen."""
        if report is None or self.quota_chosen:
            return
        self._filling = True
        try:
            self.quota.setValue(default_quota_gb(report.disk_space * GIB))
        finally:
            self._filling = False
        self.quota.setEnabled(True)

    def quota_gb(self) -> float | None:
        """The quota shown (None while the disk is not known yet)."""
        return self.quota.value() if self.quota.isEnabled() else None

    def _edited(self, _value: float) -> None:
        if not self._filling:
            self.quota_chosen = True


class ModelPage(QWizardPage):
    """The suggestion, the smaller models that fit, the small model that comes with Apiary
    (``bundled``: its file, None when this install has none), a .gguf the owner has, or none for
    now. When nothing can be downloaded (``show_offline``), the bundled model goes first, with
    the reason, and is selected unless the owner chose."""

    def __init__(self, bundled: Path | None = None) -> None:
        super().__init__()
        self.setTitle("A model to serve")
        self.setSubTitle("Models in demand on your queen come first; otherwise the biggest "
                         "well-known model that fits your hardware is selected.")
        self.group = QButtonGroup(self)
        self.choices_box = QVBoxLayout()
        self.fit = QLabel()
        self.fit.setWordWrap(True)
        self.fit.setStyleSheet(NOTE)
        self.demand_note = plain_label()  # whether the list follows the queen's demand
        self.demand_note.setWordWrap(True)
        self.demand_note.setStyleSheet(NOTE)
        self.offline_note = plain_label()  # why nothing can be downloaded now (else empty)
        self.offline_note.setWordWrap(True)
        self.offline_note.setStyleSheet(WARN)
        self.offline_note.setVisible(False)
        self.bundled_path = bundled
        self.bundled: QRadioButton | None = None
        self.offline = False
        self.own = QRadioButton("Use a .gguf file I already have")
        self.browse = QPushButton("Choose file…")
        self.file_label = plain_label()
        self.file_label.setStyleSheet(GREY)
        self.none = QRadioButton("Not now: I will add a model later in the Models tab")
        self.group.addButton(self.own)
        self.group.addButton(self.none)
        self.local_file: Path | None = None
        self.models: list[CatalogModel] = []
        self.buttons: list[QRadioButton] = []
        own_row = QHBoxLayout()
        own_row.addWidget(self.own)
        own_row.addWidget(self.browse)
        own_row.addWidget(self.file_label, 1)
        self.first_box = QVBoxLayout()  # the bundled model, when nothing can be downloaded
        self.later_box = QVBoxLayout()  # the bundled model, otherwise
        layout = QVBoxLayout(self)
        layout.addWidget(self.demand_note)
        layout.addWidget(self.offline_note)
        layout.addLayout(self.first_box)
        layout.addLayout(self.choices_box)
        layout.addWidget(self.fit)
        layout.addSpacing(6)
        layout.addLayout(self.later_box)
        layout.addLayout(own_row)
        layout.addWidget(self.none)
        layout.addStretch(1)
        if bundled is not None:
            self.bundled = QRadioButton(BUNDLED_LABEL)
            self.bundled.setToolTip(f"{bundled.name}, {size(_file_size(bundled))}: copied from "
                                    "Apiary's own files into your models, with no download")
            self.group.addButton(self.bundled)
            self.later_box.addWidget(self.bundled)
        self.browse.clicked.connect(self.choose_file)
        self.group.buttonToggled.connect(lambda *_: self.completeChanged.emit())
        self.group.buttonClicked.connect(self._owner_picked)
        self.owner_picked = False  # the owner chose: new hardware facts keep the choice
        for button in (self.own, self.none):  # only the owner ever checks these
            button.toggled.connect(lambda on: on and self._owner_picked())
        self.pick_file: Callable[[], str] = self._file_dialog

    def show_choices(self, models: list[CatalogModel]) -> None:
        keep = self.chosen_model()
        for button in self.buttons:
            self.group.removeButton(button)
            self.choices_box.removeWidget(button)
            button.deleteLater()
        self.models = list(models)
        self.buttons = []
        for index, model in enumerate(self.models):
            tag = " (suggested)" if index == 0 and not self._bundled_first() else ""
            button = QRadioButton(f"{model.label}{tag}: about {size(model.size_bytes)} to "
                                  "download")
            button.setToolTip(model.name)
            self.group.addButton(button)
            self.choices_box.addWidget(button)
            self.buttons.append(button)
        if self.owner_picked and (self.own.isChecked() or self.none.isChecked()
                                  or self.bundled_chosen()):
            return  # the owner's choice outside the list stands
        if not self.owner_picked and self.bundled is not None and self._bundled_first():
            self.bundled.setChecked(True)
            return
        selected = self.models.index(keep) if self.owner_picked and keep in self.models else 0
        self.buttons[selected].setChecked(True)

    def show_offline(self, note: str) -> None:
        """Nothing can be downloaded now (``note``: why, and what to do) or, with an empty note,
        the hub answers: the bundled model goes first (and is selected) or back below."""
        self.offline = bool(note)
        self.offline_note.setText(note)
        self.offline_note.setVisible(self.offline)
        if self.bundled is None:
            return
        source, target = ((self.later_box, self.first_box) if self._bundled_first()
                          else (self.first_box, self.later_box))
        if target.indexOf(self.bundled) == -1:
            source.removeWidget(self.bundled)
            target.addWidget(self.bundled)
        if self.buttons:
            self.show_choices(self.models)  # the suggestion's tag and the default follow

    def _bundled_first(self) -> bool:
        return self.offline and self.bundled is not None

    def _owner_picked(self, *_args: object) -> None:
        self.owner_picked = True

    def chosen_model(self) -> CatalogModel | None:
        for model, button in zip(self.models, self.buttons, strict=True):
            if button.isChecked():
                return model
        return None

    def bundled_chosen(self) -> bool:
        return self.bundled is not None and self.bundled.isChecked()

    def _file_dialog(self) -> str:
        path, _ = QFileDialog.getOpenFileName(self, "A GGUF model", str(Path.home()),
                                              "GGUF models (*.gguf)")
        return path

    def choose_file(self) -> None:
        path = self.pick_file()
        if path:
            self.local_file = Path(path)
            self.file_label.setText(self.local_file.name)
            self.own.setChecked(True)
            self.owner_picked = True
        self.completeChanged.emit()

    def isComplete(self) -> bool:
        return not self.own.isChecked() or self.local_file is not None


def _file_size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None


class ReadyPage(QWizardPage):
    """What happens on Finish, then its progress, and a failure with Retry."""

    def __init__(self) -> None:
        super().__init__()
        self.setTitle("Ready")
        self.setSubTitle("Start Earning gets the model (a download, unless it is here) and "
                         "connects to the queen. Apiary keeps running in the tray when you "
                         "close its window.")
        self.summary = plain_label()
        self.summary.setWordWrap(True)
        self.status = plain_label()
        self.status.setWordWrap(True)
        self.progress = QProgressBar()
        self.progress.setVisible(False)
        self.retry = QPushButton("Retry")
        self.retry.setVisible(False)
        layout = QVBoxLayout(self)
        layout.addWidget(self.summary)
        layout.addSpacing(10)
        layout.addWidget(self.status)
        layout.addWidget(self.progress)
        row = QHBoxLayout()
        row.addWidget(self.retry)
        row.addStretch(1)
        layout.addLayout(row)
        layout.addStretch(1)

    def clear(self) -> None:
        """Nothing to report: an error shown belonged to other choices."""
        self.progress.setVisible(False)
        self.retry.setVisible(False)
        self.status.setStyleSheet("")
        self.status.setText("")

    def working(self, text: str) -> None:
        self.retry.setVisible(False)
        self.status.setStyleSheet("color: #1f2937;")
        self.status.setText(text)

    def show_progress(self, progress: PullProgress) -> None:
        self.progress.setVisible(True)
        if progress.total_bytes:
            self.progress.setRange(0, 1000)
            self.progress.setValue(int(1000 * min(1.0, progress.downloaded_bytes
                                                  / progress.total_bytes)))
        else:
            self.progress.setRange(0, 0)
        self.progress.setFormat(f"{size(progress.downloaded_bytes)} of "
                                f"{size(progress.total_bytes)}")

    def failed(self, text: str) -> None:
        self.progress.setVisible(False)
        self.status.setStyleSheet(BAD)
        self.status.setText(text)
        self.retry.setVisible(True)
