"""The owner's pause in the app (issue 17): a real worker on a real queen paused through
``WorkerService.pause`` shows "Paused" and why in the header (violet) and the tray (icon,
tooltip, menu), and goes back on resume; the Settings tab's "When to pause" and "Models"
groups save, validate active hours as the owner types, and say they apply at restart."""

from __future__ import annotations

import json

import pytest

from desktop_worker.errors import WorkerError
from desktop_worker.gui.services.settings import SettingsService
from desktop_worker.gui.services.worker import TrayState
from desktop_worker.gui.views.settings import SettingsView
from desktop_worker.gui.window import PAUSED_STYLE
from desktop_worker.settings import config_path
from tests.desktop_worker.gui.conftest import open_app, until
from tests.desktop_worker.gui.test_live_state import start_earning
from tests.support.queen import running_queen


async def test_a_pause_shows_why_in_the_header_and_the_tray(tmp_path, settings_for, qtbot):
    async with (running_queen(tmp_path) as queen,
                open_app(settings_for(queen_url=queen.ws_url)) as app):
        await start_earning(app, queen, tmp_path)
        header, tray = app.header, app.tray

        app.controller.service.pause("on battery")
        await until(lambda: app.controller.state == TrayState.PAUSED, 5, "paused")
        assert header.status.text() == "Paused"
        assert header.detail.text().startswith("Paused: on battery.")
        assert header.detail.styleSheet() == PAUSED_STYLE
        assert tray.state == "paused"
        assert "Paused: on battery" in tray.icon.toolTip()
        tray.rebuild()
        assert tray.actions["paused"].text() == "Paused: on battery"
        assert not tray.actions["paused"].isEnabled()
        assert tray.icon.icon().cacheKey() == app.icons.state("paused").cacheKey()
        assert app.icons.state("paused").cacheKey() != app.icons.state("error").cacheKey()

        # A new reason replaces the old one everywhere.
        app.controller.service.pause("another program is using the GPU (87% of its memory)")
        await until(lambda: "87%" in header.detail.text(), 5, "the new reason")
        assert "87% of its memory" in tray.icon.toolTip()

        app.controller.service.resume()
        await until(lambda: app.controller.state == TrayState.IDLE, 5, "earning again")
        assert header.status.text() == "Earning: waiting for jobs"
        assert "Paused" not in header.detail.text()
        assert header.detail.styleSheet() != PAUSED_STYLE
        assert "Paused" not in tray.icon.toolTip()
        tray.rebuild()
        assert "paused" not in tray.actions


def test_the_pause_and_models_settings_save(settings_for, qtbot) -> None:
    service = SettingsService(settings_for())
    view = SettingsView(service)
    qtbot.addWidget(view)
    assert view.on_battery.isChecked()  # the default: pause on battery
    assert view.gpu_busy.text() == "never"
    assert view.accept_fetch.isChecked()
    assert not view.swarm_models.isChecked()

    view.on_battery.setChecked(False)
    view.gpu_busy.setValue(40)
    view.fullscreen.setChecked(True)
    view.hours.edit.setText("22:00-07:00")
    view.swarm_models.setChecked(True)
    view.accept_fetch.setChecked(False)
    assert view.message.text() == "Unsaved changes"
    assert view.apply()

    saved = json.loads(config_path().read_text())
    assert saved["pause_on_battery"] is False
    assert saved["pause_gpu_busy_pct"] == 40
    assert saved["pause_fullscreen"] is True
    assert saved["active_hours"] == "22:00-07:00"
    assert saved["swarm_models"] is True
    assert saved["accept_fetch"] is False
    assert service.settings.pause_gpu_busy_pct == 40
    assert view.message.text() == "Saved."

    # Back to "never" and "always": saved as null.
    view.gpu_busy.setValue(0)
    view.hours.edit.setText("   ")
    assert view.apply()
    saved = json.loads(config_path().read_text())
    assert saved["pause_gpu_busy_pct"] is None
    assert saved["active_hours"] is None


def test_active_hours_are_checked_as_the_owner_types(settings_for, qtbot) -> None:
    service = SettingsService(settings_for())
    view = SettingsView(service)
    qtbot.addWidget(view)
    view.hours.edit.setText("22:00-07")
    assert not view.hours.valid
    assert "is not a range of hours" in view.hours.verdict.text()
    assert not view.save.isEnabled()
    assert not view.apply()
    assert view.message.text().startswith("Active hours:")
    assert service.settings.active_hours is None  # nothing saved
    view.hours.edit.setText("22:00-07:00")
    assert view.hours.valid
    assert view.save.isEnabled()
    assert view.hours.verdict.text().startswith("✓")
    # A bad payout address keeps Save off even when the hours are fine.
    view.payout.edit.setText("not an address")
    assert not view.save.isEnabled()


def test_garbage_hours_from_settings_json_show_as_a_problem(settings_for, qtbot) -> None:
    """Hours edited by hand into settings.json that the rules cannot read: the form shows why
    and will not save them back; the service refuses them too."""
    service = SettingsService(settings_for(active_hours="nine to five"))
    view = SettingsView(service)
    qtbot.addWidget(view)
    assert view.hours.edit.text() == "nine to five"
    assert not view.hours.valid
    assert not view.save.isEnabled()
    with pytest.raises(WorkerError, match="Active hours:"):
        service.update(active_hours="25:00-26:00")
    assert json.loads(config_path().read_text() if config_path().exists() else "{}"
                      ).get("active_hours") is None


def test_pause_settings_say_they_apply_when_earning_restarts(settings_for, qtbot) -> None:
    service = SettingsService(settings_for())
    view = SettingsView(service, earning=lambda: True)
    qtbot.addWidget(view)
    view.fullscreen.setChecked(True)
    view.swarm_models.setChecked(True)
    assert view.apply()
    assert "pausing for full-screen apps" in view.message.text()
    assert "models chosen by the swarm" in view.message.text()
    assert not view.restart.isHidden()
