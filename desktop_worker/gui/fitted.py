"""Labels for the header that never change its size, whatever text they are given (issue 35):
``ElidedLabel`` is one line, elided in the middle when narrower than its text; ``ReasonLabel`` is
a fixed number of wrapped lines, its text fitted a sentence at a time (``fit_reason``). Both
refit whenever their room changes, keep the whole text in their tooltip when they cut it, and
never ask for more width than the window has, so nothing below the header moves."""

from __future__ import annotations

from PySide6.QtCore import QEvent, QRect, QSize, Qt
from PySide6.QtGui import QResizeEvent, QShowEvent
from PySide6.QtWidgets import QLabel, QSizePolicy, QWidget

from desktop_worker.gui.services.worker import fit_reason

__all__ = ["ElidedLabel", "FittedLabel", "ReasonLabel", "relayout"]


def relayout(widget: QWidget | None) -> None:
    """Lay ``widget``'s children out now rather than at the next turn of the event loop, so
    a label sized by its neighbours is fitted to the width it really gets."""
    if widget is not None and widget.isVisible() and widget.layout() is not None:
        widget.layout().activate()


class FittedLabel(QLabel):
    """Plain text fitted to the label's room (``refit``), again whenever that room changes."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setTextFormat(Qt.TextFormat.PlainText)

    def refit(self) -> None:
        raise NotImplementedError

    def resizeEvent(self, event: QResizeEvent) -> None:
        super().resizeEvent(event)
        self.refit()

    def showEvent(self, event: QShowEvent) -> None:
        super().showEvent(event)
        self.refit()


class ElidedLabel(FittedLabel):
    """One line of plain text that never widens its window: narrower than its text, it shows
    the text elided in the middle, and the whole of it in its tooltip. ``text()`` is what is
    shown; ``full`` what was set."""

    def __init__(self, min_chars: int = 8, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.full = ""
        self.min_chars = min_chars
        self.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Fixed)

    def set_full_text(self, text: str) -> None:
        self.full = text
        self.updateGeometry()
        relayout(self.parentWidget())  # the width the new text gets, before eliding it
        self.refit()

    def sizeHint(self) -> QSize:
        margins = self.contentsMargins()
        width = self.fontMetrics().horizontalAdvance(self.full) + margins.left() + margins.right()
        return QSize(width + 2, super().sizeHint().height())

    def minimumSizeHint(self) -> QSize:
        return QSize(self.fontMetrics().averageCharWidth() * self.min_chars,
                     super().minimumSizeHint().height())

    def refit(self) -> None:
        width = self.contentsRect().width()
        shown = self.full if not self.isVisible() or width <= 0 else \
            self.fontMetrics().elidedText(self.full, Qt.TextElideMode.ElideMiddle, width)
        self.setToolTip(self.full if shown != self.full else "")
        self.setText(shown)


class ReasonLabel(FittedLabel):
    """The header's reason: ``lines`` lines of wrapped plain text, always that tall and never
    wider than it is given. A text too long for them is fitted a sentence at a time
    (``fit_reason``), again whenever the label's width changes; ``reason`` is the whole text,
    shown in the tooltip when cut."""

    def __init__(self, lines: int, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.lines = lines
        self.reason = ""
        self.setWordWrap(True)
        self.setAlignment(Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignTop)
        self.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Fixed)
        self._fit_height()

    def set_reason(self, text: str) -> None:
        self.reason = text
        self.refit()

    def changeEvent(self, event: QEvent) -> None:
        super().changeEvent(event)
        if event.type() in (QEvent.Type.FontChange, QEvent.Type.StyleChange):
            self._fit_height()  # a bolder style (paused, flagged) measures differently
            self.refit()

    def _fit_height(self) -> None:
        self.setFixedHeight(self.lines * self.fontMetrics().lineSpacing() + 2)

    def refit(self) -> None:
        box = self.contentsRect()
        width, height = box.width(), box.height()
        if not self.isVisible() or width <= 0:
            self.setText(self.reason)  # not laid out yet: fitted when it is
            self.setToolTip("")
            return
        metrics = self.fontMetrics()

        def fits(text: str) -> bool:
            used = metrics.boundingRect(QRect(0, 0, width, 100 * height),
                                        Qt.TextFlag.TextWordWrap, text)
            return used.height() <= height and used.width() <= width

        shown = fit_reason(self.reason, fits)
        self.setText(shown)
        self.setToolTip(self.reason if shown != self.reason else "")
