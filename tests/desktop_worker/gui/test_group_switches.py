"""The Settings tab's model-group switches (issue 19): "Help run big models with other workers"
(``join_groups``) and "Let workers on my home network connect directly" (``lan_groups``) save
to settings.json and come back from it; the second is greyed out while the first is off; both
say they apply when earning restarts; a build whose llama.cpp has no RPC backend shows them
greyed out with the reason (in plain text, whatever the reason holds), in a view and in the app
(the probe at launch), and what is saved stays as it was."""

from __future__ import annotations

import json

from PySide6.QtCore import Qt

from desktop_worker.groups.rpc import Device, NullRpc, RpcProbe
from desktop_worker.gui.services.settings import SettingsService
from desktop_worker.gui.views.settings import JOIN_LABEL, LAN_LABEL, SettingsView
from desktop_worker.settings import WorkerSettings, config_path
from tests.desktop_worker.gui.conftest import open_app, until

NO_RPC = "llama.cpp was built without its RPC backend"


class AvailableRpc:
    """A build with the RPC backend, without loading llama.cpp."""

    def __init__(self) -> None:
        self.probes = 0

    def probe(self) -> RpcProbe:
        self.probes += 1
        return RpcProbe(True, "ggml-test/rpc-7.0.0")

    def devices(self) -> list[Device]:
        return []  # none usable: a hello would name none


class BrokenRpc:
    def probe(self) -> RpcProbe:
        raise RuntimeError("the probe itself broke")


def view_for(settings: WorkerSettings, qtbot, **kwargs) -> SettingsView:
    view = SettingsView(SettingsService(settings), **kwargs)
    qtbot.addWidget(view)
    return view


def test_the_switches_read_plainly_and_start_from_the_defaults(settings_for, qtbot) -> None:
    view = view_for(settings_for(), qtbot)
    assert view.join_groups.text() == JOIN_LABEL == "Help run big models with other workers"
    assert view.lan_groups.text() == LAN_LABEL
    assert view.join_groups.isChecked()  # join_groups defaults to on
    assert not view.lan_groups.isChecked()  # lan_groups to off
    assert view.lan_groups.isEnabled()
    note = view.join_note.text()
    assert "part of a large model" in note
    assert "no requests of its own" in note
    assert "paid for the share" in note
    assert "firewall" in view.lan_note.text()
    assert view.groups_reason.isHidden()


def test_the_switches_save_and_come_back_from_settings_json(settings_for, qtbot) -> None:
    view = view_for(settings_for(), qtbot)
    view.lan_groups.setChecked(True)
    assert view.message.text() == "Unsaved changes"
    assert view.apply()
    saved = json.loads(config_path().read_text())
    assert saved["join_groups"] is True
    assert saved["lan_groups"] is True
    assert view.message.text() == "Saved."

    # What a new start reads (settings.json under the test's config dir), in a fresh view.
    reread = WorkerSettings(models_dir=settings_for().models_dir)
    assert reread.join_groups
    assert reread.lan_groups
    again = view_for(reread, qtbot)
    assert again.join_groups.isChecked()
    assert again.lan_groups.isChecked()

    view.join_groups.setChecked(False)
    assert view.apply()
    saved = json.loads(config_path().read_text())
    assert saved["join_groups"] is False
    reread = WorkerSettings(models_dir=settings_for().models_dir)
    assert not reread.join_groups
    assert not view_for(reread, qtbot).join_groups.isChecked()


def test_the_lan_switch_is_greyed_out_while_groups_are_off(settings_for, qtbot) -> None:
    view = view_for(settings_for(join_groups=False, lan_groups=True), qtbot)
    assert not view.join_groups.isChecked()
    assert not view.lan_groups.isEnabled()  # loaded off: greyed out at once
    assert view.lan_groups.isChecked()  # what is saved is still shown
    view.join_groups.setChecked(True)
    assert view.lan_groups.isEnabled()
    view.join_groups.setChecked(False)
    assert not view.lan_groups.isEnabled()
    assert not view.lan_note.isEnabled()


def test_the_switches_say_they_apply_when_earning_restarts(settings_for, qtbot) -> None:
    view = view_for(settings_for(), qtbot, earning=lambda: True)
    view.join_groups.setChecked(False)
    assert view.apply()
    assert "helping run big models" in view.message.text()
    assert "applies when you restart earning" in view.message.text()
    assert not view.restart.isHidden()
    view.join_groups.setChecked(True)
    view.lan_groups.setChecked(True)
    assert view.apply()
    assert "direct connections on your home network" in view.message.text()


def test_without_rpc_both_are_greyed_out_with_the_reason(settings_for, qtbot) -> None:
    view = view_for(settings_for(lan_groups=True), qtbot)
    view.show_rpc(NullRpc().probe())
    assert not view.join_groups.isEnabled()
    assert not view.lan_groups.isEnabled()
    assert not view.groups_reason.isHidden()
    assert view.groups_reason.text() == f"This build cannot join groups ({NO_RPC})."
    # Saving anything else keeps what is saved for groups as it was.
    view.fullscreen.setChecked(True)
    assert view.apply()
    saved = json.loads(config_path().read_text())
    assert saved["join_groups"] is True
    assert saved["lan_groups"] is True
    # Reloading the saved settings keeps them greyed out.
    view.load(view.service.settings)
    assert not view.join_groups.isEnabled()
    assert not view.lan_groups.isEnabled()
    # A build that can (a second probe): usable again, no reason.
    view.show_rpc(RpcProbe(True, "ggml-x/rpc-7.0.0"))
    assert view.join_groups.isEnabled()
    assert view.lan_groups.isEnabled()
    assert view.groups_reason.isHidden()


def test_a_reason_with_markup_shows_literally(settings_for, qtbot) -> None:
    hostile = '<b>no</b><img src="http://127.0.0.1:9/t.png">'
    view = view_for(settings_for(), qtbot)
    view.show_rpc(RpcProbe(False, None, hostile))
    assert view.groups_reason.textFormat() == Qt.TextFormat.PlainText
    assert view.groups_reason.text() == f"This build cannot join groups ({hostile})."
    view.show_rpc(RpcProbe(False, None, "   "))
    assert view.groups_reason.text() == "This build cannot join groups."


async def test_the_app_probes_at_launch_and_greys_out_without_rpc(settings_for, qtbot) -> None:
    async with open_app(settings_for(), rpc=NullRpc()) as app:
        view = app.window.settings
        assert view.join_groups.isEnabled()  # not known yet: usable
        app.launch(show=False)
        await until(lambda: not view.groups_reason.isHidden(), 10, "the probe's answer")
        assert NO_RPC in view.groups_reason.text()
        assert not view.join_groups.isEnabled()
        assert app.controller.rpc is app.rpc  # each run's worker asks the same backend


async def test_the_app_keeps_the_switches_with_rpc_or_a_broken_probe(settings_for,
                                                                     qtbot) -> None:
    rpc = AvailableRpc()
    async with open_app(settings_for(), rpc=rpc) as app:
        app.launch(show=False)
        assert app._rpc_check is not None
        probe = await app._rpc_check
        assert probe is not None
        assert probe.available
        assert rpc.probes == 1
        view = app.window.settings
        assert view.join_groups.isEnabled()
        assert view.groups_reason.isHidden()
    async with open_app(settings_for(), rpc=BrokenRpc()) as app:
        app.launch(show=False)
        assert app._rpc_check is not None
        assert await app._rpc_check is None  # logged; the app goes on
        assert app.window.settings.join_groups.isEnabled()


def test_only_my_own_machines_saves_a_family_code_and_refuses_a_guessable_one(settings_for,
                                                                             qtbot) -> None:
    """Issue 34: "Only with my own machines" with New code saves the code (the same code goes
    on each of the owner's machines); a short code is refused, saying why, and nothing saved."""
    view = view_for(settings_for(), qtbot)
    assert not view.family_only.isChecked()
    assert not view.family_code.isEnabled()  # nothing to type until the switch is on
    view.family_only.setChecked(True)
    assert view.family_code.isEnabled()
    view.family_code.setText("our-rigs")
    assert not view.apply()
    assert "at least 16" in view.message.text()
    view.new_family.click()
    code = view.family_code.text()
    assert len(code) == 29
    assert view.apply()
    assert json.loads(config_path().read_text())["group_family"] == code
    again = view_for(WorkerSettings(models_dir=settings_for().models_dir), qtbot)
    assert again.family_only.isChecked()
    assert again.family_code.text() == code
    again.family_only.setChecked(False)
    assert again.apply()
    assert json.loads(config_path().read_text())["group_family"] is None
