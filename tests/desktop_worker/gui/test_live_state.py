"""Settings that apply live (a second real queen), "Unsaved changes", "Restart now"; the
connection state's reason and live countdown; a header that keeps its height; folded logs and
warnings said once per run; a RAM bar that shows what its label says."""

from __future__ import annotations

import logging
import random
import socket
from pathlib import Path

from desktop_worker.gui.services.logs import Append, LogFolder, OncePerRun, RemoveLast
from desktop_worker.gui.services.worker import TrayState, countdown_text, reconnect_delay
from desktop_worker.gui.views.hardware import HardwareView, ram_bar_values
from desktop_worker.hardware import NullGpuDetector, SystemInfo, detect_hardware
from desktop_worker.identity import WorkerIdentity
from desktop_worker.link.backoff import Backoff
from tests.desktop_worker.gui.conftest import open_app, until
from tests.support.fake_hub import make_gguf
from tests.support.hardware_fixtures import FixedSystemProbe
from tests.support.queen import running_queen

TINY = "tiny"


def add_tiny_model(app, tmp_path: Path) -> None:
    app.models.store.import_file(make_gguf(tmp_path / "tiny.gguf", name=TINY), TINY)


async def start_earning(app, queen, tmp_path: Path) -> None:
    """Give the app the tiny model, launch it, start earning, and wait until the queen routes
    the model to it and the app says it is earning."""
    add_tiny_model(app, tmp_path)
    app.launch()
    app.controller.start()
    await queen.wait_until(lambda: TINY in queen.state.registry.model_names(), 30)
    await until(lambda: app.controller.state == TrayState.IDLE, 10, "earning")


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --- settings that apply live ------------------------------------------------------------------


async def test_a_new_queen_applies_live_after_a_confirmation(tmp_path, settings_for, qtbot):
    async with (running_queen(tmp_path / "a") as first, running_queen(tmp_path / "b") as second,
                open_app(settings_for(queen_url=first.ws_url)) as app):
        add_tiny_model(app, tmp_path)
        app.launch()
        app.controller.start()
        await first.wait_until(lambda: TINY in first.state.registry.model_names(), 30)
        view = app.window.settings
        asked: list[str] = []

        # Declined: nothing is saved and the worker stays where it is.
        view.confirm = lambda title, text: asked.append(text) is not None and False
        view.queen.setText(f"http://127.0.0.1:{second.port}/")
        assert view.message.text() == "Unsaved changes"
        assert not view.apply()
        assert app.settings.queen_url == first.ws_url
        assert "Unsaved changes" in view.message.text()
        assert "reconnect" in asked[0]

        # Accepted: saved, normalised, and the worker moves to the second queen now.
        view.confirm = lambda title, text: True
        assert view.apply()
        assert app.settings.queen_url == second.ws_url
        assert view.queen.text() == second.ws_url
        assert "Reconnecting" in view.message.text()
        await second.wait_until(lambda: TINY in second.state.registry.model_names(), 30,
                                "the worker on the second queen")
        await first.wait_until(lambda: TINY not in first.state.registry.model_names(), 10)
        assert app.header.queen.text() == f"Queen: {second.ws_url}"
        await until(lambda: app.controller.link_state == "connected", 10, "connected")


async def test_other_settings_say_they_apply_at_restart_with_a_button(tmp_path, settings_for,
                                                                      qtbot):
    async with (running_queen(tmp_path) as queen,
                open_app(settings_for(queen_url=queen.ws_url)) as app):
        add_tiny_model(app, tmp_path)
        app.launch()
        app.controller.start()
        await until(lambda: app.controller.link_state == "connected", 30, "connected")
        view = app.window.settings
        view.confirm = lambda title, text: (_ for _ in ()).throw(AssertionError("asked"))
        view.threads.setValue(1)
        assert view.apply()
        assert "applies when you restart earning" in view.message.text()
        assert view.restart.isVisibleTo(view)
        starts: list[bool] = []
        app.controller.running_changed.connect(starts.append)
        view.restart.click()
        await until(lambda: starts[-2:] == [False, True], 30, "stopped and started again")
        await until(lambda: app.controller.link_state == "connected", 30, "connected again")
        assert app.controller.service.settings.threads == 1
        assert not view.restart.isVisibleTo(view)


async def test_saved_does_not_stay_green_while_edits_are_typed(settings_for, qtbot):
    async with open_app(settings_for()) as app:
        view = app.window.settings
        view.payout.edit.setText("satoshi@walletofsatoshi.com")
        assert view.message.text() == "Unsaved changes"
        assert view.apply()
        assert view.message.text() == "Saved."
        view.threads.setValue(3)
        assert view.message.text() == "Unsaved changes"
        assert "166534" not in view.message.styleSheet()  # not the green of "Saved."
        view.threads.setValue(0)  # back to what is saved
        assert view.message.text() == ""
        view.queen.setText("ftp://nope")
        assert not view.apply()
        assert "Queen URL" in view.message.text()
        assert app.settings.queen_url == "ws://127.0.0.1:9/worker"  # nothing saved


# --- the connection state --------------------------------------------------------------------


def test_countdown_text_ticks_down_and_never_shows_zero():
    reason = "connection refused: nothing is listening at 127.0.0.1:9"
    assert countdown_text(reason, 112.0, 100.0) == (
        f"Cannot reach the queen: {reason}. Retrying in 12 s…")
    assert countdown_text(reason, 112.0, 100.5).endswith("Retrying in 12 s…")
    assert countdown_text(reason, 112.0, 101.0).endswith("Retrying in 11 s…")
    assert countdown_text(reason, 112.0, 111.9).endswith("Retrying in 1 s…")
    assert countdown_text(reason, 112.0, 112.0).endswith("Retrying now…")
    assert countdown_text(reason, None, 0) == f"Cannot reach the queen: {reason}."
    assert reconnect_delay("reconnecting in 12.9 s") == 12.9
    assert reconnect_delay("worker id abc") is None


async def test_the_header_counts_down_with_the_reason(tmp_path, settings_for, qtbot):
    port = closed_port()
    settings = settings_for(queen_url=f"ws://127.0.0.1:{port}/worker")
    # Long, fixed waits: the countdown has seconds to tick through before the next attempt.
    async with open_app(settings, backoff=lambda: Backoff(base_s=20, rng=random.Random(7))
                        ) as app:
        add_tiny_model(app, tmp_path)
        app.launch()
        app.controller.start()
        header = app.header
        await until(lambda: app.controller.link_state == "disconnected", 30, "the first failure")
        first = header.detail.text()
        assert first.startswith(f"Cannot reach the queen: connection refused: nothing is "
                                f"listening at 127.0.0.1:{port}. Retrying in ")
        await until(lambda: header.detail.text() != first, 5, "the countdown to tick")
        assert app.controller.link_state == "disconnected"  # the same wait, counted down
        seconds = [int(text.rsplit("Retrying in ", 1)[1].split()[0])
                   for text in (first, header.detail.text())]
        assert seconds[1] == seconds[0] - 1
        assert "Connecting" in header.status.text()
        assert "refused" in app.tray.icon.toolTip() or app.tray.state == "connecting"


async def test_the_header_keeps_its_height_when_the_worker_id_appears(settings_for, qtbot):
    async with open_app(settings_for()) as app:
        app.window.show()
        header = app.header
        before = header.sizeHint().height()
        app.controller.state_changed.emit("idle", "worker id 3f9a2c71")
        assert header.detail.text() == "worker id 3f9a2c71"
        assert header.sizeHint().height() == before
        app.controller.state_changed.emit("stopped", "")
        assert header.sizeHint().height() == before


# --- logs --------------------------------------------------------------------------------------


def shown(edits_by_line: list[list]) -> list[str]:
    lines: list[str] = []
    for edits in edits_by_line:
        for edit in edits:
            if isinstance(edit, Append):
                lines.append(edit.text)
            else:
                assert isinstance(edit, RemoveLast)
                del lines[len(lines) - edit.count:]
    return lines


def test_identical_lines_fold_into_a_counter():
    folder = LogFolder()
    assert shown([folder.feed("gpu", "no NVIDIA GPU") for _ in range(27)]) == [
        "no NVIDIA GPU", "… repeated 26 times"]


def test_a_repeating_pair_folds_and_other_lines_stay():
    folder = LogFolder()
    keys = ["start", *["refused", "retry"] * 4, "connected", "refused", "x"]
    assert shown([folder.feed(k, k) for k in keys]) == [
        "start", "refused", "retry", "… the last 2 lines repeated 3 times", "connected",
        "refused", "x"]


def test_a_broken_group_keeps_every_line():
    folder = LogFolder()
    keys = ["a", "b", "c", "a", "d", "a", "b"]
    assert shown([folder.feed(k, k) for k in keys]) == keys


async def test_the_logs_tab_folds_repeats_and_says_the_keyring_warning_once(
        tmp_path, settings_for, qtbot):
    async with open_app(settings_for()) as app:
        logs = app.window.logs
        logs.clear()
        probe = logging.getLogger("desktop_worker.gui.test")
        for _ in range(27):
            probe.info("no NVIDIA GPU: no NVIDIA driver")
        probe.info("something else")
        lines = logs.lines()
        assert len(lines) == 3
        assert lines[0].endswith("no NVIDIA GPU: no NVIDIA driver")
        assert lines[1] == "… repeated 26 times"
        assert lines[2].endswith("something else")
        # The keyring warning comes at every Start (a key loaded per run): said once.
        logs.clear()
        for _ in range(3):
            WorkerIdentity.load_or_create(tmp_path / "auto-key.pem", key_store="auto")
        warnings = [line for line in logs.lines() if "keyring cannot hold" in line]
        assert len(warnings) == 1


def test_once_per_run_filter():
    once = OncePerRun()
    record = logging.LogRecord("x", logging.WARNING, __file__, 1, "keyring %s", ("down",), None)
    assert once.filter(record)
    assert not once.filter(record)
    other = logging.LogRecord("x", logging.WARNING, __file__, 1, "keyring %s", ("up",), None)
    assert once.filter(other)


# --- the RAM bar ---------------------------------------------------------------------------------


def test_the_ram_bar_fills_with_what_is_used_and_says_so(tmp_path, qtbot):
    assert ram_bar_values(24_105, 23_176) == (929, 24_105,
                                              "929 MB used of 24,105 MB (23,176 MB free)")
    info = SystemInfo(cpu_count=2, total_ram_mb=24_105, available_ram_mb=23_176,
                      disk_free_gb=50)
    report = detect_hardware(tmp_path, nvidia=NullGpuDetector(), opencl=NullGpuDetector(),
                             system=FixedSystemProbe(info))
    view = HardwareView()
    qtbot.addWidget(view)
    view.show_report(report)
    assert view.ram is not None
    assert view.ram.value() == 24_105 - 23_176  # the fill is the memory in use…
    assert view.ram.maximum() == 24_105
    assert view.ram.text().startswith("929 MB used of 24,105 MB")  # …and the label says so
