"""A newcomer's walk, from first launch to sats and a relaunch, on a real X display with a
system tray host, shot as the whole screen at each step (``walk-*.png`` next to this file).

    docs/screenshots/walk.sh     # starts Xvfb, openbox and trayer, then runs this

Everything is real and offline: a queen on 127.0.0.1 with billing on (no escrow) and a funded
key, this machine's own hardware, the app driven through its widgets (typing, clicks), the
small model that comes with Apiary (the hub is out of reach, so the wizard offers it first),
requests sent with the openai SDK, and then a second launch of the app with the same config,
which earns again by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
TMP = Path(tempfile.mkdtemp(prefix="apiary-walk-"))
os.environ["APIARY_CONFIG_DIR"] = str(TMP / "config")
os.environ.setdefault("QT_QPA_PLATFORM", "xcb")
os.environ.setdefault("NO_PROXY", "127.0.0.1,localhost")
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ["PYTHON_KEYRING_BACKEND"] = "keyring.backends.fail.Keyring"
# Both launches read these, as a real install reads its config dir.
os.environ.update(APIARY_MODELS_DIR=str(TMP / "models"), APIARY_KEY_PATH=str(TMP / "key.pem"),
                  APIARY_KEY_STORE="file", APIARY_HF_ENDPOINT="http://127.0.0.1:9")

import qasync  # noqa: E402
from PySide6.QtCore import QPoint  # noqa: E402
from PySide6.QtTest import QTest  # noqa: E402
from PySide6.QtWidgets import QApplication, QSystemTrayIcon, QWizard  # noqa: E402

from desktop_worker.gui.app import ApiaryApp  # noqa: E402
from desktop_worker.settings import WorkerSettings  # noqa: E402
from tests.queen_server.billing.test_billing_api import funded_key  # noqa: E402
from tests.support.queen import running_queen  # noqa: E402

log = logging.getLogger("walk")


async def settle(seconds: float = 0.6) -> None:
    await asyncio.sleep(seconds)  # repaints and the window manager's moves, before a shot


async def until(predicate, timeout_s: float = 90.0) -> None:  # type: ignore[no-untyped-def]
    async with asyncio.timeout(timeout_s):
        while not predicate():  # noqa: ASYNC110
            await asyncio.sleep(0.1)


def shoot(name: str) -> None:
    """The whole screen, the tray host's panel included (ImageMagick's ``import``)."""
    path = OUT / f"walk-{name}.png"
    subprocess.run(["import", "-window", "root", str(path)], check=True)
    log.info("wrote %s", path.relative_to(ROOT))


async def first_launch(queen, settings: WorkerSettings) -> ApiaryApp:  # type: ignore[no-untyped-def]
    app = ApiaryApp(settings, earnings_interval_s=3)
    app.launch()
    app.window.move(420, 60)
    wizard = app.wizard
    assert wizard is not None
    wizard.move(40, 60)
    await settle()
    shoot("1-first-launch")
    QTest.keyClicks(wizard.payout.field.edit, "me@wallet.example")
    await settle()
    shoot("2-payout")
    wizard.button(QWizard.WizardButton.NextButton).click()
    QTest.keyClicks(wizard.queen.edit, f"http://127.0.0.1:{queen.port}/")
    await wizard.queen.run_test()
    await settle()
    shoot("3-queen")
    wizard.button(QWizard.WizardButton.NextButton).click()
    await settle()
    shoot("4-hardware")
    wizard.button(QWizard.WizardButton.NextButton).click()
    await until(lambda: wizard.model.offline, 30)
    await settle()
    shoot("5-model-offline")
    wizard.button(QWizard.WizardButton.NextButton).click()
    await settle()
    shoot("6-ready")
    wizard.button(QWizard.WizardButton.FinishButton).click()
    await until(lambda: not wizard.isVisible())
    await until(lambda: app.controller.link_state == "connected")
    await settle(1.0)
    shoot("7-earning")
    return app


async def earn(queen, app: ApiaryApp, model: str) -> None:  # type: ignore[no-untyped-def]
    secret, _ = await funded_key(queen, 20)
    client = queen.client(api_key=secret, timeout=120)
    for prompt in ("Name a colour.", "Name a fruit.", "What do bees make?"):
        await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=24,
            temperature=0)
    await app.earnings.refresh()
    await until(lambda: app.earnings.fresh and app.earnings.earnings.available_msat > 0, 60)
    app.window.show_tab("Jobs")
    await settle()
    shoot("8-jobs")
    app.window.show_tab("Earnings")
    await settle()
    shoot("9-earnings")
    menu = app.tray.menu
    menu.aboutToShow.emit()
    menu.popup(QPoint(1300, 40))
    await settle()
    shoot("10-tray-menu")
    menu.hide()


async def relaunch() -> ApiaryApp:
    """The second day: the same config, read as a fresh launch reads it."""
    app = ApiaryApp(WorkerSettings(), earnings_interval_s=3)
    app.launch()
    app.window.move(420, 60)
    await until(lambda: app.controller.link_state == "connected")
    await settle(1.0)
    shoot("11-relaunch-earning")
    return app


async def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    log.info("tray available: %s", QSystemTrayIcon.isSystemTrayAvailable())
    async with running_queen(TMP, auth="keys", escrow_jobs=0, first_token_timeout_s=60,
                             total_timeout_s=120) as queen:
        # nothing listens at the hub's address: offline, as the walk is meant to be
        app = await first_launch(queen, WorkerSettings())
        await queen.wait_until(lambda: queen.state.registry.model_names(), 10)
        [model] = queen.state.registry.model_names()
        await earn(queen, app, model)
        await asyncio.wait_for(app.shutdown(), 60)
        app.window.close()
        app.tray.hide()
        await settle()
        again = await relaunch()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(again.shutdown(), 60)
    logging.shutdown()
    os._exit(0)  # the pictures are saved: do not let the servers' teardown hold the script


if __name__ == "__main__":
    qt_app = QApplication(sys.argv)
    qt_app.setQuitOnLastWindowClosed(False)
    loop = qasync.QEventLoop(qt_app)
    asyncio.set_event_loop(loop)
    with loop:
        loop.run_until_complete(main())
