"""The Logs tab: a live, bounded view of the worker's log."""

from __future__ import annotations

from PySide6.QtGui import QFont, QFontDatabase
from PySide6.QtWidgets import (
    QCheckBox,
    QHBoxLayout,
    QPlainTextEdit,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from desktop_worker.gui.services.worker import LogBridge

MAX_LINES = 5000


class LogsView(QWidget):
    def __init__(self, bridge: LogBridge, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.text = QPlainTextEdit()
        self.text.setReadOnly(True)
        self.text.setMaximumBlockCount(MAX_LINES)
        font: QFont = QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont)
        self.text.setFont(font)
        self.debug = QCheckBox("Show debug lines")
        clear = QPushButton("Clear")
        clear.clicked.connect(self.text.clear)
        bar = QHBoxLayout()
        bar.addWidget(self.debug)
        bar.addStretch(1)
        bar.addWidget(clear)
        layout = QVBoxLayout(self)
        layout.addLayout(bar)
        layout.addWidget(self.text)
        bridge.record.connect(self.append)

    def append(self, level: str, _logger: str, line: str) -> None:
        if level == "DEBUG" and not self.debug.isChecked():
            return
        self.text.appendPlainText(line)

    def lines(self) -> list[str]:
        return self.text.toPlainText().splitlines()
