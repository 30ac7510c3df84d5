"""The owner's "Make images" switch (issue 38, ``images``): off by default in Settings and in
the wizard; ticked in either it is saved to settings.json, read back, and the next hello offers
``image`` (when the image engine is installed, as here)."""

from __future__ import annotations

import json

import pytest
from PySide6.QtWidgets import QWizard

from desktop_worker.gui.services.settings import SettingsService
from desktop_worker.gui.views.settings import IMAGES_LABEL, SettingsView
from desktop_worker.gui.wizard import FINISH_WITHOUT_STARTING
from desktop_worker.service import image_engine_installed, worker_capabilities
from desktop_worker.settings import WorkerSettings, config_path
from tests.desktop_worker.gui.conftest import open_app, until
from tests.desktop_worker.gui.test_disk_settings import eighty_gb_free


def test_the_images_switch_saves_comes_back_and_reaches_the_hello(settings_for, qtbot) -> None:
    assert image_engine_installed()
    view = SettingsView(SettingsService(settings_for()))
    qtbot.addWidget(view)
    assert view.images.text() == IMAGES_LABEL
    assert not view.images.isChecked()  # the owner opts in
    assert "image" not in worker_capabilities(settings_for())
    view.images.setChecked(True)
    assert view.message.text() == "Unsaved changes"
    assert view.apply()
    assert json.loads(config_path().read_text())["images"] is True
    reread = WorkerSettings(models_dir=settings_for().models_dir)
    assert reread.images
    assert "image" in worker_capabilities(reread)
    again = SettingsView(SettingsService(reread))
    qtbot.addWidget(again)
    assert again.images.isChecked()


@pytest.mark.usefixtures("hub_env")
async def test_the_wizard_offers_images_and_saves_the_owners_tick(settings_for, config_home,
                                                                  qtbot) -> None:
    async with open_app(settings_for(first_run_done=False), detector=eighty_gb_free) as app:
        app.launch()
        wizard = app.wizard
        assert wizard is not None
        await until(lambda: app.hardware is not None, 20, "hardware detection")
        for _ in range(2):
            wizard.button(QWizard.WizardButton.NextButton).click()
        assert wizard.currentPage() is wizard.hardware
        assert not wizard.hardware.images.isChecked()
        wizard.hardware.images.setChecked(True)
        wizard.button(QWizard.WizardButton.NextButton).click()
        wizard.model.none.setChecked(True)
        wizard.button(QWizard.WizardButton.NextButton).click()
        wizard.button(FINISH_WITHOUT_STARTING).click()
        await until(lambda: not wizard.isVisible(), 10, "the wizard closed")
        assert app.settings.images
    assert json.loads((config_home / "settings.json").read_text())["images"] is True
