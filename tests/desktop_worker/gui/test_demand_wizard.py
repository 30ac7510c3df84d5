"""The first-run wizard and the queen's demand (issue 17): after the queen step it asks
``GET /worker/demand`` and offers the in-demand models that fit first, pinned to the queen's
file; a queen with no demand, an older queen (404), one out of reach or one answering nonsense
leaves the built-in list."""

from __future__ import annotations

import json
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest
from PySide6.QtWidgets import QWizard

from desktop_worker.gui.services.advice import SMOLLM2
from desktop_worker.gui.services.demand import InDemandModel
from desktop_worker.gui.services.models import fetch_demand
from desktop_worker.gui.wizard import FINISH_WITHOUT_STARTING
from desktop_worker.hardware import NullGpuDetector, SystemInfo, detect_hardware
from shared_schema import Demand, ModelDemand
from tests.desktop_worker.gui.conftest import MODEL, open_app, until
from tests.support.fake_hub import FakeHub, FakeRepo
from tests.support.hardware_fixtures import FixedSystemProbe
from tests.support.http_server import ServedFake, TrackedHTTPServer

REPO = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF"
FILE = "SmolLM2-135M-Instruct-Q4_1.gguf"
NAME = f"{REPO}:Q4_1"
SMOLLM = FakeRepo(REPO, files={FILE: MODEL})

pytestmark = pytest.mark.usefixtures("hub_env")


class FakeQueenDemand(ServedFake):
    """``GET /worker/demand`` answering ``body`` with ``status`` (a 404: an older queen)."""

    name = "fake-queen-demand"

    def __init__(self, body: bytes = b"", status: int = 200) -> None:
        super().__init__()
        self.body, self.status, self.hits = body, status, 0

    def _make_server(self) -> TrackedHTTPServer:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                fake.hits += 1
                ok = self.path == "/worker/demand" and fake.status == 200
                body = fake.body if ok else b'{"detail": "Not Found"}'
                self.send_response(200 if ok else fake.status if fake.status != 200 else 404)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        return TrackedHTTPServer(Handler, self.name)

    @property
    def ws_url(self) -> str:
        assert self._server is not None
        host, port = self._server.server_address[:2]
        return f"ws://{host}:{port}/worker"


@pytest.fixture
def hub() -> Iterator[FakeHub]:
    with FakeHub([SMOLLM]) as running:
        yield running


def laptop(models_dir: Path):
    info = SystemInfo(cpu_count=4, total_ram_mb=8192, available_ram_mb=6000, disk_free_gb=50)
    return detect_hardware(models_dir, nvidia=NullGpuDetector(), opencl=NullGpuDetector(),
                           system=FixedSystemProbe(info))


def demand_json(hub: FakeHub) -> bytes:
    models = [
        ModelDemand(name=NAME, requests_per_min=20, unmet_per_min=5, queued=2, mean_wait_s=3,
                    holders=0, loading=0, size_bytes=MODEL.stat().st_size, memory_mb=600,
                    sha256=hub.file_sha256(REPO, FILE), revision=SMOLLM.commit,
                    earn_msat_per_1k_tokens=500),
        ModelDemand(name="big/one-GGUF:Q8_0", requests_per_min=50, unmet_per_min=40, queued=9,
                    mean_wait_s=30, holders=0, loading=0, size_bytes=40 << 30,
                    memory_mb=48_000, earn_msat_per_1k_tokens=9000),  # does not fit a laptop
    ]
    return Demand(models=models).model_dump_json().encode()


def next_page(wizard: QWizard) -> None:
    wizard.button(QWizard.WizardButton.NextButton).click()


async def to_model_page(app, queen_ws: str):
    wizard = app.open_wizard() if app.wizard is None else app.wizard
    await until(lambda: app.hardware is not None, 20, "hardware detection")
    next_page(wizard)  # payout (skipped)
    wizard.queen.edit.setText(queen_ws)
    next_page(wizard)  # queen
    next_page(wizard)  # hardware: the demand is asked for from here
    await until(lambda: wizard.demand_task is None, 20, "the queen's demand")
    await until(lambda: wizard.hub_task is not None and wizard.hub_task.done(), 20, "the hub")
    assert wizard.currentPage() is wizard.model
    return wizard


async def test_the_wizard_offers_the_in_demand_model_first_and_pulls_the_pinned_file(
        settings_for, hub, qtbot):
    async with FakeQueenDemand(demand_json(hub)) as queen:
        settings = settings_for(hf_endpoint=hub.url, first_run_done=False)
        async with open_app(settings, detector=laptop) as app:
            app.launch()
            wizard = await to_model_page(app, queen.ws_url)
            assert queen.hits == 1
            chosen = wizard.model.chosen_model()
            assert isinstance(chosen, InDemandModel)
            assert chosen.name == NAME
            assert chosen.sha256 == hub.file_sha256(REPO, FILE)
            assert "in demand" in wizard.model.buttons[0].text()
            assert "ask for a model that fits" in wizard.model.demand_note.text()
            names = [m.name for m in wizard.model.models]
            assert "big/one-GGUF:Q8_0" not in names  # does not fit: not offered
            assert SMOLLM2.name in names  # the built-in list follows
            next_page(wizard)
            wizard.button(FINISH_WITHOUT_STARTING).click()
            await until(lambda: not wizard.isVisible(), 60, "the wizard to finish")
            [model] = app.models.store.list()
            assert model.name == NAME
            assert model.sha256 == hub.file_sha256(REPO, FILE)
            assert model.origin == f"{REPO}@{SMOLLM.commit}:{FILE}"


@pytest.mark.parametrize(("body", "status"), [
    (b"", 404),  # an older queen
    (Demand().model_dump_json().encode(), 200),  # no demand yet
    (b'{"type": "demand", "models": [{"name": "x", "requests_per_min": -4}]}', 200),  # hostile
    (b"not json", 200),
])
async def test_no_usable_demand_leaves_the_built_in_list(settings_for, hub, qtbot, body,
                                                         status):
    async with FakeQueenDemand(body, status) as queen:
        settings = settings_for(hf_endpoint=hub.url, first_run_done=False)
        async with open_app(settings, detector=laptop) as app:
            app.launch()
            wizard = await to_model_page(app, queen.ws_url)
            assert queen.hits == 1
            assert not any(isinstance(m, InDemandModel) for m in wizard.model.models)
            assert wizard.model.chosen_model() == wizard.suggestion
            assert "no demand" in wizard.model.demand_note.text()


async def test_a_queen_out_of_reach_leaves_the_built_in_list(settings_for, qtbot):
    settings = settings_for(first_run_done=False)
    async with open_app(settings, detector=laptop) as app:
        app.launch()
        wizard = await to_model_page(app, "ws://127.0.0.1:9/worker")  # nothing listens there
        assert not any(isinstance(m, InDemandModel) for m in wizard.model.models)
        assert "no demand" in wizard.model.demand_note.text()


async def test_fetch_demand_reads_the_queen_and_refuses_what_is_not_demand(hub):
    async with FakeQueenDemand(demand_json(hub)) as queen:
        demand = await fetch_demand(queen.ws_url)
        assert demand is not None
        assert next(m.name for m in demand.models) == NAME
    async with FakeQueenDemand(json.dumps({"type": "demand", "models": [
            {"name": f"m/{i}", "requests_per_min": 1, "unmet_per_min": 0, "queued": 0,
             "mean_wait_s": 0, "holders": 0, "loading": 0} for i in range(51)]}).encode()) as q:
        assert await fetch_demand(q.ws_url) is None  # over the 50-model limit
