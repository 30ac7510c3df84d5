"""Cyclic garbage is collected on the GUI thread only while the app runs: a worker thread that
allocates never runs a collection (which could free a Qt object on the wrong thread)."""

from __future__ import annotations

import gc
import threading
import weakref

from desktop_worker.gui.gui_gc import GuiThreadCollector


class Cycle:
    def __init__(self) -> None:
        self.me = self


def test_collections_happen_on_the_gui_thread_only(qtbot) -> None:
    threads: list[str] = []

    def record(phase: str, _info: dict) -> None:
        if phase == "start":
            threads.append(threading.current_thread().name)

    was_enabled = gc.isenabled()  # the GUI tests' own collector may have turned it off
    collector = GuiThreadCollector(interval_ms=10)
    gc.callbacks.append(record)
    collector.start()
    try:
        assert not gc.isenabled()

        def allocate() -> None:  # far past generation 0's threshold, in cycles
            for _ in range(50_000):
                Cycle()

        worker = threading.Thread(target=allocate, name="store-import")
        worker.start()
        worker.join()
        assert "store-import" not in threads  # no collection ran on the worker thread
        garbage = Cycle()
        gone = weakref.ref(garbage)
        del garbage
        qtbot.waitUntil(lambda: gone() is None, timeout=5000)  # the timer collected it
        assert set(threads) == {threading.main_thread().name}
    finally:
        collector.stop()
        gc.callbacks.remove(record)
    assert gc.isenabled() == was_enabled  # given back as it was


def test_check_collects_the_oldest_generation_past_its_threshold() -> None:
    collector = GuiThreadCollector()
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()  # as ``start`` does: only ``check`` collects
    try:
        assert collector.check() is None  # nothing past a threshold right after a collection
        kept = [Cycle() for _ in range(gc.get_threshold()[0] + 10)]
        assert collector.check() == 0
        assert gc.get_count()[0] < gc.get_threshold()[0]
        del kept
    finally:
        if was_enabled:
            gc.enable()
