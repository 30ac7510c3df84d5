"""The small model that comes with Apiary, in the first-run wizard (issue 35): offered on the
model page; first, selected and explained when nothing can be downloaded (the hub out of reach,
or offline mode); imported on Start with no request to the hub; and imported under the queen's
hub name when the queen's demand lists its sha256, so that a real queen that read that name on
the (fake) hub routes to it by its own pinned file."""

from __future__ import annotations

import huggingface_hub
import pytest
from PySide6.QtWidgets import QWizard

from desktop_worker.gui.services.advice import SMOLLM2
from desktop_worker.gui.wizard import FINISH_WITHOUT_STARTING, FirstRunWizard
from desktop_worker.settings import WorkerSettings
from tests.desktop_worker.gui.conftest import MODEL, open_app, until
from tests.desktop_worker.gui.test_demand_wizard import laptop, next_page
from tests.support.fake_hub import FakeHub, FakeRepo
from tests.support.queen import running_queen

pytestmark = pytest.mark.usefixtures("hub_env")

BUNDLED_LABEL = "Use the small model that comes with Apiary: works offline, earns little"
REPO = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF"
FILE = "SmolLM2-135M-Instruct-Q4_1.gguf"  # the same bytes as the bundled file
NAME = f"{REPO}:Q4_1"


async def to_model_page(app) -> FirstRunWizard:
    """From the first page to the model page, with the hub asked and the queen's demand in."""
    wizard = app.wizard
    await until(lambda: app.hardware is not None, 20, "hardware detection")
    while wizard.currentPage() is not wizard.model:
        next_page(wizard)
    await until(lambda: wizard.hub_task is not None and wizard.hub_task.done(), 20, "the hub")
    await until(lambda: wizard.demand_task is None, 20, "the queen's demand")
    return wizard


@pytest.mark.parametrize(("offline_mode", "why"), [
    (False, "127.0.0.1 cannot be reached from this computer"),  # nothing listens there
    (True, "offline mode is on (HF_HUB_OFFLINE=1)"),
])
async def test_offline_the_bundled_model_comes_first_and_start_imports_it(
        settings_for, qtbot, monkeypatch, offline_mode, why):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", offline_mode)
    async with open_app(settings_for(first_run_done=False), detector=laptop) as app:
        app.launch()
        wizard = await to_model_page(app)
        page = wizard.model
        assert page.bundled is not None
        assert page.bundled.text() == BUNDLED_LABEL
        # First, above every download, and selected; the page says why.
        assert page.first_box.indexOf(page.bundled) == 0
        assert page.later_box.indexOf(page.bundled) == -1
        assert page.bundled.isChecked()
        assert page.chosen_model() is None
        assert "(suggested)" not in page.buttons[0].text()
        assert page.offline_note.isVisibleTo(page)
        assert page.offline_note.text().startswith(f"Nothing can be downloaded right now: {why}.")
        assert "needs no download" in page.offline_note.text()
        next_page(wizard)
        assert "the small model that comes with Apiary" in wizard.ready.summary.text()
        wizard.button(QWizard.WizardButton.FinishButton).click()
        await until(lambda: not wizard.isVisible(), 60, "the import and start")
        assert wizard.failure is None
        [model] = app.models.store.list()
        assert model.name == MODEL.stem  # no queen names this file: its own name
        assert model.source == "import"
        assert model.origin == str(MODEL.resolve())
        assert model.path.read_bytes()[:4] == b"GGUF"
        assert model.size_bytes == MODEL.stat().st_size
        assert app.settings.first_run_done
        await until(lambda: app.controller.running, 10, "the worker to start")


async def test_online_the_bundled_model_is_offered_and_imports_with_no_request_to_the_hub(
        settings_for, hub, qtbot):
    settings = settings_for(hf_endpoint=hub.url, first_run_done=False)
    async with open_app(settings, detector=laptop) as app:
        app.launch()
        wizard = await to_model_page(app)
        page = wizard.model
        # The hub answers: downloads come first, the suggestion selected, the bundled model
        # offered below them, and no offline note.
        assert page.chosen_model() == wizard.suggestion
        assert page.later_box.indexOf(page.bundled) == 0
        assert not page.bundled.isChecked()
        assert not page.offline_note.isVisibleTo(page)
        page.bundled.click()
        assert page.bundled_chosen()
        next_page(wizard)
        asked = hub.count()
        wizard.button(FINISH_WITHOUT_STARTING).click()
        await until(lambda: not wizard.isVisible(), 60, "the import")
        assert hub.count() == asked  # imported from the app's own file: the hub never asked
        assert [m.name for m in app.models.store.list()] == [MODEL.stem]
        assert SMOLLM2.name not in app.models.store
        assert not app.controller.running


async def test_the_bundled_model_goes_in_under_the_hub_name_the_queens_demand_gives_it(
        tmp_path, settings_for, qtbot):
    with FakeHub([FakeRepo(REPO, files={FILE: MODEL})]) as hub:
        async with running_queen(tmp_path, hub_endpoint=hub.url) as queen:
            # A developer asked for the hub name and nobody serves it: the queen read it on the
            # hub (pinning its file by sha256), and its demand lists it.
            pinned = await queen.state.catalog.resolve(NAME)
            queen.state.placement.book.asked(NAME, met=False)
            await queen.state.placement.tell_demand()
            settings = settings_for(queen_url=queen.ws_url, hf_endpoint=hub.url,
                                    first_run_done=False)
            async with open_app(settings, detector=laptop) as app:
                app.launch()
                wizard = await to_model_page(app)
                assert wizard.demand is not None
                assert [m.sha256 for m in wizard.demand.models] == [pinned.sha256]
                wizard.model.bundled.click()
                next_page(wizard)
                asked = hub.count()
                wizard.button(QWizard.WizardButton.FinishButton).click()
                await until(lambda: not wizard.isVisible(), 60, "the import and start")
                [model] = app.models.store.list()
                assert model.name == NAME  # the queen's name for this very file
                assert model.source == "import"
                assert model.sha256 == pinned.sha256
                assert hub.count() == asked  # named by the demand, not downloaded
                await until(lambda: app.controller.link_state == "connected", 30, "connected")
                await queen.wait_until(lambda: NAME in queen.state.registry.model_names(), 10)
                # The queen routes to it by its own pinned file: a developer's request for the
                # hub name is served from the imported copy.
                worker = app.identity().pubkey
                assert queen.state.registry.get(worker).models[NAME].sha256 == pinned.sha256
                answer = await queen.client(timeout=60).chat.completions.create(
                    model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                    temperature=0)
                assert answer.choices[0].message.content


async def test_the_bundled_model_imported_before_is_not_copied_again(settings_for, qtbot):
    """The wizard run again (a first run cancelled after Start, say): already here."""
    async with open_app(settings_for(first_run_done=False), detector=laptop) as app:
        error = await app.models.import_file(MODEL)
        assert error is None
        [before] = app.models.store.list()
        app.launch()
        wizard = await to_model_page(app)
        assert wizard.model.bundled.isChecked()  # nothing downloads here (NO_HUB)
        next_page(wizard)
        wizard.button(FINISH_WITHOUT_STARTING).click()
        await until(lambda: not wizard.isVisible(), 30, "the wizard to finish")
        assert app.models.store.list() == [before]
    assert WorkerSettings().first_run_done
