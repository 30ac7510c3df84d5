"""The smaller controls of issue 35, each against real parts: Retry now reconnects at once to a
queen that came up during a long wait (a real queen process); the tray's Pause and Resume reach
the queen's status, and a new Start is never paused; Settings' Test connection does the real
handshake; an on-chain address gets a plain hint; the Save button stays where it is whatever
the header says; the Settled jobs table shows whole rows, not two and a scrollbar."""

from __future__ import annotations

import asyncio
import random
import time

from PySide6.QtCore import QPoint
from PySide6.QtWidgets import QTableWidgetItem

from desktop_worker.gui.services.worker import TRAY_PAUSE, TrayState
from desktop_worker.gui.views.jobs import SETTLED_ROWS_SHOWN
from desktop_worker.link.backoff import Backoff
from shared_schema.payout_address import ON_CHAIN
from tests.desktop_worker.gui.conftest import open_app, until
from tests.desktop_worker.gui.test_live_state import TINY, add_tiny_model, start_earning
from tests.support.processes import free_port, health, queen_process, running, wait_for
from tests.support.queen import running_queen

LONG_WAIT_S = 120.0  # the backoff's first wait is half to all of this


async def test_retry_now_reconnects_at_once(tmp_path, settings_for, qtbot):
    port = free_port()  # nothing listens yet
    settings = settings_for(queen_url=f"ws://127.0.0.1:{port}/worker")
    backoff = lambda: Backoff(base_s=LONG_WAIT_S, cap_s=LONG_WAIT_S, rng=random.Random(3))  # noqa: E731
    async with open_app(settings, backoff=backoff) as app:
        add_tiny_model(app, tmp_path)
        app.launch()
        app.header.toggle.click()
        header, controller = app.header, app.controller
        await until(lambda: controller.link_state == "disconnected", 30, "the first failure")
        assert header.fix.isVisibleTo(header)
        assert header.fix.text() == "Retry now"
        queen = queen_process(tmp_path, port).start()
        with running(queen):
            await asyncio.to_thread(wait_for, lambda: health(port).get("status") == "ok", 30,
                                    "the queen")
            # The queen is up, but the worker would not try again for a long while yet.
            assert controller.link_state == "disconnected"
            left_s = controller.retry_at - controller.clock()
            assert left_s > 20
            clicked = time.monotonic()
            header.fix.click()
            await until(lambda: controller.link_state == "connected", 20, "connected")
            assert time.monotonic() - clicked < left_s / 2  # far sooner than the wait
            assert not header.fix.isVisibleTo(header)
            assert controller.state == TrayState.IDLE
            await app.controller.stop_and_wait()


async def test_the_trays_pause_and_resume_reach_the_queen(tmp_path, settings_for, qtbot):
    async with (running_queen(tmp_path) as queen,
                open_app(settings_for(queen_url=queen.ws_url)) as app):
        await start_earning(app, queen, tmp_path)
        tray, header = app.tray, app.header

        def worker_paused() -> str | None:
            [worker] = list(queen.state.registry)
            return worker.paused

        tray.rebuild()
        assert tray.actions["pause"].text() == "Pause Earning"
        tray.actions["pause"].trigger()
        await queen.wait_until(lambda: worker_paused() == TRAY_PAUSE, 10, "the queen told")
        assert app.controller.state == TrayState.PAUSED
        assert header.status.text() == "Paused"
        assert header.detail.text() == ("You paused earning from the tray. Click Resume to take "
                                        "jobs again.")
        assert header.fix.text() == "Resume"
        assert "Paused from the tray" in tray.icon.toolTip()
        tray.rebuild()
        assert tray.actions["paused"].text() == "Paused from the tray"
        assert tray.actions["pause"].text() == "Resume Earning"
        tray.actions["pause"].trigger()
        await queen.wait_until(lambda: worker_paused() is None, 10, "the queen told")
        await until(lambda: app.controller.state == TrayState.IDLE, 5, "earning again")
        assert not header.fix.isVisibleTo(header)

        # Paused from the header's own button too, then Stop and Start: the pause was that
        # run's only, so the new run takes jobs.
        tray.rebuild()
        tray.actions["pause"].trigger()
        await queen.wait_until(lambda: worker_paused() == TRAY_PAUSE, 10)
        header.fix.click()  # Resume
        await queen.wait_until(lambda: worker_paused() is None, 10)
        tray.rebuild()
        tray.actions["pause"].trigger()
        await queen.wait_until(lambda: worker_paused() == TRAY_PAUSE, 10)
        tray.rebuild()
        tray.actions["toggle"].trigger()  # Stop Earning
        await queen.wait_until(lambda: TINY not in queen.state.registry.model_names(), 20)
        await until(lambda: not app.controller.running, 20, "stopped")
        tray.rebuild()
        assert "pause" not in tray.actions  # nothing to pause while stopped
        tray.actions["toggle"].trigger()  # Start Earning
        await queen.wait_until(lambda: TINY in queen.state.registry.model_names(), 30)
        await until(lambda: app.controller.state == TrayState.IDLE, 10, "earning, not paused")
        assert worker_paused() is None
        assert app.controller.paused is None


async def test_settings_test_connection_does_the_real_handshake(tmp_path, settings_for, qtbot):
    async with running_queen(tmp_path) as queen, open_app(settings_for()) as app:
        view = app.window.settings
        assert view.test.isVisibleTo(view)
        view.queen.setText(f"127.0.0.1:{queen.port}")  # as an owner types it
        view.payout.edit.setText("alice@getalby.com")
        outcome = await view.test_connection()
        assert outcome is not None
        assert outcome.ok
        assert view.tested.text().startswith("✓ ")
        assert view.tested.isVisibleTo(view)
        # Tested, not saved: the form still says so, and the settings are untouched.
        assert view.message.text() == "Unsaved changes"
        assert app.settings.queen_url == "ws://127.0.0.1:9/worker"
        # A new address: the old verdict goes; nothing listening there is said plainly.
        view.queen.setText(f"127.0.0.1:{free_port()}")
        assert not view.tested.isVisibleTo(view)
        outcome = await view.test_connection()
        assert outcome is not None
        assert not outcome.ok
        assert view.tested.text().startswith("✗ connection refused: nothing is listening at")
        # An address that cannot be read is said without a connection attempt.
        view.queen.setText("ftp://queen.example")
        assert await view.test_connection() is None
        assert view.tested.text().startswith("✗ ")
        # The button's own path: a click runs the test.
        view.queen.setText(queen.ws_url)
        view.test.click()
        await until(lambda: view.tested.text().startswith("✓ "), 20, "the clicked test")


async def test_an_on_chain_address_gets_the_lightning_hint(settings_for, qtbot):
    async with open_app(settings_for()) as app:
        view = app.window.settings
        view.payout.edit.setText("bc1qar0srrr7xfkvy5l643lydnw9re59gtzzwf5mdq")
        assert view.payout.verdict.text() == ON_CHAIN
        assert "Apiary pays over Lightning" in view.payout.verdict.text()
        assert not view.save.isEnabled()
        assert not view.apply()
        assert app.settings.ln_url is None


def save_at(app) -> QPoint:
    """Where the Settings Save button is in the window, after laying the window out now."""
    app.window.centralWidget().layout().activate()
    app.window.settings.layout().activate()
    save = app.window.settings.save
    return save.mapTo(app.window, QPoint(0, 0))


async def test_the_save_button_stays_put_when_the_header_grows(settings_for, qtbot):
    async with open_app(settings_for()) as app:
        app.launch()
        app.window.show_tab("Settings")
        header = app.header
        before = (save_at(app), app.window.size(), header.height())
        long_reason = " ".join(
            f"Sentence {n} of a reason from the queen that goes on and on about it." for n in
            range(12))
        header.show_problem(long_reason, "retry_download")  # the fix button appears too
        header.show_queen("wss://" + "very-long-name." * 20 + "example/worker")
        header.show_today(123_456_789_000)
        assert (save_at(app), app.window.size(), header.height()) == before
        # The reason was fitted, not cut inside a sentence, and the whole of it is in reach.
        shown = header.detail.text()
        assert shown.endswith("…")
        assert long_reason.startswith(shown.removesuffix("…").strip())
        assert shown.removesuffix("…").strip().endswith(".")
        assert header.detail.toolTip() == long_reason
        assert header.queen.toolTip().startswith("Queen: wss://very-long-name.")
        # A reason the size of today's longest ones is shown whole.
        whole = ("Start was skipped: The model download failed: could not reach 127.0.0.1: "
                 "check your internet connection, then retry.")
        header.show_problem(whole, "retry_download")
        assert header.detail.text() == whole
        assert header.detail.toolTip() == ""
        assert save_at(app) == before[0]


async def test_the_settled_jobs_table_shows_whole_rows(settings_for, qtbot):
    """Everything the Earnings tab can show at once (the nudge, the estimate, the audit line,
    a note) at the window's smallest: the Settled jobs table still shows its rows."""
    async with open_app(settings_for()) as app:
        app.launch()
        view = app.window.earnings
        app.window.show_tab("Earnings")
        for label in (view.nudge_box, view.audit, view.threshold, view.eta, view.note):
            label.setVisible(True)
        view.note.setText("Earnings not available right now: the queen is restarting.")
        table = view.jobs
        table.setRowCount(20)
        for row in range(20):
            table.setItem(row, 0, QTableWidgetItem(f"row {row}"))
        app.window.resize(app.window.minimumSizeHint())
        app.window.centralWidget().layout().activate()
        app.window.tabs.currentWidget().layout().activate()
        shown = table.viewport().height() // table.rowHeight(0)
        assert shown >= SETTLED_ROWS_SHOWN
