"""The first-run wizard: the payout address (skippable), the detected hardware, a suggested model
that fits it, then Start Earning."""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtGui import QPixmap
from PySide6.QtWidgets import (
    QCheckBox,
    QLabel,
    QVBoxLayout,
    QWidget,
    QWizard,
    QWizardPage,
)

from desktop_worker.gui.common import size
from desktop_worker.gui.services.advice import (
    CatalogModel,
    need_mb,
    suggest_model,
    usable_vram_mb,
)
from desktop_worker.gui.views.settings import PayoutField
from desktop_worker.hardware import HardwareReport

INTRO = ("Apiary lends this computer's spare GPU to a swarm that answers AI requests, and pays "
         "you in bitcoin over Lightning for every job it serves.")


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
        hint.setStyleSheet("color: #6b7280;")
        layout = QVBoxLayout(self)
        layout.addWidget(intro)
        layout.addSpacing(8)
        layout.addWidget(self.field)
        layout.addWidget(hint)
        layout.addStretch(1)
        self.field.edit.textChanged.connect(lambda _t: self.completeChanged.emit())

    def isComplete(self) -> bool:
        return self.field.valid


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
    def __init__(self) -> None:
        super().__init__()
        self.setTitle("Your hardware")
        self.setSubTitle("This is what Apiary found and tells the queen.")
        self.summary = QLabel()
        self.summary.setWordWrap(True)
        self.summary.setStyleSheet("font-size: 14px; line-height: 150%;")
        layout = QVBoxLayout(self)
        layout.addWidget(self.summary)
        layout.addStretch(1)


class ModelPage(QWizardPage):
    def __init__(self) -> None:
        super().__init__()
        self.setTitle("A model to serve")
        self.setSubTitle("The biggest well-known model that fits your hardware.")
        self.label = QLabel()
        self.label.setWordWrap(True)
        self.label.setStyleSheet("font-size: 14px;")
        self.fit = QLabel()
        self.fit.setWordWrap(True)
        self.fit.setStyleSheet("color: #4b5563;")
        self.download = QCheckBox("Download it now")
        self.download.setChecked(True)
        layout = QVBoxLayout(self)
        layout.addWidget(self.label)
        layout.addWidget(self.fit)
        layout.addSpacing(8)
        layout.addWidget(self.download)
        layout.addStretch(1)


class ReadyPage(QWizardPage):
    def __init__(self) -> None:
        super().__init__()
        self.setTitle("Ready")
        self.setSubTitle("Click Start Earning. Apiary keeps running in the tray when you close "
                         "its window.")
        self.start = QCheckBox("Start earning now")
        self.start.setChecked(True)
        layout = QVBoxLayout(self)
        layout.addWidget(self.start)
        layout.addStretch(1)


class FirstRunWizard(QWizard):
    """Reports the owner's choices through ``on_done(ln_url, model or None, start)``."""

    def __init__(
        self,
        ln_url: str | None,
        on_done: Callable[[str | None, CatalogModel | None, bool], None],
        parent: QWidget | None = None,
        logo: QPixmap | None = None,
    ) -> None:
        super().__init__(parent)
        self.setWindowTitle("Set up Apiary")
        self.setWizardStyle(QWizard.WizardStyle.ModernStyle)
        if logo is not None:
            self.setPixmap(QWizard.WizardPixmap.LogoPixmap, logo)
        self.payout = PayoutPage(ln_url)
        self.hardware = HardwarePage()
        self.model = ModelPage()
        self.ready = ReadyPage()
        for page in (self.payout, self.hardware, self.model, self.ready):
            self.addPage(page)
        self.setButtonText(QWizard.WizardButton.FinishButton, "Start Earning")
        self.on_done = on_done
        self.suggestion: CatalogModel = suggest_model(None)
        self.show_hardware(None)
        self.resize(600, 420)

    def show_hardware(self, report: HardwareReport | None, cap_mb: int | None = None) -> None:
        self.hardware.summary.setText(hardware_summary(report))
        self.suggestion = suggest_model(report, cap_mb)
        self.model.label.setText(
            f"<b>{self.suggestion.label}</b><br><code>{self.suggestion.name}</code><br>"
            f"about {size(self.suggestion.size_bytes)} to download")
        need = need_mb(self.suggestion.size_bytes)
        vram = usable_vram_mb(report, cap_mb)
        if report is None:
            self.model.fit.setText("")
        elif vram is not None:
            self.model.fit.setText(f"It needs about {need:,} MB of memory to serve; "
                                   f"{vram:,} MB of VRAM is free, so it runs on your GPU.")
        else:
            self.model.fit.setText(f"It needs about {need:,} MB of memory to serve and runs on "
                                   "the CPU: small models answer fast enough to earn there.")

    def accept(self) -> None:
        model = self.suggestion if self.model.download.isChecked() else None
        self.on_done(self.payout.field.value(), model, self.ready.start.isChecked())
        super().accept()
