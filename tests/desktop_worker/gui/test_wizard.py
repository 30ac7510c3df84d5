"""The first-run wizard: payout address (skippable), hardware, a suggested model, Start Earning."""

from __future__ import annotations

from pathlib import Path

import pytest
from PySide6.QtWidgets import QCheckBox, QWizard

from desktop_worker.gui.services.advice import SMOLLM2
from desktop_worker.gui.wizard import FINISH_WITHOUT_STARTING
from desktop_worker.hardware import HardwareReport, NullGpuDetector, SystemInfo, detect_hardware
from desktop_worker.settings import WorkerSettings
from tests.desktop_worker.gui.conftest import open_app, until
from tests.support.hardware_fixtures import FixedSystemProbe
from tests.support.queen import running_queen

pytestmark = pytest.mark.usefixtures("hub_env")


def small_laptop(models_dir: Path) -> HardwareReport:
    info = SystemInfo(cpu_count=4, total_ram_mb=4096, available_ram_mb=1024, disk_free_gb=50)
    return detect_hardware(models_dir, nvidia=NullGpuDetector(), opencl=NullGpuDetector(),
                           system=FixedSystemProbe(info))


def next_page(wizard: QWizard) -> None:
    wizard.button(QWizard.WizardButton.NextButton).click()


async def test_first_run_pulls_the_suggested_model_and_starts_earning(tmp_path, settings_for,
                                                                      hub, qtbot):
    async with running_queen(tmp_path) as queen:
        settings = settings_for(queen_url=queen.ws_url, hf_endpoint=hub.url,
                                first_run_done=False)
        async with open_app(settings, detector=small_laptop) as app:
            app.launch()
            wizard = app.wizard
            assert wizard is not None
            assert wizard.isVisible()
            await until(lambda: app.hardware is not None, 20, "hardware detection")
            # A bad address blocks Next, with the reason; an empty one skips payouts.
            wizard.payout.field.edit.setText("not an address")
            assert not wizard.button(QWizard.WizardButton.NextButton).isEnabled()
            assert wizard.payout.field.verdict.text()
            wizard.payout.field.edit.setText("")
            assert wizard.button(QWizard.WizardButton.NextButton).isEnabled()
            next_page(wizard)
            assert wizard.currentPage() is wizard.queen
            assert wizard.queen.url == queen.ws_url  # the setting's queen, as the default
            next_page(wizard)
            assert "CPU threads" in wizard.hardware.summary.text()
            assert "No GPU found" in wizard.hardware.summary.text()
            next_page(wizard)
            assert wizard.suggestion == SMOLLM2  # no GPU: the small model
            assert wizard.model.chosen_model() == SMOLLM2  # preselected
            next_page(wizard)
            finish = wizard.button(QWizard.WizardButton.FinishButton)
            assert finish.text() == "Start Earning"
            finish.click()
            await until(lambda: SMOLLM2.name in app.models.store, 60, "the model pulled")
            await until(lambda: not wizard.isVisible(), 10, "the wizard closed")
            await until(lambda: app.controller.link_state == "connected", 30, "connected")
            await queen.wait_until(lambda: SMOLLM2.name in queen.state.registry.model_names())
            assert app.tray.state == "idle"
    saved = WorkerSettings(key_path=tmp_path / "key.pem")
    assert saved.first_run_done
    assert saved.ln_url is None


async def test_the_wizard_saves_the_address_and_can_leave_earning_for_later(settings_for, qtbot):
    async with open_app(settings_for(first_run_done=False)) as app:
        app.launch()
        wizard = app.wizard
        wizard.payout.field.edit.setText("alice@getalby.com")
        next_page(wizard)
        next_page(wizard)
        next_page(wizard)
        wizard.model.none.setChecked(True)
        next_page(wizard)
        assert wizard.currentPage() is wizard.ready
        # No "Start earning now" checkbox beside the Start Earning button: Finish starts, and
        # a separate button finishes without starting.
        assert not wizard.ready.findChildren(QCheckBox)
        later = wizard.button(FINISH_WITHOUT_STARTING)
        assert later.isVisible()
        assert later.text() == "Finish without starting"
        later.click()
        await until(lambda: not wizard.isVisible(), 10, "the wizard closed")
        assert app.settings.ln_url == "alice@getalby.com"
        assert app.settings.first_run_done
        assert app.window.settings.payout.edit.text() == "alice@getalby.com"
        assert not app.controller.running
    assert WorkerSettings().ln_url == "alice@getalby.com"


async def test_no_wizard_after_the_first_run(settings_for, qtbot):
    async with open_app(settings_for(first_run_done=True)) as app:
        app.launch()
        assert app.wizard is None
