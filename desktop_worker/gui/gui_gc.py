"""Python's cyclic garbage collector, run on the GUI thread only.

A cyclic collection runs on whichever thread happens to allocate when a generation's threshold
is crossed: in this app, often a worker thread (a model import hashing a file, a generation).
If that collection frees a Qt object caught in a reference cycle, the object is destroyed on
the wrong thread; a timer it owned stays registered, and Qt's next tick on the GUI thread
reaches freed memory and the app crashes. ``GuiThreadCollector`` turns automatic collection
off and runs it from a timer on the GUI thread instead, by the same thresholds (the usual remedy
for PyQt and PySide apps). Reference counting still frees everything else at once, anywhere.
"""

from __future__ import annotations

import gc
import logging

from PySide6.QtCore import QObject, QTimer

log = logging.getLogger(__name__)

CHECK_INTERVAL_MS = 500


class GuiThreadCollector(QObject):
    """Create and ``start`` it on the GUI thread; ``stop`` gives collection back to Python."""

    def __init__(self, parent: QObject | None = None, interval_ms: int = CHECK_INTERVAL_MS
                 ) -> None:
        super().__init__(parent)
        self._thresholds = gc.get_threshold()
        self._was_enabled = gc.isenabled()
        self._timer = QTimer(self)
        self._timer.setInterval(interval_ms)
        self._timer.timeout.connect(self.check)

    def start(self) -> None:
        self._was_enabled = gc.isenabled()
        gc.disable()
        self._timer.start()

    def stop(self) -> None:
        self._timer.stop()
        if self._was_enabled:
            gc.enable()

    def check(self) -> int | None:
        """Collect the oldest generation past its threshold, as Python itself would; returns
        the generation collected, or None."""
        counts = gc.get_count()
        for generation in (2, 1, 0):
            if self._thresholds[generation] and counts[generation] > self._thresholds[generation]:
                gc.collect(generation)
                return generation
        return None
