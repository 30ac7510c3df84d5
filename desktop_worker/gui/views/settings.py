"""The Settings tab: queen URL, payout address (checked live), models folder, disk quota, VRAM
cap, CPU threads, jobs at once, start earning at launch, run at login; "When to pause" (on
battery, another program on the GPU above a share, full-screen apps, active hours checked as the
owner types) and "Models" (let the queen place models here; let the swarm choose them), issue
17; "Big models" (issue 19: help run big models with other workers, and let workers on the home
network connect directly, which is greyed out while the first is off; both greyed out with the
reason when this build's llama.cpp cannot join groups, ``show_rpc``).

The disk (issue 34): the quota shows the one chosen, or the default a save chooses (half the
free disk); 0 is "no quota". Under it, the space always left free on the disk ("automatic" shows
the default for this disk, 10 % of the disk, 10-50 GB).

The queen URL goes through the same normaliser as the wizard, and one it cannot read is refused
at Save, with the expected form. While the worker earns, a new queen or payout address applies
at once (after a confirmation: the worker reconnects); the folder, quota, VRAM cap and threads
say that they apply when earning restarts, with a "Restart now" button. Edits not yet saved
say "Unsaved changes" until Save.

Jobs at once (issue 36): "Automatic (as memory allows, up to 8)" first, then 1 to 8; a larger
number a config file set stays, shown as its number (``jobs_choices``). It applies when earning
restarts, like the threads.

Test connection (issue 35) beside the queen URL does the wizard's real handshake
(``ApiaryApp.probe_queen``) with the URL and payout address typed, saved or not, and says the
outcome under the field. "Start earning when the app opens" follows the owner's Start and Stop
(``show_at_launch``) without touching other unsaved edits. The Save bar is pinned under the
scrolled form, so it stays in place whatever the header above says."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from pathlib import Path

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDoubleSpinBox,
    QFileDialog,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QMessageBox,
    QPushButton,
    QScrollArea,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from desktop_worker.errors import WorkerError
from desktop_worker.group_family import new_family_code, normalise_family_code
from desktop_worker.groups.rpc import RpcProbe
from desktop_worker.gui.common import plain_label, spawn
from desktop_worker.gui.services.groups import groups_unavailable
from desktop_worker.gui.services.settings import (
    JOBS_HINT,
    RESTART_NAMES,
    SettingsService,
    classify_changes,
    jobs_choices,
    probe_verdict,
)
from desktop_worker.link_probe import ProbeResult
from desktop_worker.owner.policy import active_hours_problem
from desktop_worker.queen_url import normalise_queen_url
from desktop_worker.settings import WorkerSettings
from shared_schema.payout_address import check_payout_address

OK = "color: #166534;"
BAD = "color: #b91c1c;"
PENDING = "color: #92400e;"
UNSAVED = "Unsaved changes"
RESTART_NOTE = "applies when you restart earning"
NOTE = "QLabel { color: #4b5563; } QLabel:disabled { color: #9ca3af; }"
TRAIN_LABEL = ("Take fine-tuning jobs (trains adapters of my models on the CPU, its files "
               "within the disk quota)")
IMAGES_LABEL = "Make images (with the image models I hold, in the same sandbox as text)"
JOIN_LABEL = "Help run big models with other workers"
JOIN_NOTE = ("Your computer may hold part of a large model for another worker. While it does, "
             "it takes no requests of its own. You are paid for the share of the model you "
             "hold.")
FAMILY_LABEL = "Only with my own machines"
FAMILY_NOTE = ("Give each of your machines the same family code: they then run big models only "
               "with each other, never with a stranger's worker. Keep the code to yourself.")
LAN_LABEL = "Let workers on my home network connect directly"
LAN_NOTE = ("Faster, but your computer then accepts connections from your local network; your "
            "firewall may ask you about it. Off: other workers reach it through the queen.")


def note_label(text: str = "") -> QLabel:
    """A grey, wrapped line of plain text explaining the switch above it."""
    label = plain_label(text)
    label.setWordWrap(True)
    label.setStyleSheet(NOTE)
    label.setContentsMargins(22, 0, 0, 4)  # under the switch's text, not its box
    return label


def disk_note(headroom_gb: float) -> str:
    """What the disk settings promise, in plain words."""
    return (f"Apiary never fills this disk past its last {headroom_gb:.0f} GB: a download that "
            "would is refused, or stopped and deleted.")


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


class CheckedField(QWidget):
    """A line edit with a live verdict under it: ``feedback(text)`` gives (valid, message)."""

    def __init__(self, feedback: Callable[[str], tuple[bool, str]], placeholder: str,
                 parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.feedback = feedback
        self.edit = QLineEdit()
        self.edit.setPlaceholderText(placeholder)
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
        self.valid, message = self.feedback(text)
        self.verdict.setText(message)
        self.verdict.setStyleSheet(OK if self.valid else BAD)

    def value(self) -> str | None:
        return self.edit.text().strip() or None


class PayoutField(CheckedField):
    """The payout address, checked as the owner types."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(payout_feedback,
                         "you@wallet.example or lnurl1…  (empty: don't pay me)", parent)


def hours_feedback(text: str) -> tuple[bool, str]:
    """(valid, what to tell the owner) for the active hours field."""
    problem = active_hours_problem(text)
    if problem is not None:
        return False, problem
    if not text.strip():
        return True, "Empty: any time of day."
    return True, "✓ serves only within these hours (this computer's local time)"


class HoursField(CheckedField):
    """The active hours, checked as the owner types."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(hours_feedback,
                         "22:00-07:00  or  09:00-12:00,14:00-18:00  (empty: always)", parent)


def normalise_or_none(text: str) -> str | None:
    try:
        return normalise_queen_url(text)
    except WorkerError:
        return None


def ask(parent: QWidget, title: str, text: str) -> bool:
    answer = QMessageBox.question(parent, title, text)
    return answer == QMessageBox.StandardButton.Yes


class SettingsView(QWidget):
    """``earning()`` says whether the worker runs now; ``reconnect`` (a new queen or address
    while earning) and ``restart_requested`` ("Restart now") are the app's to carry out.
    ``confirm(title, text)`` asks the owner (a dialog; tests replace it). ``tester(url,
    payout)`` is Test connection's handshake (None: no button)."""

    reconnect = Signal()
    restart_requested = Signal()

    def __init__(self, service: SettingsService, parent: QWidget | None = None, *,
                 earning: Callable[[], bool] = lambda: False,
                 tester: Callable[[str, str | None], Awaitable[ProbeResult]] | None = None
                 ) -> None:
        super().__init__(parent)
        self.service = service
        self.earning = earning
        self.confirm: Callable[[str, str], bool] = lambda title, text: ask(self, title, text)
        self.queen = QLineEdit()
        self.queen.setPlaceholderText("queen.example.com or wss://queen.example.com/worker")
        self.tester = tester
        self.test = QPushButton("Test connection")
        self.test.setVisible(tester is not None)
        self.test.clicked.connect(lambda: spawn(self.test_connection()))
        self.tested = plain_label()  # the handshake's outcome, in plain words
        self.tested.setWordWrap(True)
        self.tested.setVisible(False)
        queen_row = QHBoxLayout()
        queen_row.addWidget(self.queen, 1)
        queen_row.addWidget(self.test)
        queen_box = QVBoxLayout()
        queen_box.setContentsMargins(0, 0, 0, 0)
        queen_box.addLayout(queen_row)
        queen_box.addWidget(self.tested)
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
        self.quota.setToolTip("The most the models on this computer may take, models the queen "
                              "places included (0: no quota)")
        self.headroom = QDoubleSpinBox()
        self.headroom.setRange(0, 100_000)
        self.headroom.setDecimals(1)
        self.headroom.setSuffix(" GB")
        self.disk_note = note_label()
        self._auto_headroom_gb = 0.0  # the default for this disk, shown as "automatic"
        self.headroom.valueChanged.connect(self._headroom_changed)
        self.vram = QSpinBox()
        self.vram.setRange(0, 1_000_000)
        self.vram.setSingleStep(256)
        self.vram.setSuffix(" MB")
        self.vram.setSpecialValueText("no cap")
        self.threads = QSpinBox()
        self.threads.setRange(0, os.cpu_count() or 256)
        self.threads.setSpecialValueText("automatic")
        self.jobs = QComboBox()  # jobs at once (issue 36): max_jobs, None first (automatic)
        self.jobs_note = note_label(JOBS_HINT)
        self.at_launch = QCheckBox("Start earning when the app opens")
        self.at_login = QCheckBox("Open Apiary when I log in")
        # When to pause (issue 17).
        self.on_battery = QCheckBox("Pause while this computer runs on battery")
        self.gpu_busy = QSpinBox()
        self.gpu_busy.setRange(0, 100)
        self.gpu_busy.setSuffix(" %")
        self.gpu_busy.setSpecialValueText("never")
        self.gpu_busy.setToolTip("Pause while other programs use more than this share of an "
                                 "NVIDIA GPU's memory (0: never)")
        self.fullscreen = QCheckBox("Pause while a full-screen app runs (a game, a film)")
        self.hours = HoursField()
        # Models (issue 17).
        self.accept_fetch = QCheckBox(
            "Let the queen place models on this machine (within the disk quota)")
        self.swarm_models = QCheckBox("Let the swarm choose my models (downloads what is in "
                                      "demand, removes the least recently used)")
        # Fine-tuning (issue 37): the owner opts in.
        self.train = QCheckBox(TRAIN_LABEL)
        # Images (issue 38): the owner opts in.
        self.images = QCheckBox(IMAGES_LABEL)
        # Big models: model groups (issue 19).
        self.join_groups = QCheckBox(JOIN_LABEL)
        self.join_note = note_label(JOIN_NOTE)
        self.family_only = QCheckBox(FAMILY_LABEL)
        self.family_code = QLineEdit()
        self.family_code.setPlaceholderText("family code")
        self.new_family = QPushButton("New code")
        self.new_family.clicked.connect(lambda: self.family_code.setText(new_family_code()))
        self.family_note = note_label(FAMILY_NOTE)
        self.family_only.toggled.connect(self._groups_enabled)
        self.lan_groups = QCheckBox(LAN_LABEL)
        self.lan_note = note_label(LAN_NOTE)
        self.groups_reason = note_label()  # why this build cannot join groups ("": it can)
        self.groups_reason.setStyleSheet(BAD)
        self.groups_reason.setVisible(False)
        self.rpc_problem: str | None = None
        self.join_groups.toggled.connect(self._groups_enabled)
        self.save = QPushButton("Save")
        self.save.clicked.connect(self.apply)
        self.message = plain_label()  # error messages, in their own words
        self.message.setWordWrap(True)
        self.restart = QPushButton("Restart now")
        self.restart.setVisible(False)
        self.restart.clicked.connect(self._restart_now)

        form = QFormLayout()
        form.addRow("Queen URL", queen_box)
        form.addRow("Lightning payout address", self.payout)
        form.addRow("Models folder", folder)
        form.addRow("Disk quota for models", self.quota)
        form.addRow("Always leave free on the disk", self.headroom)
        form.addRow("", self.disk_note)
        form.addRow("VRAM cap", self.vram)
        form.addRow("CPU threads", self.threads)
        form.addRow("Jobs at once", self.jobs)
        form.addRow("", self.jobs_note)
        form.addRow("", self.at_launch)
        form.addRow("", self.at_login)
        self.pause_group = QGroupBox("When to pause")
        pause_form = QFormLayout(self.pause_group)
        pause_form.addRow("", self.on_battery)
        pause_form.addRow("Another program uses the GPU above", self.gpu_busy)
        pause_form.addRow("", self.fullscreen)
        pause_form.addRow("Serve only during", self.hours)
        self.models_group = QGroupBox("Models")
        models_box = QVBoxLayout(self.models_group)
        models_box.addWidget(self.accept_fetch)
        models_box.addWidget(self.swarm_models)
        models_box.addWidget(self.train)
        models_box.addWidget(self.images)
        self.groups_group = QGroupBox("Big models")
        groups_box = QVBoxLayout(self.groups_group)
        groups_box.addWidget(self.join_groups)
        groups_box.addWidget(self.join_note)
        family_row = QHBoxLayout()
        family_row.addWidget(self.family_only)
        family_row.addWidget(self.family_code, 1)
        family_row.addWidget(self.new_family)
        groups_box.addLayout(family_row)
        groups_box.addWidget(self.family_note)
        groups_box.addWidget(self.lan_groups)
        groups_box.addWidget(self.lan_note)
        groups_box.addWidget(self.groups_reason)
        buttons = QHBoxLayout()
        buttons.addWidget(self.message, 1)
        buttons.addWidget(self.restart)
        buttons.addWidget(self.save)
        body = QWidget()
        fields = QVBoxLayout(body)
        fields.addLayout(form)
        fields.addWidget(self.pause_group)
        fields.addWidget(self.models_group)
        fields.addWidget(self.groups_group)
        fields.addStretch(1)
        self.scroll = QScrollArea()
        self.scroll.setWidgetResizable(True)
        self.scroll.setFrameShape(QScrollArea.Shape.NoFrame)
        self.scroll.setWidget(body)
        layout = QVBoxLayout(self)
        layout.addWidget(self.scroll, 1)
        layout.addLayout(buttons)
        self.payout.edit.textChanged.connect(self._valid_changed)
        self.hours.edit.textChanged.connect(self._valid_changed)
        self.queen.textChanged.connect(self._untested)
        for edit in (self.queen, self.payout.edit, self.models_dir, self.hours.edit,
                     self.family_code):
            edit.textChanged.connect(self._edited)
        for box in (self.quota, self.headroom, self.vram, self.threads, self.gpu_busy):
            box.valueChanged.connect(self._edited)
        self.jobs.currentIndexChanged.connect(self._edited)
        for check in (self.at_launch, self.at_login, self.on_battery, self.fullscreen,
                      self.accept_fetch, self.swarm_models, self.train, self.images,
                      self.join_groups,
                      self.lan_groups, self.family_only):
            check.toggled.connect(self._edited)
        self._loading = False
        self._saved_form: dict[str, object] = {}
        self.load(service.settings)

    def load(self, settings: WorkerSettings) -> None:
        self._loading = True
        try:
            self._fill(settings)
        finally:
            self._loading = False
        self._saved_form = self.form()
        if self.message.text() == UNSAVED:
            self._say("", OK)

    def show_at_launch(self, on: bool) -> None:
        """The owner's Start or Stop changed whether earning starts at launch (saved already):
        the checkbox shows it, and any other unsaved edit stays as typed."""
        self._loading = True
        try:
            self.at_launch.setChecked(on)
        finally:
            self._loading = False
        self._saved_form["at_launch"] = on
        self._edited()

    async def test_connection(self) -> ProbeResult | None:
        """Test connection: the real handshake with the queen URL typed (normalised as Save
        would), its outcome under the field. None when the URL cannot be read (said there)."""
        if self.tester is None:
            return None
        try:
            url = normalise_queen_url(self.queen.text())
        except WorkerError as exc:
            self._show_tested(False, f"✗ {exc}")
            return None
        self.test.setEnabled(False)
        self._show_tested(None, f"Testing {url}…")
        try:
            outcome = await self.tester(url, self.payout.value())
        finally:
            self.test.setEnabled(True)
        if normalise_or_none(self.queen.text()) == url:  # not typed over meanwhile
            ok, text = probe_verdict(outcome)
            self._show_tested(ok, text)
        return outcome

    def _show_tested(self, ok: bool | None, text: str) -> None:
        self.tested.setText(text)
        self.tested.setStyleSheet(PENDING if ok is None else OK if ok else BAD)
        self.tested.setVisible(bool(text))

    def _untested(self, *_args: object) -> None:
        """A new URL typed: the last test's outcome was about another one."""
        if self.test.isEnabled():
            self._show_tested(None, "")

    def form(self) -> dict[str, object]:
        """What the form holds now, as typed (compared with what was last saved or loaded)."""
        return {"queen": self.queen.text().strip(), "payout": self.payout.edit.text().strip(),
                "models_dir": self.models_dir.text().strip(), "quota": self.quota.value(),
                "headroom": self.headroom.value(),
                "vram": self.vram.value(), "threads": self.threads.value(),
                "jobs": self.jobs.currentData(),
                "at_launch": self.at_launch.isChecked(), "at_login": self.at_login.isChecked(),
                "on_battery": self.on_battery.isChecked(), "gpu_busy": self.gpu_busy.value(),
                "fullscreen": self.fullscreen.isChecked(), "hours": self.hours.edit.text().strip(),
                "accept_fetch": self.accept_fetch.isChecked(),
                "swarm_models": self.swarm_models.isChecked(),
                "train": self.train.isChecked(),
                "images": self.images.isChecked(),
                "join_groups": self.join_groups.isChecked(),
                "lan_groups": self.lan_groups.isChecked(),
                "family": self.family_code.text().strip() if self.family_only.isChecked()
                else ""}

    def show_rpc(self, probe: RpcProbe) -> None:
        """What this build's llama.cpp can do: without its RPC backend, the group switches are
        greyed out and say why (what is saved stays as it is)."""
        self.rpc_problem = groups_unavailable(probe)
        self.groups_reason.setText(self.rpc_problem or "")
        self.groups_reason.setVisible(self.rpc_problem is not None)
        self._groups_enabled()

    def _groups_enabled(self, *_args: object) -> None:
        """The LAN switch only means something while groups are on; neither can be used by a
        build that cannot join groups."""
        able = self.rpc_problem is None
        self.join_groups.setEnabled(able)
        self.join_note.setEnabled(able)
        lan = able and self.join_groups.isChecked()
        self.lan_groups.setEnabled(lan)
        self.lan_note.setEnabled(lan)
        self.family_only.setEnabled(lan)
        self.family_note.setEnabled(lan)
        family = lan and self.family_only.isChecked()
        self.family_code.setEnabled(family)
        self.new_family.setEnabled(family)

    def _headroom_changed(self, value: float) -> None:
        self.disk_note.setText(disk_note(value or self._auto_headroom_gb))

    def _valid_changed(self, *_args: object) -> None:
        self.save.setEnabled(self.payout.valid and self.hours.valid)

    def _edited(self, *_args: object) -> None:
        if self._loading:
            return
        if self.form() != self._saved_form:
            self._say(UNSAVED, PENDING)
        elif self.message.text() == UNSAVED:
            self._say("", OK)

    def _fill(self, settings: WorkerSettings) -> None:
        self.queen.setText(settings.queen_url)
        self.payout.edit.setText(settings.ln_url or "")
        self.models_dir.setText(str(settings.models_dir))
        self.quota.setValue(self.service.quota_gb(settings))
        auto = self.service.headroom_gb(settings.model_copy(update={"disk_headroom_gb": None}))
        self._auto_headroom_gb = auto
        self.headroom.setSpecialValueText(f"automatic ({auto:.0f} GB)")
        self.headroom.setValue(settings.disk_headroom_gb or 0)
        self._headroom_changed(self.headroom.value())
        self.vram.setValue(settings.vram_cap_mb or 0)
        self.threads.setValue(settings.threads or 0)
        self._fill_jobs(settings.max_jobs)
        self.at_launch.setChecked(settings.start_earning_at_launch)
        self.at_login.setChecked(self.service.run_at_login())
        self.on_battery.setChecked(settings.pause_on_battery)
        self.gpu_busy.setValue(settings.pause_gpu_busy_pct or 0)
        self.fullscreen.setChecked(settings.pause_fullscreen)
        self.hours.edit.setText(settings.active_hours or "")
        self.accept_fetch.setChecked(settings.accept_fetch)
        self.swarm_models.setChecked(settings.swarm_models)
        self.train.setChecked(settings.train)
        self.images.setChecked(settings.images)
        self.join_groups.setChecked(settings.join_groups)
        self.lan_groups.setChecked(settings.lan_groups)
        self.family_only.setChecked(settings.group_family is not None)
        self.family_code.setText(settings.group_family or "")
        self._groups_enabled()

    def _fill_jobs(self, max_jobs: int | None) -> None:
        """The choices for ``max_jobs`` (a larger saved number among them), it selected."""
        self.jobs.clear()
        for text, value in jobs_choices(max_jobs):
            self.jobs.addItem(text, value)
            if value == max_jobs:
                self.jobs.setCurrentIndex(self.jobs.count() - 1)

    def browse(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Models folder", self.models_dir.text())
        if folder:
            self.models_dir.setText(folder)

    def apply(self) -> bool:
        """Save (refusing what cannot be read), then apply what can apply now."""
        if not self.payout.valid:
            self._say(f"Payout address: {self.payout.verdict.text()}", BAD)
            return False
        if not self.hours.valid:
            self._say(f"Active hours: {self.hours.verdict.text()}", BAD)
            return False
        try:
            queen_url = normalise_queen_url(self.queen.text())
        except WorkerError as exc:
            self._say(f"Queen URL: {exc}", BAD)
            return False
        family = self.family_code.text().strip() if self.family_only.isChecked() else None
        if family is not None:
            try:
                normalise_family_code(family)
            except ValueError as exc:
                self._say(f"Family code: {exc}", BAD)
                return False
        at_login = self.at_login.isChecked()  # read before saving reloads the form
        changes = {
            "queen_url": queen_url,
            "ln_url": self.payout.value(),
            "models_dir": Path(self.models_dir.text().strip()).expanduser(),
            "disk_quota_gb": self.quota.value(),
            "disk_headroom_gb": self.headroom.value() or None,
            "vram_cap_mb": self.vram.value() or None,
            "threads": self.threads.value() or None,
            "max_jobs": self.jobs.currentData(),
            "start_earning_at_launch": self.at_launch.isChecked(),
            "pause_on_battery": self.on_battery.isChecked(),
            "pause_gpu_busy_pct": self.gpu_busy.value() or None,
            "pause_fullscreen": self.fullscreen.isChecked(),
            "active_hours": self.hours.value(),
            "accept_fetch": self.accept_fetch.isChecked(),
            "swarm_models": self.swarm_models.isChecked(),
            "train": self.train.isChecked(),
            "images": self.images.isChecked(),
            "join_groups": self.join_groups.isChecked(),
            "lan_groups": self.lan_groups.isChecked(),
            "group_family": family,
        }
        live, on_restart = classify_changes(self.service.settings, changes)
        earning = self.earning()
        if live and earning and not self.confirm(
                "Reconnect to the queen?",
                "Apiary will reconnect to apply the new "
                + " and ".join({"queen_url": "queen", "ln_url": "payout address"}[n]
                               for n in live)
                + ". A job in flight finishes first (or is cancelled after a few seconds)."):
            self._say("Not saved: the worker keeps its current settings. " + UNSAVED + ".",
                      PENDING)
            return False
        try:
            self.service.update(**changes)
            if at_login != self.service.run_at_login():
                self.service.set_run_at_login(at_login)
                self.at_login.setChecked(self.service.run_at_login())
        except WorkerError as exc:
            self._say(str(exc), BAD)
            return False
        self._saved_form = self.form()
        self._after_save(live, on_restart, earning)
        return True

    def _after_save(self, live: list[str], on_restart: list[str], earning: bool) -> None:
        if earning and live:
            self.reconnect.emit()  # the restart applies the others too
            self.restart.setVisible(False)
            self._say("Saved. Reconnecting to apply it now.", OK)
        elif earning and on_restart:
            what = ", ".join(RESTART_NAMES.get(n, n) for n in on_restart)
            self.restart.setVisible(True)
            self._say(f"Saved. The change to {what} {RESTART_NOTE}.", OK)
        else:
            self.restart.setVisible(False)
            self._say("Saved.", OK)

    def _restart_now(self) -> None:
        self.restart.setVisible(False)
        self._say("Restarting earning to apply the saved settings…", OK)
        self.restart_requested.emit()

    def _say(self, text: str, style: str) -> None:
        self.message.setText(text)
        self.message.setStyleSheet(style)
