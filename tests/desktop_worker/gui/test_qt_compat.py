"""The guard against PySide6 6.12's refcount bug on Python 3.11 (see gui/qt_compat.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from desktop_worker.gui.qt_compat import needs_protection

CALLS = 200_000  # far more void calls and emits than None/True have references on 3.11

SCRIPT = textwrap.dedent(f"""
    import os, sys
    os.environ["QT_QPA_PLATFORM"] = "offscreen"
    from PySide6.QtCore import QObject, Signal
    from PySide6.QtWidgets import QApplication, QLabel
    if sys.argv[1] == "guard":
        from desktop_worker.gui.qt_compat import protect_singletons
        protect_singletons()
    app = QApplication([])
    label = QLabel()
    class Source(QObject):
        fired = Signal(bool)
    source = Source()
    source.fired.connect(lambda value: None)
    for _ in range({CALLS}):
        label.setText("x")  # returns None
        source.fired.emit(True)  # returns True
    print("survived")
""")


def run(mode: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True,
                          timeout=120)


def test_many_qt_calls_survive_with_the_guard():
    result = run("guard")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "survived" in result.stdout


@pytest.mark.skipif(not needs_protection(), reason="None and True are immortal here")
def test_without_the_guard_this_pyside6_aborts():
    """Shows why the guard exists; skips on a PySide6 without the bug (then qt_compat can go)."""
    result = run("bare")
    if result.returncode == 0:
        pytest.skip("this PySide6 keeps None/True alive: qt_compat is no longer needed")
    assert "dealloc" in result.stderr
