"""The Settings tab's fine-tuning switch (issue 37, ``train``): off by default, saved to
settings.json and read back, applied when earning restarts, and what the next hello says."""

from __future__ import annotations

import json

from desktop_worker.gui.services.settings import SettingsService
from desktop_worker.gui.views.settings import TRAIN_LABEL, SettingsView
from desktop_worker.service import worker_capabilities
from desktop_worker.settings import WorkerSettings, config_path


def test_the_train_switch_saves_comes_back_and_reaches_the_hello(settings_for, qtbot) -> None:
    view = SettingsView(SettingsService(settings_for()))
    qtbot.addWidget(view)
    assert view.train.text() == TRAIN_LABEL
    assert not view.train.isChecked()  # the owner opts in
    view.train.setChecked(True)
    assert view.message.text() == "Unsaved changes"
    assert view.apply()
    assert json.loads(config_path().read_text())["train"] is True

    reread = WorkerSettings(models_dir=settings_for().models_dir)
    assert reread.train
    assert "train" in worker_capabilities(reread)
    again = SettingsView(SettingsService(reread))
    qtbot.addWidget(again)
    assert again.train.isChecked()
