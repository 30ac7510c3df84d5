"""The first-run wizard: the payout address (skippable), which queen to join (with a real test of
the connection), the detected hardware and how much of the disk models may take, a model that
fits it (or a .gguf the owner has), then Start Earning.

The disk (issue 34): the hardware page shows the quota for models, by default half the free disk
(``default_quota_gb``, filled in once the hardware is known), which the owner may change; Finish
saves it (``WizardChoices.disk_settings``). Apiary always leaves max(10 GB, 10 % of the disk)
free besides.

After the queen step the wizard asks that queen what its developers ask for (``GET
/worker/demand``, in the background with a short timeout): the in-demand models that fit this
machine come first, pinned to the file the queen routes to; with no demand (none yet, an older
queen that answers 404, or one out of reach) the built-in list alone.

Finishing does the work with the wizard still open: the model is downloaded (or imported) with
its progress on the last page, and a failure stays there in plain words with a Retry, so the
owner is never left at "Not earning" without knowing why. "Start Earning" starts; "Finish
without starting" does the same but does not start; Cancel stops a download in progress.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from pathlib import Path

from PySide6.QtGui import QPixmap
from PySide6.QtWidgets import (
    QButtonGroup,
    QDoubleSpinBox,
    QFileDialog,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QProgressBar,
    QPushButton,
    QRadioButton,
    QVBoxLayout,
    QWidget,
    QWizard,
    QWizardPage,
)

from desktop_worker.errors import QueenAddressError
from desktop_worker.gui.common import plain_label, size, spawn
from desktop_worker.gui.services.advice import (
    CatalogModel,
    fitting_models,
    need_mb,
    usable_vram_mb,
)
from desktop_worker.gui.services.demand import demand_rows, wizard_models
from desktop_worker.gui.views.settings import BAD, OK, PayoutField
from desktop_worker.hardware import HardwareReport
from desktop_worker.link_probe import ProbeResult
from desktop_worker.queen_url import normalise_queen_url
from desktop_worker.store import PullProgress
from desktop_worker.store.disk import GIB, default_quota_gb
from shared_schema import Demand

log = logging.getLogger(__name__)

INTRO = ("Apiary lends this computer's spare GPU to a swarm that answers AI requests, and pays "
         "you in bitcoin over Lightning for every job it serves.")
GREY = "color: #6b7280;"
DISK_NOTE = ("Models downloaded for the swarm stay within this. Whatever you set, Apiary always "
             "leaves at least 10 GB of the disk free (a tenth of it, on a large disk). Change "
             "either later in Settings.")
FINISH_WITHOUT_STARTING = QWizard.WizardButton.CustomButton1


@dataclass(frozen=True)
class WizardChoices:
    """What the owner chose. ``model`` and ``local_file`` are exclusive; neither: add one later."""

    ln_url: str | None
    queen_url: str
    model: CatalogModel | None
    local_file: Path | None
    start: bool
    disk_quota_gb: float | None = None  # None: not shown yet (the save picks the default)

    def disk_settings(self) -> dict[str, float]:
        """The disk settings to save with the choices (none when the owner saw none)."""
        return {} if self.disk_quota_gb is None else {"disk_quota_gb": self.disk_quota_gb}


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
    """Which queen: the address as people paste it, normalised live, and a real handshake."""

    def __init__(self, current: str,
                 tester: Callable[[str], Awaitable[ProbeResult]] | None) -> None:
        super().__init__()
        self.setTitle("Which queen?")
        self.setSubTitle("The queen is the server that sends this computer jobs and pays for "
                         "them. Paste the address its operator gave you.")
        self.edit = QLineEdit(current)
        self.edit.setPlaceholderText("queen.example.com, https://queen.example.com or "
                                     "wss://queen.example.com/worker")
        self.verdict = plain_label()
        self.verdict.setWordWrap(True)
        self.test = QPushButton("Test connection")
        self.result = plain_label()
        self.result.setWordWrap(True)
        self._tester = tester
        self.url: str | None = None
        self.last: ProbeResult | None = None
        row = QHBoxLayout()
        row.addWidget(self.edit, 1)
        row.addWidget(self.test)
        layout = QVBoxLayout(self)
        layout.addLayout(row)
        layout.addWidget(self.verdict)
        layout.addSpacing(8)
        layout.addWidget(self.result)
        layout.addStretch(1)
        self.edit.textChanged.connect(self.check)
        self.test.clicked.connect(lambda: spawn(self.run_test()))
        self.test.setEnabled(tester is not None)
        self.check(current)

    def check(self, text: str) -> None:
        try:
            self.url = normalise_queen_url(text)
        except QueenAddressError as exc:
            self.url = None
            self.verdict.setText(str(exc))
            self.verdict.setStyleSheet(BAD)
        else:
            self.verdict.setText(f"Apiary will connect to {self.url}")
            self.verdict.setStyleSheet(GREY)
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
            self.result.setText(("✓ " if outcome.ok else "✗ ") + outcome.message)
            self.result.setStyleSheet(OK if outcome.ok else BAD)
        return outcome

    def isComplete(self) -> bool:
        return self.url is not None


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
    """The suggestion, the smaller models that fit, a .gguf the owner has, or none for now."""

    def __init__(self) -> None:
        super().__init__()
        self.setTitle("A model to serve")
        self.setSubTitle("Models in demand on your queen come first; otherwise the biggest "
                         "well-known model that fits your hardware is selected.")
        self.group = QButtonGroup(self)
        self.choices_box = QVBoxLayout()
        self.fit = QLabel()
        self.fit.setWordWrap(True)
        self.fit.setStyleSheet("color: #4b5563;")
        self.demand_note = plain_label()  # whether the list follows the queen's demand
        self.demand_note.setWordWrap(True)
        self.demand_note.setStyleSheet("color: #4b5563;")
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
        layout = QVBoxLayout(self)
        layout.addWidget(self.demand_note)
        layout.addLayout(self.choices_box)
        layout.addWidget(self.fit)
        layout.addSpacing(6)
        layout.addLayout(own_row)
        layout.addWidget(self.none)
        layout.addStretch(1)
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
            tag = " (suggested)" if index == 0 else ""
            button = QRadioButton(f"{model.label}{tag}: about {size(model.size_bytes)} to "
                                  "download")
            button.setToolTip(model.name)
            self.group.addButton(button)
            self.choices_box.addWidget(button)
            self.buttons.append(button)
        if self.owner_picked and (self.own.isChecked() or self.none.isChecked()):
            return
        selected = self.models.index(keep) if self.owner_picked and keep in self.models else 0
        self.buttons[selected].setChecked(True)

    def _owner_picked(self, *_args: object) -> None:
        self.owner_picked = True

    def chosen_model(self) -> CatalogModel | None:
        for model, button in zip(self.models, self.buttons, strict=True):
            if button.isChecked():
                return model
        return None

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


class ReadyPage(QWizardPage):
    """What happens on Finish, then its progress, and a failure with Retry."""

    def __init__(self) -> None:
        super().__init__()
        self.setTitle("Ready")
        self.setSubTitle("Start Earning downloads the model if needed and connects to the "
                         "queen. Apiary keeps running in the tray when you close its window.")
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


Finisher = Callable[[WizardChoices], Awaitable[str | None]]


class FirstRunWizard(QWizard):
    """``finish(choices)`` does the work (save, download or import, start) and returns None or
    the reason it failed, shown on the last page with Retry. ``cancel_work`` stops it."""

    def __init__(
        self,
        ln_url: str | None,
        queen_url: str,
        finish: Finisher,
        parent: QWidget | None = None,
        *,
        logo: QPixmap | None = None,
        tester: Callable[[str], Awaitable[ProbeResult]] | None = None,
        cancel_work: Callable[[], None] = lambda: None,
        demand_source: Callable[[str], Awaitable[Demand | None]] | None = None,
        held: Callable[[], Collection[str]] = frozenset,
        disk_quota_gb: float | None = None,
    ) -> None:
        """``demand_source(queen_url)``: the queen's demand or None (``fetch_demand``);
        ``held()``: the models already here (not offered again); ``disk_quota_gb``: a quota
        already chosen (None: the default, half the free disk, once the hardware is known)."""
        super().__init__(parent)
        self.setWindowTitle("Set up Apiary")
        self.setWizardStyle(QWizard.WizardStyle.ModernStyle)
        if logo is not None:
            self.setPixmap(QWizard.WizardPixmap.LogoPixmap, logo)
        self.payout = PayoutPage(ln_url)
        self.queen = QueenPage(queen_url, tester)
        self.hardware = HardwarePage(disk_quota_gb)
        self.model = ModelPage()
        self.ready = ReadyPage()
        for page in (self.payout, self.queen, self.hardware, self.model, self.ready):
            self.addPage(page)
        self.setButtonText(QWizard.WizardButton.FinishButton, "Start Earning")
        self.setButtonText(FINISH_WITHOUT_STARTING, "Finish without starting")
        self.currentIdChanged.connect(self._page_changed)
        self.customButtonClicked.connect(self._custom)
        self.ready.retry.clicked.connect(self.retry)
        self.finisher = finish
        self.cancel_work = cancel_work
        self.busy = False
        self.failure: str | None = None
        self._last_start = True
        self.suggestion: CatalogModel = fitting_models(None)[0]
        self.demand_source = demand_source
        self.held = held
        self.demand: Demand | None = None
        self.demand_url: str | None = None  # the queen the demand shown came from
        self.demand_task: asyncio.Task[None] | None = None
        self._report: HardwareReport | None = None
        self._cap: int | None = None
        self.show_hardware(None)
        self.resize(640, 460)

    # --- pages ------------------------------------------------------------------------------

    def show_hardware(self, report: HardwareReport | None, cap_mb: int | None = None) -> None:
        self.hardware.summary.setText(hardware_summary(report))
        self.hardware.show_disk(report)
        self._report, self._cap = report, cap_mb
        self.show_models()

    def show_models(self) -> None:
        """The choices: the in-demand models that fit first (if the queen sent demand), then
        the built-in ones that fit."""
        report, cap_mb = self._report, self._cap
        in_demand = wizard_models(demand_rows(self.demand, report, cap_mb=cap_mb,
                                              held=set(self.held())))
        names = {m.name for m in in_demand}
        choices = [*in_demand, *(m for m in fitting_models(report, cap_mb)
                                 if m.name not in names)]
        self.suggestion = choices[0]
        if in_demand:
            count = "a model that fits" if len(in_demand) == 1 \
                else f"{len(in_demand)} models that fit"
            self.model.demand_note.setText(
                f"Developers on this queen ask for {count} your machine, listed first: "
                "serving what is in demand keeps your worker busy.")
        elif self.demand_url is not None and self.demand_task is None:
            self.model.demand_note.setText(
                "The queen has no demand to show that fits this machine (or is an older queen): "
                "these are well-known models that fit.")
        self.model.show_choices(choices)
        need = need_mb(self.suggestion.size_bytes)
        vram = usable_vram_mb(report, cap_mb)
        if report is None:
            self.model.fit.setText("")
        elif vram is not None:
            self.model.fit.setText(f"The suggestion needs about {need:,} MB of memory to serve; "
                                   f"{vram:,} MB of VRAM is free, so it runs on your GPU.")
        else:
            self.model.fit.setText(f"The suggestion needs about {need:,} MB of memory and runs "
                                   f"on the CPU ({report.cpu_count} threads): small models "
                                   "answer fast enough to earn there.")

    def _page_changed(self, _page_id: int) -> None:
        page = self.currentPage()
        if page in (self.hardware, self.model) and self.queen.url != self.demand_url:
            self.load_demand()
        last = page is self.ready
        self.setOption(QWizard.WizardOption.HaveCustomButton1, last)
        if last and not self.busy:
            self.ready.summary.setText(self._summary(self.choices(True)))

    def load_demand(self) -> None:
        """Ask the queen chosen what is in demand, in the background (never blocking)."""
        url = self.queen.url
        if self.demand_source is None or url is None:
            return
        self.demand_url = url
        if self.demand_task is not None:
            self.demand_task.cancel()
        self.model.demand_note.setText("Asking the queen which models are in demand…")
        self.demand_task = spawn(self._load_demand(url))

    async def _load_demand(self, url: str) -> None:
        assert self.demand_source is not None
        try:
            demand = await self.demand_source(url)
        except Exception:  # never let the queen's answer break the wizard
            log.exception("asking %s for its demand failed", url)
            demand = None
        if url != self.demand_url:
            return  # the owner chose another queen meanwhile
        self.demand = demand
        self.demand_task = None
        self.show_models()

    @staticmethod
    def _summary(choices: WizardChoices) -> str:
        if choices.local_file is not None:
            model = f"import {choices.local_file.name}"
        elif choices.model is not None:
            model = f"serve {choices.model.label} (downloaded now if it is not here yet)"
        else:
            model = "add a model later in the Models tab (nothing to serve until then)"
        paid = choices.ln_url or "nobody (no payout address yet)"
        text = f"Queen: {choices.queen_url}\nModel: {model}\nEarnings paid to: {paid}"
        if choices.disk_quota_gb is not None:
            limit = (f"up to {choices.disk_quota_gb:,.0f} GB" if choices.disk_quota_gb
                     else "no limit")
            text += f"\nDisk for models: {limit}; at least 10 GB of it always stays free"
        return text

    def choices(self, start: bool) -> WizardChoices:
        own = self.model.own.isChecked()
        return WizardChoices(
            ln_url=self.payout.field.value(),
            queen_url=self.queen.url or "",
            model=None if own else self.model.chosen_model(),
            local_file=self.model.local_file if own else None,
            start=start,
            disk_quota_gb=self.hardware.quota_gb(),
        )

    # --- finishing ----------------------------------------------------------------------------

    def accept(self) -> None:
        """Start Earning: do the work with the wizard open; it closes only when it worked."""
        self.run(start=True)

    def _custom(self, which: int) -> None:
        if which == FINISH_WITHOUT_STARTING.value:
            self.run(start=False)

    def retry(self) -> None:
        self.run(start=self._last_start)

    def run(self, *, start: bool) -> None:
        if self.busy:
            return
        self._last_start = start
        spawn(self._finish(self.choices(start)))

    async def _finish(self, choices: WizardChoices) -> str | None:
        self.busy = True
        self.failure = None
        self._buttons(False)
        self.ready.working("Getting ready…")
        try:
            problem = await self.finisher(choices)
        finally:
            self.busy = False
            self._buttons(True)
        if problem is None:
            super().accept()
        else:
            self.failure = problem
            self.ready.failed(problem)
        return problem

    def _buttons(self, enabled: bool) -> None:
        for which in (QWizard.WizardButton.FinishButton, QWizard.WizardButton.BackButton,
                      FINISH_WITHOUT_STARTING):
            button = self.button(which)
            if button is not None:
                button.setEnabled(enabled)
        self.ready.retry.setEnabled(enabled)

    def reject(self) -> None:
        """Cancel: while a download runs, it is cancelled (the wizard says so and stays)."""
        if self.busy:
            self.cancel_work()
            return
        super().reject()
