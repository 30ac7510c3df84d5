"""The Models tab: the cached models with their provenance (repo, file, commit, sha256); add one
by name (checked first, then downloaded with a progress bar, speed, ETA and Cancel); import a
local .gguf; delete; disk use against the quota. Above them, "In demand": the models the queen's
developers ask for that fit this machine, each with the earnings estimate and a one-click Add
(the same pull, pinned to the commit and file the queen routes to). Each model's price on the
queen, and why (issue 35: the queen's word from the earnings answer, ``EarningsService.prices``),
is its last column and, for the selected model, the line under its provenance."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QAbstractItemView,
    QFileDialog,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QMessageBox,
    QProgressBar,
    QPushButton,
    QTableView,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from desktop_worker.gui.common import duration, plain_label, size, spawn, speed
from desktop_worker.gui.services.demand import DemandRow
from desktop_worker.gui.services.earnings import EarningsService, price_cell, price_line
from desktop_worker.gui.services.models import (
    ADD_COLUMN,
    DemandTableModel,
    DiskUse,
    ModelsService,
    progress_fraction,
    provenance,
)
from desktop_worker.store import LocalModel, PullProgress

COLUMNS = ("Model", "Size", "Quant", "Parameters", "Last used", "Source", "Provenance",
           "Price here")
PRICE_COLUMN = COLUMNS.index("Price here")
NO_DEMAND = ("No demand from the queen yet: it says what developers ask for once this worker "
             "is connected (Start Earning).")
NOTHING_FITS = ("Nothing the queen's developers ask for fits this machine and is not here "
                "already.")
SWARM_ON = ("The swarm chooses your models (Settings): what is in demand is added by itself, "
            "within your disk quota.")
RIGHT = Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter
OUTCOME_COLOURS = {"done": "#166534", "cancelled": "#92400e", "warning": "#92400e",
                   "refused": "#b91c1c", "failed": "#b91c1c"}


class ModelsView(QWidget):
    def __init__(self, service: ModelsService, prices: EarningsService | None = None,
                 parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.service = service
        self.prices = prices  # the queen's prices of this worker's models, when it says
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.verticalHeader().setVisible(False)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        header = self.table.horizontalHeader()
        header.setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
        for column in range(1, len(COLUMNS)):
            header.setSectionResizeMode(column, QHeaderView.ResizeMode.ResizeToContents)

        self.name = QLineEdit()
        self.name.setPlaceholderText("Hugging Face name, e.g. bartowski/Llama-3.2-1B-Instruct-GGUF"
                                     ":Q4_K_M")
        self.add = QPushButton("Add model")
        self.add.clicked.connect(self.add_model)
        self.name.returnPressed.connect(self.add_model)
        self.progress = QProgressBar()
        self.progress.setVisible(False)
        self.rate = plain_label()
        self.cancel = QPushButton("Cancel")
        self.cancel.setVisible(False)
        self.cancel.clicked.connect(service.cancel)
        self.message = plain_label()  # hub and store errors, model names
        self.message.setWordWrap(True)
        self.anyway = QPushButton("Download anyway")
        self.anyway.setVisible(False)
        self.anyway.clicked.connect(self.add_anyway)
        self.import_button = QPushButton("Import .gguf file…")
        self.import_button.clicked.connect(self.choose_import)
        self.delete = QPushButton("Delete")
        self.delete.clicked.connect(self.delete_selected)
        self.disk = QProgressBar()
        self.disk.setTextVisible(True)
        self.details = plain_label()  # the selected model's provenance
        self.details.setWordWrap(True)
        self.details.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.details.setStyleSheet("color: #4b5563;")
        self.price = plain_label()  # the selected model's price on the queen, and why
        self.price.setObjectName("price")
        self.price.setWordWrap(True)
        self.price.setStyleSheet("color: #78350f;")
        self.table.itemSelectionChanged.connect(self.show_details)
        self._models: dict[str, LocalModel] = {}

        self.demand = DemandTableModel(self)
        self.demand_table = QTableView()
        self.demand_table.setModel(self.demand)
        self.demand_table.verticalHeader().setVisible(False)
        self.demand_table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.demand_table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        dheader = self.demand_table.horizontalHeader()
        dheader.setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        dheader.setSectionResizeMode(1, QHeaderView.ResizeMode.Stretch)
        self.demand_table.setMaximumHeight(170)
        self.demand_note = plain_label(NO_DEMAND)
        self.demand_note.setWordWrap(True)
        self.demand_note.setStyleSheet("color: #4b5563;")
        self.add_buttons: dict[str, QPushButton] = {}

        add_row = QHBoxLayout()
        add_row.addWidget(self.name, 1)
        add_row.addWidget(self.add)
        progress_row = QHBoxLayout()
        progress_row.addWidget(self.progress, 1)
        progress_row.addWidget(self.rate)
        progress_row.addWidget(self.cancel)
        message_row = QHBoxLayout()
        message_row.addWidget(self.message, 1)
        message_row.addWidget(self.anyway)
        buttons = QHBoxLayout()
        buttons.addWidget(self.import_button)
        buttons.addWidget(self.delete)
        buttons.addStretch(1)
        buttons.addWidget(QLabel("Disk:"))
        buttons.addWidget(self.disk, 1)
        layout = QVBoxLayout(self)
        title = QLabel("<b>In demand</b> on your queen: models that fit this machine")
        layout.addWidget(title)
        layout.addWidget(self.demand_table)
        layout.addWidget(self.demand_note)
        layout.addSpacing(6)
        layout.addWidget(QLabel("<b>Your models</b>"))
        layout.addLayout(add_row)
        layout.addLayout(progress_row)
        layout.addLayout(message_row)
        layout.addWidget(self.table, 1)
        layout.addWidget(self.details)
        layout.addWidget(self.price)
        layout.addLayout(buttons)

        service.models_changed.connect(self.show_models)
        service.disk_changed.connect(self.show_disk)
        service.progress.connect(self.show_progress)
        service.pull_started.connect(self.on_started)
        service.pull_finished.connect(self.on_finished)
        service.busy_changed.connect(self.on_busy)
        service.demand_changed.connect(self.show_demand)
        if prices is not None:
            prices.updated.connect(lambda _earnings: self.show_prices())

    # --- bindings --------------------------------------------------------------------------------

    def show_models(self, models: list[LocalModel]) -> None:
        self._models = {m.name: m for m in models}
        self.table.setRowCount(len(models))
        for row, model in enumerate(models):
            used = dt.datetime.fromtimestamp(model.last_used).strftime("%Y-%m-%d %H:%M")
            params = model.info.parameter_count
            repo, _file, commit = provenance(model)
            origin = f"{repo} @ {commit[:10]}" if commit else repo
            cells = (model.name, size(model.size_bytes), model.info.quant or "-",
                     f"{params / 1e9:.2f} B" if params else "?", used, model.source, origin)
            for column, text in enumerate(cells):
                item = QTableWidgetItem(text)
                if column == 1:
                    item.setTextAlignment(RIGHT)
                item.setToolTip(provenance_text(model))
                self.table.setItem(row, column, item)
        self.show_prices()

    def show_prices(self) -> None:
        """Each model's price on the queen (the last column) and the selected one's line."""
        known = self.prices.prices if self.prices is not None else {}
        for row in range(self.table.rowCount()):
            name = self.table.item(row, 0).text()
            self.table.setItem(row, PRICE_COLUMN, QTableWidgetItem(price_cell(known.get(name))))
        self.show_details()

    def show_details(self) -> None:
        """The selected model's provenance, in full (selectable, to compare by hand)."""
        rows = self.table.selectionModel().selectedRows()
        item = self.table.item(rows[0].row(), 0) if rows else None
        model = self._models.get(item.text()) if item is not None else None
        self.details.setText(provenance_text(model) if model is not None
                             else "Select a model to see where it came from.")
        if model is None or self.prices is None:
            self.price.setText("")
        else:
            self.price.setText(price_line(self.prices.prices.get(model.name), self.prices.pays))
        self.price.setVisible(bool(self.price.text()))

    def show_demand(self, rows: list[DemandRow]) -> None:
        self.demand.set_rows(rows)
        self.add_buttons = {}
        for number, row in enumerate(rows):
            button = QPushButton("Replace" if row.replaces else "Add")
            button.setToolTip(f"Download {row.name} (the file the queen pinned)")
            button.clicked.connect(lambda _=False, name=row.name: self.add_in_demand(name))
            button.setEnabled(self.add.isEnabled())
            self.demand_table.setIndexWidget(self.demand.index(number, ADD_COLUMN), button)
            self.add_buttons[row.name] = button
        if self.service.settings.swarm_models:
            self.demand_note.setText(SWARM_ON)
        elif self.service.demand is None:
            self.demand_note.setText(NO_DEMAND)
        elif not rows:
            self.demand_note.setText(NOTHING_FITS)
        else:
            self.demand_note.setText("Estimates are for the time this worker serves the model; "
                                     "hover over one to see how it is computed.")
    def names(self) -> list[str]:
        return [self.table.item(row, 0).text() for row in range(self.table.rowCount())]

    def show_disk(self, use: DiskUse) -> None:
        limit = use.quota_bytes or (use.used_bytes + use.free_bytes)
        self.disk.setRange(0, 1000)
        self.disk.setValue(int(1000 * use.used_bytes / limit) if limit else 0)
        what = f"quota {size(use.quota_bytes)}" if use.quota_bytes else "no quota"
        self.disk.setFormat(f"{size(use.used_bytes)} used, {what}, {size(use.free_bytes)} free")

    def on_started(self, name: str) -> None:
        self.progress.setVisible(True)
        self.progress.setRange(0, 0)
        self.cancel.setVisible(True)
        self.rate.setText("starting…")
        self._say(f"Downloading {name}…", "#1f2937")

    def show_progress(self, progress: PullProgress) -> None:
        fraction = progress_fraction(progress)
        if fraction is None:
            self.progress.setRange(0, 0)
        else:
            self.progress.setRange(0, 1000)
            self.progress.setValue(int(fraction * 1000))
        self.progress.setFormat(f"{size(progress.downloaded_bytes)} of "
                                f"{size(progress.total_bytes)}  (%p%)")
        self.rate.setText(f"{speed(progress.bytes_per_s)}, {duration(progress.eta_s)} left")

    def on_finished(self, name: str, outcome: str, message: str) -> None:
        self.cancel.setVisible(False)
        self.progress.setVisible(outcome == "cancelled")
        self.rate.setText("cancelled" if outcome == "cancelled" else "")
        self.anyway.setVisible(outcome == "warning")
        self._pending = name if outcome == "warning" else None
        text = f"{message}. Download anyway?" if outcome == "warning" else message
        self._say(text, OUTCOME_COLOURS.get(outcome, "#1f2937"))
        if outcome == "done":
            self.name.clear()

    def on_busy(self, busy: bool) -> None:
        self.add.setEnabled(not busy)
        self.import_button.setEnabled(not busy)
        for button in self.add_buttons.values():
            button.setEnabled(not busy)

    def _say(self, text: str, colour: str) -> None:
        self.message.setText(text)
        self.message.setStyleSheet(f"color: {colour};")

    # --- actions ---------------------------------------------------------------------------------

    def add_model(self) -> None:
        name = self.name.text().strip()
        if not name:
            self._say("Type a model's Hugging Face name first (hf-user/hf-repo:filter).",
                      "#b91c1c")
            return
        self.anyway.setVisible(False)
        self._say(f"Checking {name}…", "#1f2937")
        spawn(self.service.pull(name))

    def add_in_demand(self, name: str) -> None:
        """One click on an in-demand row's Add: the usual pull, pinned to the queen's file."""
        row = self.service.demand_row(name)
        if row is None:
            return
        self.anyway.setVisible(False)
        self._say(f"Checking {name}…", "#1f2937")
        spawn(self.service.pull(name, revision=row.demand.revision,
                                expect_sha256=row.demand.sha256))

    def add_anyway(self) -> None:
        name = getattr(self, "_pending", None)
        if name:
            self.anyway.setVisible(False)
            row = self.service.demand_row(name)
            pin = {} if row is None else {"revision": row.demand.revision,
                                          "expect_sha256": row.demand.sha256}
            spawn(self.service.pull(name, force=True, **pin))

    def choose_import(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Import a GGUF model", str(Path.home()),
                                              "GGUF models (*.gguf)")
        if path:
            self._say(f"Importing {Path(path).name} (copying and hashing)…", "#1f2937")
            spawn(self.service.import_file(Path(path)))

    def delete_selected(self) -> None:
        rows = self.table.selectionModel().selectedRows()
        if not rows:
            self._say("Select a model to delete.", "#b91c1c")
            return
        name = self.table.item(rows[0].row(), 0).text()
        answer = QMessageBox.question(self, "Delete model", f"Delete {name} from this computer?")
        if answer == QMessageBox.StandardButton.Yes:
            spawn(self._remove(name))

    async def _remove(self, name: str) -> None:
        error = await self.service.remove(name)
        self._say(error or f"Deleted {name}.", "#b91c1c" if error else "#166534")


def provenance_text(model: LocalModel) -> str:
    """Repo, file, commit and sha256 of a model, one per line."""
    repo, file, commit = provenance(model)
    if model.source != "hub":
        return f"Imported from {file}\nsha256 {model.sha256}"
    return (f"Repo {repo}\nFile {file}\nCommit {commit or 'not recorded'}\n"
            f"sha256 {model.sha256}")
