"""The Models tab's "In demand" list (issue 17): rows from the queen's demand that fit this
machine, the earnings estimate before and after this worker's speed is measured, one-click Add
pinned to the queen's file (against the fake hub), and the provenance of the models held."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from PySide6.QtCore import Qt

from desktop_worker.gui.services.demand import demand_rows
from desktop_worker.gui.services.models import ADD_COLUMN, DemandTableModel
from desktop_worker.gui.views.models import NO_DEMAND, NOTHING_FITS, SWARM_ON
from desktop_worker.jobs import JobRecord
from shared_schema import Demand, ModelDemand
from tests.desktop_worker.gui.conftest import MODEL, open_app, until
from tests.support.fake_hub import FakeHub, FakeRepo
from tests.support.hardware_fixtures import fixture_path, recorded_machine
from tests.support.on_demand import model_demand

REPO = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF"
FILE = "SmolLM2-135M-Instruct-Q4_1.gguf"
NAME = f"{REPO}:Q4_1"
SMOLLM = FakeRepo(REPO, files={FILE: MODEL})
GB = 1 << 30

pytestmark = pytest.mark.usefixtures("hub_env")


@pytest.fixture
def hub() -> Iterator[FakeHub]:
    with FakeHub([SMOLLM]) as running:
        yield running


def rtx3060(models_dir: Path):
    return recorded_machine(fixture_path("gaming_rtx3060"), models_dir)


def md(name: str, **kw: Any) -> ModelDemand:
    return model_demand(name, **({"unmet_per_min": 1, "earn_msat_per_1k_tokens": 2000} | kw))


def smollm(hub: FakeHub, **kw: Any) -> ModelDemand:
    return md(NAME, size_bytes=MODEL.stat().st_size, memory_mb=600,
              sha256=hub.file_sha256(REPO, FILE), revision=SMOLLM.commit, **kw)


def test_the_table_model_shows_rows_without_a_window(tmp_path):
    rows = demand_rows(Demand(models=[md("a/b:Q4", sha256="c" * 64, revision="d" * 40)]),
                       rtx3060(tmp_path))
    table = DemandTableModel()
    table.set_rows(rows)
    assert table.rowCount() == 1
    assert table.columnCount() == ADD_COLUMN + 1
    assert table.cell("a/b:Q4", "Demand") == "12 requests/min, 3 waiting, nobody serves it yet"
    assert table.cell("a/b:Q4", "Memory") == "1,500 MB"
    assert table.cell("a/b:Q4", "Estimate") == "— (2 sats per 1,000 tokens)"
    tip = table.data(table.index(0, 0), Qt.ItemDataRole.ToolTipRole)
    assert "d" * 40 in tip
    assert "c" * 64 in tip
    assert "measured" in table.data(table.index(0, 4), Qt.ItemDataRole.ToolTipRole)
    assert table.headerData(4, Qt.Orientation.Horizontal) == "Estimate"


async def test_demand_fills_the_list_and_the_estimate_follows_the_measured_speed(
        settings_for, hub, qtbot):
    async with open_app(settings_for(hf_endpoint=hub.url), detector=rtx3060) as app:
        app.launch()
        view = app.window.models
        await until(lambda: app.hardware is not None, 20, "the hardware")
        assert view.demand_note.text() == NO_DEMAND
        app.controller.demand_changed.emit(Demand(models=[
            md("rich/a:Q4"), md("cheap/b:Q4", earn_msat_per_1k_tokens=100),
            md("huge/c:F16", memory_mb=80_000), smollm(hub, earn_msat_per_1k_tokens=0)]))
        assert view.demand.names() == ["rich/a:Q4", "cheap/b:Q4", NAME]
        assert view.demand.cell("rich/a:Q4", "Estimate") == "— (2 sats per 1,000 tokens)"
        assert view.demand.cell(NAME, "Estimate") == "not paid"
        assert set(view.add_buttons) == set(view.demand.names())
        # A job on a 1 GB model at 50 tokens/s measures this worker.
        await app.models.import_file(MODEL, "local-smol")
        size = MODEL.stat().st_size
        tokens = int(50 * 10 * GB / size)  # 50 tokens/s on 1 GB = this many on SmolLM2 in 10 s
        app.controller.job_finished.emit(JobRecord("j1", "local-smol", "chat", 10, tokens, 10.0,
                                                   "ok"))
        assert view.demand.cell("rich/a:Q4", "Estimate") == "up to 360 sats/h"
        assert view.demand.cell("cheap/b:Q4", "Estimate") == "up to 18 sats/h"


async def test_one_click_add_pulls_the_pinned_file_and_shows_its_provenance(
        settings_for, hub, qtbot):
    async with open_app(settings_for(hf_endpoint=hub.url), detector=rtx3060) as app:
        app.launch()
        view = app.window.models
        await until(lambda: app.hardware is not None, 20, "the hardware")
        app.controller.demand_changed.emit(Demand(models=[smollm(hub)]))
        button = view.add_buttons[NAME]
        qtbot.mouseClick(button, Qt.MouseButton.LeftButton)
        await until(lambda: NAME in view.names(), 60, "the model in the table")
        assert "is ready" in view.message.text()
        assert view.demand.names() == []  # held now: no longer offered
        assert view.demand_note.text() == NOTHING_FITS
        [model] = app.models.store.list()
        assert model.sha256 == hub.file_sha256(REPO, FILE)
        row = view.names().index(NAME)
        assert view.table.item(row, 6).text() == f"{REPO} @ {SMOLLM.commit[:10]}"
        view.table.selectRow(row)
        details = view.details.text()
        for part in (REPO, FILE, SMOLLM.commit, model.sha256):
            assert part in details


async def test_add_refuses_a_file_other_than_the_one_the_queen_pinned(settings_for, hub, qtbot):
    async with open_app(settings_for(hf_endpoint=hub.url), detector=rtx3060) as app:
        app.launch()
        view = app.window.models
        await until(lambda: app.hardware is not None, 20, "the hardware")
        app.controller.demand_changed.emit(Demand(models=[
            md(NAME, size_bytes=MODEL.stat().st_size, sha256="0" * 64,
               revision=SMOLLM.commit)]))
        qtbot.mouseClick(view.add_buttons[NAME], Qt.MouseButton.LeftButton)
        await until(lambda: "sha256" in view.message.text(), 60, "the refusal")
        assert app.models.store.list() == []


async def test_with_the_swarm_choosing_the_list_says_so(settings_for, hub, qtbot):
    async with open_app(settings_for(hf_endpoint=hub.url, swarm_models=True),
                        detector=rtx3060) as app:
        app.launch()
        await until(lambda: app.hardware is not None, 20, "the hardware")
        app.controller.demand_changed.emit(Demand(models=[md("rich/a:Q4")]))
        assert app.window.models.demand_note.text() == SWARM_ON
