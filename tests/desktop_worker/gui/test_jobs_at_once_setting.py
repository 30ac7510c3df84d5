"""Settings' "Jobs at once" (issue 36): automatic first and chosen by default, 1 to 8 after it,
saved as ``max_jobs`` through the real settings file, a larger number a config file set kept as
it is, and said to apply when earning restarts."""

from __future__ import annotations

import json
from pathlib import Path

from PySide6.QtCore import Qt

from desktop_worker.gui.services.settings import (
    AUTOMATIC_JOBS,
    JOBS_HINT,
    SettingsService,
    jobs_choices,
)
from desktop_worker.gui.views.settings import SettingsView
from desktop_worker.settings import WorkerSettings
from tests.support.fake_disk import FakeDisk

GIB = 1024**3


def saved(config_home: Path) -> dict[str, object]:
    return json.loads((config_home / "settings.json").read_text())


def choices(view: SettingsView) -> list[str]:
    return [view.jobs.itemText(n) for n in range(view.jobs.count())]


def settings_view(service: SettingsService, qtbot, earning: bool = False) -> SettingsView:
    view = SettingsView(service, earning=lambda: earning)
    qtbot.addWidget(view)
    return view


def service_for(settings: WorkerSettings) -> SettingsService:
    return SettingsService(settings, disk=FakeDisk(total_bytes=500 * GIB, free_bytes=80 * GIB))


def test_the_choices_keep_a_larger_number_a_config_file_set() -> None:
    assert jobs_choices(None) == [(AUTOMATIC_JOBS, None), *((str(n), n) for n in range(1, 9))]
    assert AUTOMATIC_JOBS == "Automatic (as memory allows, up to 8)"
    assert jobs_choices(4) == jobs_choices(None)
    assert jobs_choices(16)[-1] == ("16", 16)
    assert len(jobs_choices(16)) == 10


def test_automatic_and_four_round_trip_through_the_settings_file(settings_for, config_home,
                                                                 qtbot):
    view = settings_view(service_for(settings_for()), qtbot)
    assert choices(view) == [AUTOMATIC_JOBS, *(str(n) for n in range(1, 9))]
    assert view.jobs.currentText() == AUTOMATIC_JOBS  # the default
    assert view.jobs_note.text() == JOBS_HINT
    view.jobs.setCurrentText("4")
    assert view.message.text() == "Unsaved changes"
    qtbot.mouseClick(view.save, Qt.MouseButton.LeftButton)
    assert view.message.text() == "Saved."
    assert saved(config_home)["max_jobs"] == 4
    assert WorkerSettings().max_jobs == 4  # read back from the file
    assert WorkerSettings().jobs_at_once == 4

    again = settings_view(service_for(WorkerSettings()), qtbot)  # the next launch
    assert again.jobs.currentText() == "4"
    again.jobs.setCurrentIndex(0)
    assert again.apply()
    assert saved(config_home)["max_jobs"] is None
    assert WorkerSettings().max_jobs is None
    assert WorkerSettings().jobs_at_once == 8
    assert settings_view(service_for(WorkerSettings()), qtbot).jobs.currentText() \
        == AUTOMATIC_JOBS


def test_sixteen_from_a_config_file_is_shown_and_kept(settings_for, config_home, qtbot):
    config_home.mkdir(parents=True, exist_ok=True)
    (config_home / "settings.json").write_text(json.dumps({"max_jobs": 16}))
    view = settings_view(service_for(settings_for()), qtbot)
    assert view.service.settings.max_jobs == 16
    assert view.jobs.currentText() == "16"
    assert choices(view)[-1] == "16"
    view.threads.setValue(1)  # another setting saved: the 16 stays as it is
    assert view.apply()
    assert saved(config_home)["max_jobs"] == 16
    assert WorkerSettings().max_jobs == 16
    assert view.jobs.currentText() == "16"


def test_a_change_while_earning_says_it_applies_at_the_restart(settings_for, config_home,
                                                               qtbot):
    view = settings_view(service_for(settings_for()), qtbot, earning=True)
    view.jobs.setCurrentText("2")
    assert view.apply()
    assert "jobs at once applies when you restart earning" in view.message.text()
    assert view.restart.isVisibleTo(view)
    assert WorkerSettings().max_jobs == 2
