"""The Models tab against a fake Hugging Face hub on 127.0.0.1 (the real huggingface_hub client
and the store's resumable download): progress, landing in the table, Cancel, and the checks made
before a byte is downloaded."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QWidget

from desktop_worker.hardware import NullGpuDetector, SystemInfo, detect_hardware
from desktop_worker.store import PullProgress
from tests.desktop_worker.gui.conftest import MODEL, open_app, until
from tests.support.fake_hub import FakeHub, FakeRepo
from tests.support.hardware_fixtures import FixedSystemProbe

REPO = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF"
FILE = "SmolLM2-135M-Instruct-Q4_1.gguf"
NAME = f"{REPO}:Q4_1"


pytestmark = pytest.mark.usefixtures("hub_env")


@pytest.fixture
def hub() -> Iterator[FakeHub]:
    with FakeHub([FakeRepo(REPO, files={FILE: MODEL, "README.md": b"# SmolLM2\n"})]) as running:
        yield running


def shown(view: QWidget, widget: QWidget) -> bool:
    """Visible within the tab (whether or not the tab is the current one)."""
    return widget.isVisibleTo(view)


def incomplete(root: Path) -> list[Path]:
    return list(root.rglob("*.incomplete"))


def downloads(hub: FakeHub) -> int:
    return hub.count("GET", contains="/resolve/")


async def test_adding_a_model_shows_progress_and_lands_in_the_table(settings_for, hub, qtbot):
    async with open_app(settings_for(hf_endpoint=hub.url)) as app:
        app.launch()
        view = app.window.models
        app.window.show_tab("Models")
        reports: list[PullProgress] = []
        app.models.progress.connect(reports.append)
        pause = hub.pause_at(FILE, 8 << 20)
        view.name.setText(NAME)
        qtbot.mouseClick(view.add, Qt.MouseButton.LeftButton)
        await until(pause.reached.is_set, 30, "the download to reach 8 MB")
        await until(lambda: reports and reports[-1].downloaded_bytes > 0, 10, "a progress report")
        assert shown(view, view.progress)
        assert shown(view, view.cancel)
        assert not view.add.isEnabled()  # one download at a time
        assert 0 < view.progress.value() < view.progress.maximum()
        assert "left" in view.rate.text()
        assert reports[-1].total_bytes == MODEL.stat().st_size
        pause.release.set()
        await until(lambda: NAME in view.names(), 60, "the model in the table")
        assert "is ready" in view.message.text()
        assert not shown(view, view.cancel)
        assert view.add.isEnabled()
        assert reports[-1].done
        row = view.names().index(NAME)
        assert view.table.item(row, 2).text() == "Q4_1"
        assert view.table.item(row, 5).text() == "hub"
        assert "94.0 MB used" in view.disk.text() or "93.8 MB used" in view.disk.text()


async def test_cancel_keeps_the_partial_download_and_says_so(settings_for, hub, qtbot):
    async with open_app(settings_for(hf_endpoint=hub.url)) as app:
        app.launch()
        view = app.window.models
        pause = hub.pause_at(FILE, 4 << 20)
        view.name.setText(NAME)
        qtbot.mouseClick(view.add, Qt.MouseButton.LeftButton)
        await until(pause.reached.is_set, 30, "the download to reach 4 MB")
        await until(lambda: shown(view, view.cancel), 10, "the Cancel button")
        qtbot.mouseClick(view.cancel, Qt.MouseButton.LeftButton)
        pause.release.set()
        await until(lambda: "cancelled" in view.message.text(), 30, "the cancelled message")
        assert view.rate.text() == "cancelled"
        assert "kept" in view.message.text()
        assert NAME not in view.names()
        [partial] = incomplete(app.models.store.root)
        assert 0 < partial.stat().st_size < MODEL.stat().st_size
        # Adding it again resumes: it completes, and the partial file is gone.
        qtbot.mouseClick(view.add, Qt.MouseButton.LeftButton)
        await until(lambda: NAME in view.names(), 60, "the resumed model in the table")
        assert not incomplete(app.models.store.root)


async def test_a_model_over_the_quota_is_refused_before_downloading(settings_for, hub, qtbot):
    async with open_app(settings_for(hf_endpoint=hub.url, disk_quota_gb=0.05)) as app:
        app.launch()
        view = app.window.models
        view.name.setText(NAME)
        qtbot.mouseClick(view.add, Qt.MouseButton.LeftButton)
        await until(lambda: "quota" in view.message.text(), 30, "the refusal")
        assert "larger than the model store quota" in view.message.text()
        assert downloads(hub) == 0
        assert view.names() == []
        assert not shown(view, view.anyway)


def small_machine(models_dir: Path):
    info = SystemInfo(cpu_count=2, total_ram_mb=512, available_ram_mb=64, disk_free_gb=100)
    return detect_hardware(models_dir, nvidia=NullGpuDetector(), opencl=NullGpuDetector(),
                           system=FixedSystemProbe(info))


async def test_a_model_too_big_for_memory_asks_first(settings_for, hub, qtbot):
    async with open_app(settings_for(hf_endpoint=hub.url), detector=small_machine) as app:
        app.launch()
        await until(lambda: app.hardware is not None, 20, "hardware detection")
        view = app.window.models
        view.name.setText(NAME)
        qtbot.mouseClick(view.add, Qt.MouseButton.LeftButton)
        await until(lambda: shown(view, view.anyway), 30, "the warning")
        assert "only 64 MB of RAM is free" in view.message.text()
        assert downloads(hub) == 0
        qtbot.mouseClick(view.anyway, Qt.MouseButton.LeftButton)
        await until(lambda: NAME in view.names(), 60, "the model downloaded anyway")
        assert downloads(hub) == 1


async def test_a_bad_name_is_a_clear_error(settings_for, hub, qtbot):
    async with open_app(settings_for(hf_endpoint=hub.url)) as app:
        app.launch()
        view = app.window.models
        view.name.setText("no-such-user/no-such-repo:Q4_K_M")
        qtbot.mouseClick(view.add, Qt.MouseButton.LeftButton)
        await until(lambda: "no-such-repo" in view.message.text()
                    and "Checking" not in view.message.text(), 30, "the error")
        assert view.add.isEnabled()
        assert view.names() == []


async def test_import_a_local_file_and_delete_it(settings_for, tmp_path, qtbot):
    async with open_app(settings_for()) as app:
        app.launch()
        view = app.window.models
        assert await app.models.import_file(MODEL) is None  # what the file dialog hands over
        name = MODEL.stem
        assert view.names() == [name]
        assert "imported" in view.message.text()
        assert view.table.item(0, 5).text() == "import"
        assert "93.8 MB used" in view.disk.text()
        not_gguf = tmp_path / "notes.gguf"
        not_gguf.write_text("hello")
        error = await app.models.import_file(not_gguf)
        assert error is not None
        assert "GGUF" in view.message.text() or "gguf" in view.message.text().lower()
        assert view.names() == [name]
        await view._remove(name)  # after the confirmation dialog
        assert view.names() == []
        assert f"Deleted {name}" in view.message.text()
        assert "0 B used" in view.disk.text()
