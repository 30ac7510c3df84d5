"""The Hardware tab: each NVIDIA and OpenCL GPU (name, driver, a VRAM bar), CPU, RAM, disk, what
each loaded model serves now (its jobs at once, the jobs running and tokens/s per stream and in
total, ``services.serving``, issue 36) and what the engine's sandbox holds on this machine
(``services.sandbox``). The boxes scroll; "Detect again" stays under them."""

from __future__ import annotations

from PySide6.QtWidgets import (
    QFormLayout,
    QGroupBox,
    QLabel,
    QProgressBar,
    QPushButton,
    QScrollArea,
    QVBoxLayout,
    QWidget,
)

from desktop_worker.gui.common import plain_label
from desktop_worker.gui.services.sandbox import SandboxSummary, sandbox_summary
from desktop_worker.gui.services.serving import (
    NOT_EARNING,
    ModelServing,
    serving_rows,
)
from desktop_worker.hardware import ComputeDevice, HardwareReport


def vram_bar(device: ComputeDevice) -> QProgressBar:
    bar = QProgressBar()
    total = max(device.memory_total_mb, 1)
    bar.setRange(0, total)
    if device.memory_free_mb is not None:
        used = total - device.memory_free_mb
        bar.setValue(used)
        bar.setFormat(f"{used:,} of {total:,} MB in use")
    else:
        bar.setValue(0)
        bar.setFormat(f"{total:,} MB (use not reported)")
    return bar


def ram_bar_values(total_mb: int, available_mb: int) -> tuple[int, int, str]:
    """(value, maximum, text) of the RAM bar: the fill is the memory in use, and the text says
    so ("1,234 MB used of 24,105 MB"), like the VRAM bars."""
    total = max(total_mb, 1)
    used = min(max(total_mb - available_mb, 0), total)
    return used, total, f"{used:,} MB used of {total_mb:,} MB ({available_mb:,} MB free)"


class HardwareView(QWidget):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.refresh_button = QPushButton("Detect again")
        content = QWidget()
        self._layout = QVBoxLayout(content)
        self._body = QWidget()
        self._layout.addWidget(self._body)
        self.serving_box = QGroupBox("Serving")
        self._serving_form = QFormLayout(self.serving_box)
        self._layout.addWidget(self.serving_box)
        self.sandbox_box = QGroupBox("Engine sandbox")
        self._sandbox_form = QFormLayout(self.sandbox_box)
        self._layout.addWidget(self.sandbox_box)
        self._layout.addStretch(1)
        # The boxes scroll (a machine with two GPUs and a few models outgrows the window);
        # the button stays in place under them.
        self.scroll = QScrollArea()
        self.scroll.setWidgetResizable(True)
        self.scroll.setFrameShape(QScrollArea.Shape.NoFrame)
        self.scroll.setWidget(content)
        outer = QVBoxLayout(self)
        outer.addWidget(self.scroll, 1)
        outer.addWidget(self.refresh_button)
        self.gpu_names: list[str] = []
        self.ram: QProgressBar | None = None
        self.sandbox: SandboxSummary = sandbox_summary(None)
        self.serving: list[ModelServing] = []
        self.show_report(None)
        self.show_serving(NOT_EARNING, [])
        self.show_sandbox(self.sandbox)

    def show_serving(self, headline: str, figures: list[ModelServing]) -> None:
        """What each loaded model serves now (``headline``: why there is none, else "")."""
        self.serving = figures
        form = self._serving_form
        while form.rowCount():
            form.removeRow(0)
        if headline:
            line = plain_label(headline)
            line.setWordWrap(True)
            form.addRow(line)
        for model in figures:
            name = plain_label(model.model)  # a name the queen chose: never read as HTML
            font = name.font()
            font.setBold(True)
            name.setFont(font)
            form.addRow(name)
            for label, value in serving_rows(model):
                form.addRow(label, plain_label(value))

    def show_sandbox(self, summary: SandboxSummary) -> None:
        """What the sandbox around the engine's processes holds here."""
        self.sandbox = summary
        form = self._sandbox_form
        while form.rowCount():
            form.removeRow(0)
        headline = QLabel(summary.headline)
        headline.setWordWrap(True)
        form.addRow(headline)
        for label, value in summary.rows:
            form.addRow(label, QLabel(value))
        for note in summary.notes:
            line = QLabel(f"• {note}")
            line.setWordWrap(True)
            form.addRow(line)

    def show_report(self, report: HardwareReport | None) -> None:
        self._layout.removeWidget(self._body)
        self._body.deleteLater()
        self._body = QWidget()
        body = QVBoxLayout(self._body)
        body.setContentsMargins(0, 0, 0, 0)
        self.gpu_names = []
        self.ram = None
        if report is None:
            body.addWidget(QLabel("Detecting this machine's hardware…"))
            self._layout.insertWidget(0, self._body)
            return
        for title, result in (("NVIDIA (NVML)", report.nvidia), ("OpenCL", report.opencl)):
            box = QGroupBox(title)
            form = QFormLayout(box)
            devices = result.gpus
            if not devices:
                reason = result.reason or "no GPU found"
                form.addRow(QLabel(f"No GPU: {reason}"))
            for device in devices:
                self.gpu_names.append(device.name)
                driver = device.driver_version or result.driver_version or "unknown driver"
                capability = device.compute_capability
                extra = f", compute {capability}" if capability else ""
                form.addRow(QLabel(f"<b>{device.name}</b>"), QLabel(f"driver {driver}{extra}"))
                form.addRow("VRAM", vram_bar(device))
            body.addWidget(box)
        system = QGroupBox("This machine")
        form = QFormLayout(system)
        form.addRow("CPU threads", QLabel(str(report.cpu_count)))
        self.ram = QProgressBar()
        value, maximum, text = ram_bar_values(report.total_ram_mb, report.available_ram_mb)
        self.ram.setRange(0, maximum)
        self.ram.setValue(value)
        self.ram.setFormat(text)
        form.addRow("RAM", self.ram)
        form.addRow("Free disk", QLabel(f"{report.disk_space:,} GB where models are kept "
                                        f"({report.models_dir})"))
        body.addWidget(system)
        self._layout.insertWidget(0, self._body)
