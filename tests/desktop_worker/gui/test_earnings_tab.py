"""Earnings in the app from a real queen with a ledger: the Jobs table's sats, the Earnings tab,
the header and the tray's today line."""

from __future__ import annotations

import asyncio

from desktop_worker.gui.common import sats, sats_number
from tests.desktop_worker.gui.conftest import MODEL, MODEL_NAME, open_app, until
from tests.queen_server.billing.test_billing_api import funded_key
from tests.support.queen import running_queen

SLOW_MACHINE = {"first_token_timeout_s": 60.0, "total_timeout_s": 120.0}


async def test_jobs_show_what_they_earned(tmp_path, settings_for, qtbot):
    async with (running_queen(tmp_path, auth="keys", escrow_jobs=0, **SLOW_MACHINE) as queen,
                open_app(settings_for(queen_url=queen.ws_url), earnings_interval_s=3600) as app):
        await asyncio.to_thread(app.models.store.import_file, MODEL, MODEL_NAME)
        app.launch()
        app.header.toggle.click()
        await until(lambda: app.controller.link_state == "connected", 30, "connected")
        await queen.wait_until(lambda: MODEL_NAME in queen.state.registry.model_names(), 10)
        secret, _ = await funded_key(queen, 10)
        client = queen.client(api_key=secret, timeout=120)
        ids = []
        for prompt in ("Name a colour.", "Name a fruit."):
            answer = await client.chat.completions.create(
                model=MODEL_NAME, messages=[{"role": "user", "content": prompt}], max_tokens=16,
                temperature=0)
            ids.append(answer.id)
        jobs = app.window.jobs
        # Each finished job pokes the poller; the second job (the first is unpaid) gets sats.
        # The queen commits its ledger in groups, so read until it shows both settled jobs.
        async with asyncio.timeout(20):
            while app.earnings.earnings.jobs_settled < 2 or not app.earnings.job_msat:
                await app.earnings.refresh()
                await asyncio.sleep(0.1)
        await until(lambda: jobs.cell(ids[1] + ".1", "Sats") not in ("…", ""), 10, "the sats")
        earned = app.earnings.earned_for(ids[1] + ".1")
        assert earned > 0
        assert jobs.cell(ids[1] + ".1", "Sats") == sats_number(earned)
        assert jobs.cell(ids[0] + ".1", "Sats") == "0"  # a new worker's first job is unpaid
        earnings = app.earnings.earnings
        assert earnings.today_msat == earned
        view = app.window.earnings
        assert view.cards["today"].value.text() == sats(earned)
        assert view.cards["week"].value.text() == sats(earned)
        assert view.cards["available"].value.text() == sats(earnings.available_msat)
        assert not view.note.isVisibleTo(view)
        assert view.chart.days[-1][1] == earned / 1000
        assert app.header.today.text() == f"Today: {sats(earned)}"
        app.tray.menu.aboutToShow.emit()
        assert app.tray.actions["today"].text() == f"Today: {sats(earned)}"
        assert sats(earned) in app.tray.icon.toolTip()


async def test_without_a_queen_the_earnings_say_so(settings_for, qtbot):
    async with open_app(settings_for()) as app:
        app.launch()
        view = app.window.earnings
        await until(lambda: "not available" in view.note.text(), 20, "the note")
        assert "cannot reach the queen" in view.note.text()
        assert view.cards["total"].value.text() == "0 sats"
