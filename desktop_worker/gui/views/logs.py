"""The Logs tab: a live, bounded view of the worker's log, with repeated lines folded
("… repeated 26 times", by ``services/logs.LogFolder``)."""

from __future__ import annotations

from PySide6.QtGui import QFont, QFontDatabase, QTextCursor
from PySide6.QtWidgets import (
    QCheckBox,
    QHBoxLayout,
    QPlainTextEdit,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from desktop_worker.gui.services.logs import Append, Edit, LogFolder
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
        self.folder = LogFolder()
        self.debug = QCheckBox("Show debug lines")
        clear = QPushButton("Clear")
        clear.clicked.connect(self.clear)
        bar = QHBoxLayout()
        bar.addWidget(self.debug)
        bar.addStretch(1)
        bar.addWidget(clear)
        layout = QVBoxLayout(self)
        layout.addLayout(bar)
        layout.addWidget(self.text)
        bridge.record.connect(self.append)

    def append(self, level: str, logger: str, line: str, message: str = "") -> None:
        if level == "DEBUG" and not self.debug.isChecked():
            return
        key = f"{level}\x00{logger}\x00{message or line}"
        self.apply(self.folder.feed(key, line))

    def apply(self, edits: list[Edit]) -> None:
        for edit in edits:
            if isinstance(edit, Append):
                self.text.appendPlainText(edit.text)
            else:
                self._remove_last(edit.count)

    def _remove_last(self, count: int) -> None:
        document = self.text.document()
        count = min(count, document.blockCount())
        if count <= 0:
            return
        cursor = QTextCursor(document)
        cursor.movePosition(QTextCursor.MoveOperation.End)
        first = document.findBlockByNumber(document.blockCount() - count)
        start = first.position()
        if first.blockNumber() > 0:  # take the newline before the first removed line too
            start -= 1
        cursor.setPosition(start, QTextCursor.MoveMode.KeepAnchor)
        cursor.removeSelectedText()

    def clear(self) -> None:
        self.text.clear()
        self.folder.reset()

    def lines(self) -> list[str]:
        return self.text.toPlainText().splitlines()
