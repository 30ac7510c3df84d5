"""The app after a relaunch (issue 35), against a real queen: the wizard's Start Earning makes
the next launch earn by itself; a Stop from the header survives a relaunch, and a Start from the
tray undoes it; the Settings checkbox shows the rule. Whenever it is not earning the header says
why in whole sentences, with the button that fixes it, and the Jobs tab agrees with it."""

from __future__ import annotations

import json

from PySide6.QtWidgets import QWizard

from desktop_worker.gui.services.worker import (
    NO_MODEL_YET,
    NOT_STARTED_AT_LAUNCH,
    OWNER_STOPPED,
    TrayState,
)
from desktop_worker.settings import config_path
from shared_schema import WorkerEarnings
from tests.desktop_worker.gui.conftest import MODEL, open_app, until
from tests.desktop_worker.gui.test_live_state import TINY, add_tiny_model
from tests.support.queen import running_queen


def saved_at_launch() -> bool | None:
    """What settings.json says about starting at launch (None: not said)."""
    return json.loads(config_path().read_text()).get("start_earning_at_launch")


def to_last_page(wizard: QWizard) -> None:
    while wizard.currentPage() is not wizard.ready:
        wizard.button(QWizard.WizardButton.NextButton).click()


async def test_a_relaunch_after_the_wizards_start_earns_by_itself(tmp_path, settings_for, qtbot):
    async with running_queen(tmp_path) as queen:
        async with open_app(settings_for(queen_url=queen.ws_url, first_run_done=False)) as app:
            app.launch()
            wizard = app.wizard
            wizard.model.pick_file = lambda: str(MODEL)  # "Use a .gguf file I already have"
            wizard.model.browse.click()
            to_last_page(wizard)
            wizard.button(QWizard.WizardButton.FinishButton).click()  # Start Earning
            await until(lambda: app.controller.link_state == "connected", 60, "earning")
            [model] = app.models.store.list()
            assert saved_at_launch() is True
            assert app.window.settings.at_launch.isChecked()  # the checkbox shows the rule
        await queen.wait_until(lambda: model.name not in queen.state.registry.model_names(), 10)

        # A reboot: a new app reading only what the last one saved. No wizard, no click.
        relaunch = settings_for(queen_url=queen.ws_url)
        assert relaunch.start_earning_at_launch
        async with open_app(relaunch) as again:
            again.launch()
            assert again.wizard is None
            await queen.wait_until(lambda: model.name in queen.state.registry.model_names(), 30,
                                   "the relaunched worker on the queen")
            await until(lambda: again.controller.state == TrayState.IDLE, 10, "earning")
            assert again.header.toggle.text() == "Stop"


async def test_a_stop_survives_a_relaunch_and_the_trays_start_undoes_it(tmp_path, settings_for,
                                                                        qtbot):
    async with running_queen(tmp_path) as queen:
        async with open_app(settings_for(queen_url=queen.ws_url)) as app:
            add_tiny_model(app, tmp_path)
            app.launch()
            header = app.header
            assert not app.controller.running  # never started: the header says so, and how
            assert header.detail.text() == NOT_STARTED_AT_LAUNCH
            header.toggle.click()  # Start Earning
            await queen.wait_until(lambda: TINY in queen.state.registry.model_names(), 30)
            assert saved_at_launch() is True
            assert app.window.settings.at_launch.isChecked()
            header.toggle.click()  # Stop
            await until(lambda: not app.controller.running, 20, "stopped")
            assert saved_at_launch() is False
            assert not app.window.settings.at_launch.isChecked()
            assert header.detail.text() == OWNER_STOPPED
            assert header.toggle.text() == "Start Earning"  # the button the reason names
            assert not header.fix.isVisibleTo(header)
            assert app.window.settings.message.text() == ""  # nothing left unsaved
        await queen.wait_until(lambda: TINY not in queen.state.registry.model_names(), 10)

        async with open_app(settings_for(queen_url=queen.ws_url)) as again:
            again.launch()
            assert not again.controller.running  # the Stop held
            assert again.controller.link_state == "stopped"
            assert not again.window.settings.at_launch.isChecked()
            assert again.header.detail.text() == NOT_STARTED_AT_LAUNCH
            again.tray.rebuild()
            assert again.tray.actions["toggle"].text() == "Start Earning"
            again.tray.actions["toggle"].trigger()
            await queen.wait_until(lambda: TINY in queen.state.registry.model_names(), 30)
            assert saved_at_launch() is True
            assert again.window.settings.at_launch.isChecked()


async def test_a_start_and_stop_keep_other_unsaved_settings(tmp_path, settings_for, qtbot):
    """The owner is half way through editing Settings when they click Stop: the checkbox
    follows the Stop, and what they typed stays, still unsaved."""
    async with open_app(settings_for()) as app:
        add_tiny_model(app, tmp_path)
        app.launch()
        view = app.window.settings
        view.vram.setValue(4096)
        assert view.message.text() == "Unsaved changes"
        app.header.toggle.click()
        assert view.at_launch.isChecked()
        assert view.vram.value() == 4096
        assert view.message.text() == "Unsaved changes"
        app.header.toggle.click()
        await until(lambda: not app.controller.running, 20, "stopped")
        assert not view.at_launch.isChecked()
        assert view.vram.value() == 4096
        assert app.settings.vram_cap_mb is None  # still not saved
        view.vram.setValue(0)
        assert view.message.text() == ""  # back to what is saved: at_launch included


async def test_no_model_says_so_and_add_a_model_opens_the_models_tab(tmp_path, settings_for,
                                                                     qtbot):
    async with (running_queen(tmp_path) as queen,
                open_app(settings_for(queen_url=queen.ws_url)) as app):
        app.launch()
        header = app.header
        assert header.status.text() == "Not earning"
        assert header.detail.text() == NO_MODEL_YET
        assert header.fix.isVisibleTo(header)
        assert header.fix.text() == "Add a model"
        header.fix.click()
        assert app.window.tabs.currentWidget() is app.window.models
        # The model added, the reason moves on to the next thing to do: Start Earning.
        assert await app.models.import_file(MODEL) is None
        assert header.detail.text() == NOT_STARTED_AT_LAUNCH
        assert not header.fix.isVisibleTo(header)
        header.toggle.click()
        await queen.wait_until(lambda: MODEL.stem in queen.state.registry.model_names(), 30)


async def test_no_queen_at_that_address_offers_to_fix_the_queen_url(tmp_path, settings_for,
                                                                    qtbot):
    """A web server that is no queen's worker address (a typo in the path): retrying cannot
    help, so the fix is the URL, and fixing it in Settings reconnects."""
    async with running_queen(tmp_path) as queen:
        wrong = f"ws://127.0.0.1:{queen.port}/not-the-worker-path"
        async with open_app(settings_for(queen_url=wrong)) as app:
            add_tiny_model(app, tmp_path)
            app.launch()
            app.header.toggle.click()
            header = app.header
            await until(lambda: app.controller.link_state == "disconnected", 30, "refused")
            assert "not an Apiary queen's worker address" in header.detail.reason
            assert header.fix.text() == "Fix the queen URL"
            header.fix.click()
            view = app.window.settings
            assert app.window.tabs.currentWidget() is view
            assert view.queen.selectedText() == app.settings.queen_url  # ready to be typed over
            view.confirm = lambda _title, _text: True
            view.queen.setText(queen.ws_url)
            assert view.apply()
            await queen.wait_until(lambda: TINY in queen.state.registry.model_names(), 30)
            await until(lambda: not header.fix.isVisibleTo(header), 10, "the fix gone")


async def test_the_jobs_tab_agrees_with_the_header(tmp_path, settings_for, qtbot):
    """Sats from an earlier session in the header, none served since the app opened: the Jobs
    tab says exactly that, and points at Start Earning only while not earning."""
    async with open_app(settings_for()) as app:
        add_tiny_model(app, tmp_path)
        app.launch()
        jobs = app.window.jobs
        assert jobs.summary.text().startswith("No jobs yet. Click Start Earning")
        earlier = WorkerEarnings(worker_id="w", jobs_settled=4, escrow_jobs_left=0,
                                 pending_msat=0, available_msat=2334, paid_msat=0,
                                 total_msat=2334, today_msat=2334)
        app.earnings.earnings = earlier
        app.earnings.updated.emit(earlier)
        assert app.header.today.text() == "Today: 2.334 sats"
        assert jobs.summary.text().startswith("No jobs since the app opened; earlier ones are in "
                                              "the Earnings tab.")
        assert "Click Start Earning" in jobs.summary.text()
        app.header.toggle.click()
        assert "Start Earning" not in jobs.summary.text()
        app.controller.stop()
        await until(lambda: not app.controller.running, 20, "stopped")
        assert "Click Start Earning" in jobs.summary.text()
