"""The volunteer's disk in the app (issue 34): the quota for models is chosen once (half the free
disk, shown in the wizard and in Settings, changeable), saved so it does not drift as the disk
fills, and the space always left free (the headroom) is shown and changeable in Settings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QWizard

from desktop_worker.gui.services.settings import SettingsService
from desktop_worker.gui.views.settings import SettingsView
from desktop_worker.gui.wizard import FINISH_WITHOUT_STARTING
from desktop_worker.hardware import HardwareReport, NullGpuDetector, SystemInfo, detect_hardware
from desktop_worker.settings import WorkerSettings
from desktop_worker.store.disk import GIB
from tests.desktop_worker.gui.conftest import open_app, until
from tests.support.fake_disk import FakeDisk
from tests.support.hardware_fixtures import FixedSystemProbe


@pytest.fixture(autouse=True)
def default_headroom(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests show and save the default headroom, which tests/conftest.py overrides."""
    monkeypatch.delenv("APIARY_DISK_HEADROOM_GB", raising=False)


def saved(config_home: Path) -> dict[str, object]:
    return json.loads((config_home / "settings.json").read_text())


def test_the_first_save_chooses_half_the_free_disk_once(settings_for, config_home):
    disk = FakeDisk(total_bytes=500 * GIB, free_bytes=80 * GIB)
    service = SettingsService(settings_for(), disk=disk)
    assert service.quota_gb() == 40.0  # shown before anything is saved
    assert service.headroom_gb() == 50.0  # a tenth of a 500 GB disk
    service.update(threads=2)
    assert saved(config_home)["disk_quota_gb"] == 40.0
    assert service.settings.disk_quota_gb == 40.0
    disk.free_bytes = 10 * GIB  # the disk fills: the quota chosen does not drift
    service.update(threads=3)
    assert saved(config_home)["disk_quota_gb"] == 40.0
    assert WorkerSettings().disk_quota_gb == 40.0
    service.update(disk_quota_gb=0)  # "no quota" is a choice of its own, kept as such
    assert WorkerSettings().disk_quota_gb == 0
    assert WorkerSettings().disk_quota_bytes is None


def test_settings_show_and_save_the_quota_and_the_space_left_free(settings_for, config_home,
                                                                   qtbot):
    disk = FakeDisk(total_bytes=50 * GIB, free_bytes=30 * GIB)
    view = SettingsView(SettingsService(settings_for(), disk=disk))
    qtbot.addWidget(view)
    assert view.quota.value() == 15.0  # half the free disk, before any save
    assert view.headroom.value() == 0
    assert view.headroom.specialValueText() == "automatic (10 GB)"  # 10 % of 50 GB, at least 10
    assert "last 10 GB" in view.disk_note.text()
    view.headroom.setValue(20)
    view.quota.setValue(12)
    assert view.message.text() == "Unsaved changes"
    qtbot.mouseClick(view.save, Qt.MouseButton.LeftButton)
    assert "Saved" in view.message.text()
    again = WorkerSettings()
    assert again.disk_headroom_gb == 20
    assert again.disk_quota_gb == 12
    assert again.disk_headroom_bytes == 20 * GIB
    assert "last 20 GB" in view.disk_note.text()
    view.headroom.setValue(0.5)  # under the 1 GB minimum: refused, nothing saved
    assert not view.apply()
    assert "disk headroom gb" in view.message.text()
    assert WorkerSettings().disk_headroom_gb == 20


def eighty_gb_free(models_dir: Path) -> HardwareReport:
    info = SystemInfo(cpu_count=4, total_ram_mb=8192, available_ram_mb=4096, disk_free_gb=80)
    return detect_hardware(models_dir, nvidia=NullGpuDetector(), opencl=NullGpuDetector(),
                           system=FixedSystemProbe(info))


@pytest.mark.usefixtures("hub_env")
@pytest.mark.parametrize("owner_quota", [None, 25.0])
async def test_the_wizard_shows_the_quota_and_saves_the_owners_choice(settings_for, config_home,
                                                                      owner_quota, qtbot):
    async with open_app(settings_for(first_run_done=False), detector=eighty_gb_free) as app:
        app.launch()
        wizard = app.wizard
        assert wizard is not None
        await until(lambda: app.hardware is not None, 20, "hardware detection")
        for _ in range(2):
            wizard.button(QWizard.WizardButton.NextButton).click()
        assert wizard.currentPage() is wizard.hardware
        assert wizard.hardware.quota.isEnabled()
        assert wizard.hardware.quota.value() == 40  # half of the 80 GB free
        assert "10 GB" in wizard.hardware.disk_note.text()
        if owner_quota is not None:
            wizard.hardware.quota.setValue(owner_quota)
        wizard.show_hardware(app.hardware)  # a second detection keeps the owner's choice
        wizard.button(QWizard.WizardButton.NextButton).click()
        wizard.model.none.setChecked(True)
        wizard.button(QWizard.WizardButton.NextButton).click()
        expected = owner_quota or 40.0
        assert f"up to {expected:,.0f} GB" in wizard.ready.summary.text()
        wizard.button(FINISH_WITHOUT_STARTING).click()
        await until(lambda: not wizard.isVisible(), 10, "the wizard closed")
        assert app.settings.disk_quota_gb == expected
    assert WorkerSettings().disk_quota_gb == expected
    assert saved(config_home)["disk_quota_gb"] == expected
