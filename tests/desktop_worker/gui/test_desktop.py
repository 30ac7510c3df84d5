"""Desktop behaviour: the tray menu, the single-instance guard, closing vs quitting, the
payout address field, and settings that survive a restart."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

from bech32 import bech32_encode, convertbits
from PySide6.QtCore import Qt

from desktop_worker.desktop.autostart import LinuxAutostart
from desktop_worker.desktop.single_instance import SingleInstance
from desktop_worker.settings import WorkerSettings
from tests.desktop_worker.gui.conftest import open_app, until
from tests.support.fake_hub import make_gguf

GOOD = "satoshi@walletofsatoshi.com"


def lnurl(url: str) -> str:
    return bech32_encode("lnurl", convertbits(url.encode(), 8, 5)).upper()


def add_tiny_model(app, tmp_path: Path) -> None:
    app.models.store.import_file(make_gguf(tmp_path / "tiny.gguf", name="tiny"), "tiny")


async def test_tray_menu_actions(settings_for, tmp_path, qtbot):
    async with open_app(settings_for()) as app:  # the queen is unreachable: it keeps trying
        add_tiny_model(app, tmp_path)
        app.launch(show=False)
        tray = app.tray
        assert not app.window.isVisible()
        tray.menu.aboutToShow.emit()  # as when the owner opens the menu
        assert [a.text() for a in tray.menu.actions() if not a.isSeparator()] == [
            "Start Earning", "Open Apiary", "Today: 0 sats", "Quit Apiary"]
        assert not tray.actions["today"].isEnabled()
        assert tray.state == "stopped"
        assert "Not earning" in tray.icon.toolTip()
        assert "Today: 0 sats" in tray.icon.toolTip()

        tray.actions["open"].trigger()
        assert app.window.isVisible()

        tray.actions["toggle"].trigger()
        await until(lambda: app.controller.running, 5, "the worker to start")
        await until(lambda: tray.state == "connecting", 10, "connecting")
        assert "Connecting" in tray.icon.toolTip()
        tray.menu.aboutToShow.emit()
        assert tray.actions["toggle"].text() == "Stop Earning"
        assert app.header.toggle.text() == "Stop"

        tray.actions["toggle"].trigger()
        await until(lambda: not app.controller.running, 20, "the worker to stop")
        assert tray.state == "stopped"
        tray.menu.aboutToShow.emit()
        assert tray.actions["toggle"].text() == "Start Earning"

        # Quit: the app stops earning and its loop's coroutine returns.
        tray.actions["toggle"].trigger()
        await until(lambda: app.controller.running, 5, "the worker to start again")
        finished = asyncio.ensure_future(app.run_until_quit())
        tray.actions["quit"].trigger()
        assert await asyncio.wait_for(finished, 30) == 0
        assert not app.controller.running
        assert not app.window.isVisible()


async def test_an_error_needing_the_owner_shows_in_the_tray(settings_for, qtbot):
    async with open_app(settings_for()) as app:
        app.launch()
        qtbot.mouseClick(app.header.toggle, Qt.MouseButton.LeftButton)  # no model yet
        await until(lambda: app.tray.state == "error", 10, "the error state")
        assert "Needs attention" in app.tray.icon.toolTip()
        assert "add one in the Models tab" in app.header.detail.text()
        [notice] = [n for n in app.tray.notices if n.level == "error"]
        assert "no model to serve" in notice.message
        assert app.header.toggle.text() == "Start Earning"


async def test_closing_the_window_keeps_earning_in_the_tray(settings_for, tmp_path, qtbot):
    async with open_app(settings_for()) as app:
        add_tiny_model(app, tmp_path)
        app.launch()
        app.header.toggle.click()
        await until(lambda: app.controller.running, 5, "the worker to start")
        app.window.close()
        assert not app.window.isVisible()
        assert app.controller.running
        assert [n.title for n in app.tray.notices] == ["Apiary is still running"]
        app.window.close()
        assert len(app.tray.notices) == 1  # said once


async def test_a_second_launch_raises_the_first_window(settings_for, qtbot):
    key = f"apiary-test-{uuid.uuid4().hex[:12]}"
    first = SingleInstance(key)
    second = SingleInstance(key)
    try:
        async with open_app(settings_for()) as app:
            assert first.acquire()
            first.raise_requested.connect(app.raise_requested)
            app.launch(show=False)
            assert not app.window.isVisible()
            assert not second.acquire()
            await until(app.window.isVisible, 10, "the first window to come up")
    finally:
        second.release()
        first.release()


def test_the_payout_field_checks_addresses_live(settings_for, qtbot):
    from desktop_worker.gui.services.settings import SettingsService
    from desktop_worker.gui.views.settings import SettingsView

    view = SettingsView(SettingsService(settings_for()))
    qtbot.addWidget(view)
    field = view.payout
    accepted = {
        GOOD: "valid Lightning address",
        "  Satoshi@WalletOfSatoshi.com ": "valid Lightning address",
        lnurl("https://service.example/lnurlp/alice"): "valid LNURL",
        "": "don't pay me",
    }
    for text, verdict in accepted.items():
        field.edit.setText(text)
        assert field.valid, text
        assert verdict in field.verdict.text()
        assert view.save.isEnabled()
    rejected = {
        "my wallet please": "not a Lightning address",
        "alice@192.168.1.10": "",
        lnurl("http://service.example/lnurlp/alice"): "https",
    }
    for text, reason in rejected.items():
        field.edit.setText(text)
        assert not field.valid, text
        assert field.verdict.text(), text  # the reason is shown
        assert reason in field.verdict.text()
        assert "color: #b91c1c" in field.verdict.styleSheet()
        assert not view.save.isEnabled()
    assert not view.apply()  # nothing is saved with a bad address
    assert "Payout address" in view.message.text()


async def test_settings_survive_a_restart(tmp_path, config_home, qtbot):
    autostart_home = tmp_path / "xdg"
    identity = {"key_path": tmp_path / "key.pem", "key_store": "file"}
    async with open_app(WorkerSettings(**identity),
                        autostart=LinuxAutostart(["apiary-worker"], autostart_home)) as app:
        app.launch()
        view = app.window.settings
        view.queen.setText("wss://queen.example/worker")
        view.payout.edit.setText(GOOD)
        view.models_dir.setText(str(tmp_path / "my models"))
        view.quota.setValue(25.5)
        view.vram.setValue(4096)
        view.threads.setValue(2)
        view.at_launch.setChecked(True)
        view.at_login.setChecked(True)
        qtbot.mouseClick(view.save, Qt.MouseButton.LeftButton)
        assert "Saved" in view.message.text()
        assert app.header.queen.text() == "Queen: wss://queen.example/worker"
        assert app.models.store.root == tmp_path / "my models"
    assert (config_home / "settings.json").is_file()
    assert (autostart_home / "autostart" / "apiary-worker.desktop").is_file()

    # A new app object, reading only what the old one saved.
    restarted = WorkerSettings(**identity)
    assert restarted.queen_url == "wss://queen.example/worker"
    assert restarted.ln_url == GOOD
    assert restarted.models_dir == tmp_path / "my models"
    assert restarted.disk_quota_gb == 25.5
    assert restarted.vram_cap_mb == 4096
    assert restarted.threads == 2
    assert restarted.start_earning_at_launch
    async with open_app(restarted,
                        autostart=LinuxAutostart(["apiary-worker"], autostart_home)) as again:
        view = again.window.settings
        assert view.queen.text() == "wss://queen.example/worker"
        assert view.payout.edit.text() == GOOD
        assert view.quota.value() == 25.5
        assert view.vram.value() == 4096
        assert view.threads.value() == 2
        assert view.at_launch.isChecked()
        assert view.at_login.isChecked()
        view.at_login.setChecked(False)
        assert view.apply()
        assert not (autostart_home / "autostart" / "apiary-worker.desktop").exists()


async def test_a_bad_setting_is_refused_and_nothing_is_saved(settings_for, config_home, qtbot):
    async with open_app(settings_for()) as app:
        view = app.window.settings
        view.queen.setText("")  # refused at Save, with the expected form
        assert not view.apply()
        assert "Queen URL" in view.message.text()
        assert "wss://queen.example.com/worker" in view.message.text()
        view.queen.setText("127.0.0.1:8000")
        view.threads.setValue(0)
        view.vram.setValue(100)  # under the 256 MB minimum
        assert not view.apply()
        assert "vram cap" in view.message.text()
        assert not (config_home / "settings.json").exists()
