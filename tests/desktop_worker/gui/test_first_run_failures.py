"""When the first run cannot finish: a failed download keeps the wizard open with the reason in
plain words and Retry; closing it leaves the header saying why Start was skipped, with the fix,
and the first run not done (the next launch opens the wizard again). Going Back to another model
(the bundled one, or a .gguf file) clears that error and its Retry. Also the model step's
choices and "use a .gguf file I already have"."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from PySide6.QtWidgets import QWizard

from desktop_worker.gui.services.advice import SMOLLM2
from desktop_worker.hardware import HardwareReport, NullGpuDetector, SystemInfo, detect_hardware
from desktop_worker.settings import WorkerSettings
from tests.desktop_worker.gui.conftest import MODEL, open_app, until
from tests.support.hardware_fixtures import FixedSystemProbe
from tests.support.queen import running_queen

REPO = SMOLLM2.name.split(":")[0]
pytestmark = pytest.mark.usefixtures("hub_env")


def two_threads(models_dir: Path) -> HardwareReport:
    """The issue's machine: 2 CPU threads, no GPU, plenty of RAM."""
    info = SystemInfo(cpu_count=2, total_ram_mb=24_105, available_ram_mb=23_176,
                      disk_free_gb=50)
    return detect_hardware(models_dir, nvidia=NullGpuDetector(), opencl=NullGpuDetector(),
                           system=FixedSystemProbe(info))


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def to_last_page(wizard: QWizard) -> None:
    while wizard.currentPage() is not wizard.ready:
        wizard.button(QWizard.WizardButton.NextButton).click()


async def to_model_page(app) -> QWizard:
    """The model page, once the wizard knows whether the hub answers."""
    await until(lambda: app.hardware is not None, 20, "hardware detection")
    wizard = app.wizard
    while wizard.currentPage() is not wizard.model:
        wizard.button(QWizard.WizardButton.NextButton).click()
    await until(lambda: wizard.hub_task is not None and wizard.hub_task.done(), 20, "the hub")
    return wizard


async def fail_a_download(app) -> QWizard:
    """The owner insists on the download although the hub is out of reach: it fails."""
    wizard = await to_model_page(app)
    wizard.model.buttons[0].click()  # the suggestion, over the bundled model offered first
    to_last_page(wizard)
    wizard.button(QWizard.WizardButton.FinishButton).click()
    await until(lambda: wizard.failure is not None, 60, "the download to fail")
    return wizard


async def test_an_unreachable_hub_keeps_the_wizard_open_then_the_header_says_why(
        settings_for, qtbot):
    hub_url = f"http://127.0.0.1:{closed_port()}"
    settings = settings_for(hf_endpoint=hub_url, first_run_done=False)
    async with open_app(settings, detector=two_threads) as app:
        app.launch()
        wizard = await to_model_page(app)
        assert wizard.model.bundled_chosen()  # offered first, offline
        wizard.model.buttons[0].click()  # the owner wants the download anyway
        to_last_page(wizard)
        wizard.button(QWizard.WizardButton.FinishButton).click()
        await until(lambda: wizard.failure is not None, 60, "the download to fail")
        assert wizard.isVisible()  # not closed silently
        status = wizard.ready.status.text()
        assert status == ("The model download failed: could not reach 127.0.0.1: check your "
                          "internet connection, then retry.")
        assert "Errno" not in status
        assert wizard.ready.retry.isVisibleTo(wizard)
        assert not app.controller.running
        # The Models tab says it in the same words.
        assert "could not reach 127.0.0.1" in app.window.models.message.text()
        # Closing the wizard: the header says Start was skipped, and offers the retry.
        wizard.reject()
        assert not wizard.isVisible()
        header = app.header
        assert header.detail.text().startswith("Start was skipped: The model download failed")
        assert header.fix.isVisibleTo(header)
        assert header.fix.text() == "Retry download"


async def test_a_failed_download_retried_from_the_wizard_then_earns(tmp_path, settings_for, hub,
                                                                     qtbot):
    async with running_queen(tmp_path) as queen:
        settings = settings_for(queen_url=queen.ws_url, hf_endpoint=hub.url,
                                first_run_done=False)
        async with open_app(settings, detector=two_threads) as app:
            app.launch()
            await until(lambda: app.hardware is not None, 20, "hardware detection")
            wizard = app.wizard
            to_last_page(wizard)
            assert wizard.model.chosen_model() == SMOLLM2  # 2 threads, no GPU: the tiny one
            hub.fail_next(f"/api/models/{REPO}", 403)  # the hub refuses once
            wizard.button(QWizard.WizardButton.FinishButton).click()
            await until(lambda: wizard.failure is not None, 60, "the download to fail")
            assert "refused the download (HTTP 403)" in wizard.ready.status.text()
            assert wizard.isVisible()
            assert not app.controller.running
            wizard.ready.retry.click()
            await until(lambda: not wizard.isVisible(), 60, "the wizard to finish")
            assert SMOLLM2.name in app.models.store
            await until(lambda: app.controller.link_state == "connected", 30, "connected")
            assert not app.header.fix.isVisibleTo(app.header)


async def test_retry_download_from_the_header_fetches_and_starts(tmp_path, settings_for, hub,
                                                                 qtbot):
    async with running_queen(tmp_path) as queen:
        settings = settings_for(queen_url=queen.ws_url, hf_endpoint=hub.url,
                                first_run_done=False)
        async with open_app(settings, detector=two_threads) as app:
            app.launch()
            wizard = app.wizard
            to_last_page(wizard)
            hub.fail_next(f"/api/models/{REPO}", 403)
            wizard.button(QWizard.WizardButton.FinishButton).click()
            await until(lambda: wizard.failure is not None, 60, "the download to fail")
            wizard.reject()
            assert app.header.fix.text() == "Retry download"
            app.header.fix.click()
            await until(lambda: app.controller.link_state == "connected", 60, "connected")
            assert SMOLLM2.name in app.models.store
            assert not app.header.fix.isVisibleTo(app.header)
            assert "skipped" not in app.header.detail.text()


async def test_the_model_step_offers_smaller_choices_and_a_file_i_have(tmp_path, settings_for,
                                                                       qtbot):
    async with open_app(settings_for(first_run_done=False)) as app:
        app.launch()
        wizard = app.wizard
        # A CPU machine with 8 threads: the suggestion, then smaller ones, biggest first.
        info = SystemInfo(cpu_count=8, total_ram_mb=64_000, available_ram_mb=64_000,
                          disk_free_gb=50)
        wizard.show_hardware(detect_hardware(tmp_path, nvidia=NullGpuDetector(),
                                             opencl=NullGpuDetector(),
                                             system=FixedSystemProbe(info)))
        page = wizard.model
        sizes = [m.size_bytes for m in page.models]
        assert len(sizes) > 1
        assert sizes == sorted(sizes, reverse=True)
        assert page.chosen_model() == page.models[0] == wizard.suggestion
        assert "(suggested)" in page.buttons[0].text()
        page.buttons[-1].setChecked(True)
        assert wizard.choices(True).model == page.models[-1]
        # "Use a .gguf file I already have": the file dialog's answer is imported on Finish.
        page.pick_file = lambda: str(MODEL)
        page.browse.click()
        assert page.own.isChecked()
        assert MODEL.name in page.file_label.text()
        to_last_page(wizard)
        wizard.button(QWizard.WizardButton.FinishButton).click()
        await until(lambda: not wizard.isVisible(), 60, "the import and start")
        assert [m.name for m in app.models.store.list()] == [MODEL.stem]
        await until(lambda: app.controller.running or app.controller.link_state != "stopped",
                    10, "the worker to start")


async def test_a_file_that_is_not_gguf_keeps_the_wizard_open(tmp_path, settings_for, qtbot):
    bad = tmp_path / "notes.gguf"
    bad.write_text("not a model")
    async with open_app(settings_for(first_run_done=False)) as app:
        app.launch()
        wizard = app.wizard
        wizard.model.pick_file = lambda: str(bad)
        wizard.model.browse.click()
        to_last_page(wizard)
        wizard.button(QWizard.WizardButton.FinishButton).click()
        await until(lambda: wizard.failure is not None, 30, "the import to fail")
        assert wizard.isVisible()
        assert wizard.ready.status.text().startswith("Could not use notes.gguf:")
        assert not app.controller.running


@pytest.mark.parametrize("instead", ["bundled", "own file"])
async def test_back_from_a_failed_download_to_another_model_clears_the_error_and_retry(
        settings_for, qtbot, instead):
    async with open_app(settings_for(first_run_done=False), detector=two_threads) as app:
        app.launch()
        wizard = await fail_a_download(app)
        ready = wizard.ready
        assert ready.retry.isVisibleTo(wizard)
        # Back and Next with the same choices: the error still stands, with Retry.
        wizard.back()
        wizard.button(QWizard.WizardButton.NextButton).click()
        assert ready.status.text().startswith("The model download failed")
        assert ready.retry.isVisibleTo(wizard)
        # Back, and another model: the Ready page is about that one now.
        wizard.back()
        assert wizard.currentPage() is wizard.model
        if instead == "bundled":
            wizard.model.bundled.click()
        else:
            wizard.model.pick_file = lambda: str(MODEL)
            wizard.model.browse.click()
        wizard.button(QWizard.WizardButton.NextButton).click()
        assert wizard.currentPage() is ready
        assert ready.status.text() == ""
        assert not ready.retry.isVisibleTo(wizard)
        assert wizard.failure is None
        assert MODEL.name in ready.summary.text()
        wizard.button(QWizard.WizardButton.FinishButton).click()
        await until(lambda: not wizard.isVisible(), 60, "the import and start")
        assert [m.name for m in app.models.store.list()] == [MODEL.stem]
        assert app.settings.first_run_done


async def test_cancel_after_a_failed_download_opens_the_wizard_again_next_launch(
        settings_for, qtbot):
    settings = settings_for(first_run_done=False)
    async with open_app(settings, detector=two_threads) as app:
        app.launch()
        wizard = await fail_a_download(app)
        wizard.reject()
        assert not wizard.isVisible()
        assert not app.settings.first_run_done
        assert app.header.fix.text() == "Retry download"  # this run still offers the fix
    saved = WorkerSettings()
    assert not saved.first_run_done  # nothing served yet: the wizard is not done
    assert saved.queen_url == settings.queen_url  # what the owner typed is kept
    saved = saved.model_copy(update={"key_path": settings.key_path, "key_store": "file"})
    async with open_app(saved, detector=two_threads) as again:
        again.launch()
        assert again.wizard is not None
        assert again.wizard.isVisible()
