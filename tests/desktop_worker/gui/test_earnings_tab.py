"""Earnings in the app from a real queen with a ledger: the Jobs table's sats, the Earnings tab,
the header and the tray's today line."""

from __future__ import annotations

import asyncio

from desktop_worker.gui.units import sats, sats_number
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
        # The earnings explain themselves: the unpaid first job is a row, the threshold and
        # an estimate are shown, and with no payout address there is a nudge (and one notice).
        rows = view.job_rows()
        assert rows[0][1] == ids[1]
        assert rows[0][2] == sats_number(earned)
        assert rows[-1] == ("first job", "proof of work: your first job is unpaid (done)", "0")
        assert app.earnings.pays is True
        assert app.earnings.threshold_msat == 1_000_000
        # This queen has no Lightning backend: its operator pays by hand, and the tab says so.
        assert app.earnings.payout_mode == "manual"
        assert view.terms.text() == "This queen's operator pays by hand: ask them how and when."
        assert view.threshold.text() == (f"You are owed {sats(earnings.available_msat)}. Once "
                                         "you are owed 1,000 sats, the queen asks its operator "
                                         "to pay you, by hand.")
        assert view.eta.text().startswith("At your recent rate you reach 1,000 sats in ")
        assert view.nudge_box.isVisibleTo(view)
        assert "no Lightning payout address" in view.nudge.text()
        waiting = [n for n in app.tray.notices if n.title == "Add a payout address"]
        assert len(waiting) == 1
        view.nudge_button.click()
        assert app.window.tabs.tabText(app.window.tabs.currentIndex()) == "Settings"
        app.settings_service.update(ln_url="worker@wallet.example")
        assert not view.nudge_box.isVisibleTo(view)


async def test_a_queen_that_does_not_pay_says_so(tmp_path, settings_for, qtbot):
    async with (running_queen(tmp_path, auth="open", **SLOW_MACHINE) as queen,
                open_app(settings_for(queen_url=queen.ws_url), earnings_interval_s=3600) as app):
        await asyncio.to_thread(app.models.store.import_file, MODEL, MODEL_NAME)
        app.launch()
        app.header.toggle.click()
        await until(lambda: app.controller.link_state == "connected", 30, "connected")
        await until(lambda: app.earnings.pays is False, 10, "the welcome's terms")
        view = app.window.earnings
        assert app.header.today.text() == "This queen does not pay its workers"
        app.tray.rebuild()  # the tray's menu and tooltip say it too, not "Today: 0 sats"
        assert app.tray.actions["today"].text() == "This queen does not pay its workers"
        assert app.tray.tooltip().endswith("\nThis queen does not pay its workers")
        assert view.not_paying.isVisibleTo(view)
        assert "does not pay its workers" in view.not_paying.text()
        assert not view.figures.isVisibleTo(view)  # no "0 job(s) settled", no zeros
        assert not view.note.isVisibleTo(view)
        await queen.wait_until(lambda: MODEL_NAME in queen.state.registry.model_names(), 10)
        client = queen.client(timeout=120)
        answer = await client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "Name a colour."}],
            max_tokens=8, temperature=0)
        jobs = app.window.jobs
        await until(lambda: jobs.cell(answer.id + ".1", "Sats") == "0", 10, "no '…' forever")
        [first] = [n for n in app.tray.notices if n.title == "First job served"]
        assert "does not pay" in first.message
        assert not [n for n in app.tray.notices if n.title == "Add a payout address"]


async def test_without_a_queen_the_earnings_say_so(settings_for, qtbot):
    async with open_app(settings_for()) as app:
        app.launch()
        view = app.window.earnings
        await until(lambda: "not available" in view.note.text(), 20, "the note")
        assert "cannot reach the queen" in view.note.text()
        assert view.cards["total"].value.text() == "0 sats"
