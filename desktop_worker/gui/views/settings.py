"""The Settings tab: queen URL, payout address (checked live), models folder, disk quota, VRAM
cap, CPU threads, start earning at launch, run at login."""

from __future__ import annotations

import os
from pathlib import Path

from PySide6.QtWidgets import (
    QCheckBox,
    QDoubleSpinBox,
    QFileDialog,
    QFormLayout,
    QHBoxLayout,
    QLineEdit,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from desktop_worker.errors import WorkerError
from desktop_worker.gui.common import plain_label
from desktop_worker.gui.services.settings import SettingsService
from desktop_worker.settings import WorkerSettings
from shared_schema.payout_address import check_payout_address

OK = "color: #166534;"
BAD = "color: #b91c1c;"


def payout_feedback(text: str) -> tuple[bool, str]:
    """(valid, what to tell the owner) for the payout address field."""
    reason = check_payout_address(text)
    if reason is not None:
        return False, reason
    if not text.strip():
        return True, "Empty: this worker will not be paid (\"don't pay me\")."
    kind = "LNURL" if text.strip().lower().removeprefix("lightning:").startswith("lnurl") \
        else "Lightning address"
    return True, f"✓ a valid {kind}"


class PayoutField(QWidget):
    """A line edit for the payout address with the live verdict under it."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.edit = QLineEdit()
        self.edit.setPlaceholderText("you@wallet.example or lnurl1…  (empty: don't pay me)")
        self.verdict = plain_label()
        self.verdict.setWordWrap(True)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.edit)
        layout.addWidget(self.verdict)
        self.edit.textChanged.connect(self.check)
        self.valid = True
        self.check("")

    def check(self, text: str) -> None:
        self.valid, message = payout_feedback(text)
        self.verdict.setText(message)
        self.verdict.setStyleSheet(OK if self.valid else BAD)

    def value(self) -> str | None:
        return self.edit.text().strip() or None


class SettingsView(QWidget):
    def __init__(self, service: SettingsService, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.service = service
        self.queen = QLineEdit()
        self.payout = PayoutField()
        self.models_dir = QLineEdit()
        browse = QPushButton("Browse…")
        browse.clicked.connect(self.browse)
        folder = QHBoxLayout()
        folder.addWidget(self.models_dir, 1)
        folder.addWidget(browse)
        self.quota = QDoubleSpinBox()
        self.quota.setRange(0, 100_000)
        self.quota.setDecimals(1)
        self.quota.setSuffix(" GB")
        self.quota.setSpecialValueText("no quota")
        self.vram = QSpinBox()
        self.vram.setRange(0, 1_000_000)
        self.vram.setSingleStep(256)
        self.vram.setSuffix(" MB")
        self.vram.setSpecialValueText("no cap")
        self.threads = QSpinBox()
        self.threads.setRange(0, os.cpu_count() or 256)
        self.threads.setSpecialValueText("automatic")
        self.at_launch = QCheckBox("Start earning when the app opens")
        self.at_login = QCheckBox("Open Apiary when I log in")
        self.save = QPushButton("Save")
        self.save.clicked.connect(self.apply)
        self.message = plain_label()  # error messages, in their own words
        self.message.setWordWrap(True)

        form = QFormLayout()
        form.addRow("Queen URL", self.queen)
        form.addRow("Lightning payout address", self.payout)
        form.addRow("Models folder", folder)
        form.addRow("Disk quota for models", self.quota)
        form.addRow("VRAM cap", self.vram)
        form.addRow("CPU threads", self.threads)
        form.addRow("", self.at_launch)
        form.addRow("", self.at_login)
        buttons = QHBoxLayout()
        buttons.addWidget(self.message, 1)
        buttons.addWidget(self.save)
        layout = QVBoxLayout(self)
        layout.addLayout(form)
        layout.addStretch(1)
        layout.addLayout(buttons)
        self.payout.edit.textChanged.connect(lambda _t: self.save.setEnabled(self.payout.valid))
        self.load(service.settings)

    def load(self, settings: WorkerSettings) -> None:
        self.queen.setText(settings.queen_url)
        self.payout.edit.setText(settings.ln_url or "")
        self.models_dir.setText(str(settings.models_dir))
        self.quota.setValue(settings.disk_quota_gb or 0)
        self.vram.setValue(settings.vram_cap_mb or 0)
        self.threads.setValue(settings.threads or 0)
        self.at_launch.setChecked(settings.start_earning_at_launch)
        self.at_login.setChecked(self.service.run_at_login())

    def browse(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Models folder", self.models_dir.text())
        if folder:
            self.models_dir.setText(folder)

    def apply(self) -> bool:
        if not self.payout.valid:
            self._say(f"Payout address: {self.payout.verdict.text()}", BAD)
            return False
        at_login = self.at_login.isChecked()  # read before saving reloads the form
        try:
            self.service.update(
                queen_url=self.queen.text().strip(),
                ln_url=self.payout.value(),
                models_dir=Path(self.models_dir.text().strip()).expanduser(),
                disk_quota_gb=self.quota.value() or None,
                vram_cap_mb=self.vram.value() or None,
                threads=self.threads.value() or None,
                start_earning_at_launch=self.at_launch.isChecked(),
            )
            if at_login != self.service.run_at_login():
                self.service.set_run_at_login(at_login)
                self.at_login.setChecked(self.service.run_at_login())
        except WorkerError as exc:
            self._say(str(exc), BAD)
            return False
        self._say("Saved. A change of queen or payout address applies at the next Start.", OK)
        return True

    def _say(self, text: str, style: str) -> None:
        self.message.setText(text)
        self.message.setStyleSheet(style)
