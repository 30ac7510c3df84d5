"""The PySide6 that pyproject.toml allows must not leak references to None or True.

PySide6 6.12's abi3 wheels return ``None`` from void methods, and ``True`` from signal emits,
without a new reference. On Python 3.11 (where those objects are not immortal) a busy window
then aborts the app with "none_dealloc" within minutes; pyproject.toml keeps PySide6 below 6.12.
"""

from __future__ import annotations

import sys

from PySide6.QtCore import QObject, Signal
from PySide6.QtWidgets import QLabel


class _Emitter(QObject):
    fired = Signal()


def test_void_calls_and_emits_keep_none_and_true_alive(qtbot):
    label = QLabel()
    qtbot.addWidget(label)
    emitter = _Emitter()
    none_before, true_before = sys.getrefcount(None), sys.getrefcount(True)
    for _ in range(500):
        label.setText("x")
        emitter.fired.emit()
    # Other code may take or drop a few references meanwhile; a leak would be thousands.
    assert abs(sys.getrefcount(None) - none_before) < 100
    assert abs(sys.getrefcount(True) - true_before) < 100
