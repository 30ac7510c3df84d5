"""The wizard's "Which queen?" step: the address normalised as typed, and "Test connection" doing
the real handshake (a real queen on 127.0.0.1, a closed port, a server that is not a queen, a
queen of another protocol version, a refusal), each outcome in plain words. The field starts
empty with a placeholder unless the install names its queen (``default-queen.txt``), and a
failed test holds Next until the address changes or a test passes."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from PySide6.QtWidgets import QWizard
from websockets.asyncio.server import ServerConnection, serve

from desktop_worker.gui.services.first_run import QUEEN_PLACEHOLDER, QUEEN_TEST_NOTE
from desktop_worker.gui.wizard import QueenPage
from desktop_worker.link_probe import ProbeResult
from desktop_worker.resources import resources_dir
from desktop_worker.settings import DEVELOPER_QUEEN_URL, default_queen_url
from queen_server.identity import public_id
from tests.desktop_worker.gui.conftest import open_app
from tests.support.queen import running_queen

NONCE = "ab" * 16


def closed_port() -> int:
    """A port nothing listens on: bound, read, closed."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def next_page(wizard: QWizard) -> None:
    wizard.button(QWizard.WizardButton.NextButton).click()


async def to_queen_page(app) -> QueenPage:
    app.launch()
    wizard = app.wizard
    next_page(wizard)
    assert wizard.currentPage() is wizard.queen
    return wizard.queen


@contextlib.asynccontextmanager
async def stub_server(handler: Callable[[ServerConnection], Awaitable[None]],
                      **kwargs: Any) -> AsyncIterator[str]:
    async with serve(handler, "127.0.0.1", 0, **kwargs) as server:
        port = server.sockets[0].getsockname()[1]
        yield f"ws://127.0.0.1:{port}/worker"


async def test_test_connection_against_a_real_queen(tmp_path, settings_for, qtbot):
    async with (running_queen(tmp_path) as queen,
                open_app(settings_for(first_run_done=False)) as app):
        page = await to_queen_page(app)
        # Pasted as the queen's landing page shows it: http://host:port/ with spaces.
        page.edit.setText(f"  http://127.0.0.1:{queen.port}/ ")
        assert page.url == queen.ws_url
        assert queen.ws_url in page.verdict.text()
        assert page.isComplete()
        outcome = await page.run_test()
        assert outcome is not None
        assert outcome.ok, outcome
        assert page.result.text().startswith("✓ connected")
        assert outcome.worker_id
        assert outcome.worker_id in page.result.text()
        # The handshake was the real one: the queen verified this worker's signed hello and
        # named it by its key.
        assert outcome.worker_id == public_id(app.identity().pubkey)
        # Finishing saves the normalised URL.
        next_page(app.wizard)
        assert app.wizard.currentPage() is app.wizard.hardware


async def test_test_connection_to_a_closed_port_says_nothing_is_listening(settings_for, qtbot):
    port = closed_port()
    async with open_app(settings_for(first_run_done=False)) as app:
        page = await to_queen_page(app)
        page.edit.setText(f"127.0.0.1:{port}")
        outcome = await page.run_test()
        assert outcome is not None
        assert not outcome.ok
        assert outcome.kind == "refused"
        assert f"nothing is listening at 127.0.0.1:{port}" in page.result.text()
        assert page.result.text().startswith("✗ ")
        assert "Errno" not in page.result.text()


async def test_garbage_blocks_next_with_the_expected_form(settings_for, qtbot):
    async with open_app(settings_for(first_run_done=False)) as app:
        page = await to_queen_page(app)
        page.edit.setText("ftp://queen.example")
        assert not page.isComplete()
        assert not app.wizard.button(QWizard.WizardButton.NextButton).isEnabled()
        assert not page.test.isEnabled()
        assert "wss://queen.example.com/worker" in page.verdict.text()
        page.edit.setText("queen.example")
        assert page.url == "wss://queen.example/worker"
        assert app.wizard.button(QWizard.WizardButton.NextButton).isEnabled()


async def test_without_default_queen_txt_the_field_starts_empty_with_a_placeholder(
        settings_for, qtbot):
    assert not (resources_dir() / "default-queen.txt").exists()  # a source checkout
    assert default_queen_url() == DEVELOPER_QUEEN_URL
    async with open_app(settings_for(queen_url=default_queen_url(),
                                     first_run_done=False)) as app:
        page = await to_queen_page(app)
        assert page.edit.text() == ""  # never the developer's ws://127.0.0.1:8000/worker
        assert page.edit.placeholderText() == QUEEN_PLACEHOLDER
        assert "Paste the address its operator gave you" in page.verdict.text()
        assert page.url is None
        assert not app.wizard.button(QWizard.WizardButton.NextButton).isEnabled()
        assert not page.test.isEnabled()
        assert page.note.text() == QUEEN_TEST_NOTE  # the page says testing is optional


async def test_default_queen_txt_still_fills_the_field(settings_for, qtbot, tmp_path,
                                                       monkeypatch):
    """An installer built for one queen (resources/default-queen.txt) shows it first."""
    resources = tmp_path / "resources"
    resources.mkdir()
    (resources / "icons").symlink_to(resources_dir() / "icons")
    (resources / "default-queen.txt").write_text("# the operator's queen\nqueen.example\n")
    monkeypatch.setenv("APIARY_RESOURCES_DIR", str(resources))
    async with open_app(settings_for(queen_url=default_queen_url(),
                                     first_run_done=False)) as app:
        page = await to_queen_page(app)
        assert page.edit.text() == "wss://queen.example/worker"
        assert page.url == "wss://queen.example/worker"
        assert app.wizard.button(QWizard.WizardButton.NextButton).isEnabled()  # untested: ok


async def test_a_failed_test_holds_next_until_the_address_changes(tmp_path, settings_for, qtbot):
    port = closed_port()
    async with (running_queen(tmp_path) as queen,
                open_app(settings_for(first_run_done=False)) as app):
        page = await to_queen_page(app)
        next_button = app.wizard.button(QWizard.WizardButton.NextButton)
        page.edit.setText(f"127.0.0.1:{port}")
        assert next_button.isEnabled()  # not tested yet: may go on
        outcome = await page.run_test()
        assert outcome is not None
        assert not outcome.ok
        assert not page.isComplete()
        assert not next_button.isEnabled()
        assert "Next waits until you change the address" in page.result.text()
        page.edit.setText(f" 127.0.0.1:{port} ")  # the same address: still held
        assert not next_button.isEnabled()
        page.edit.setText(f"127.0.0.1:{queen.port}")  # another address: untested, may go on
        assert next_button.isEnabled()
        assert page.result.text() == ""
        outcome = await page.run_test()
        assert outcome is not None
        assert outcome.ok
        assert next_button.isEnabled()
        next_page(app.wizard)
        assert app.wizard.currentPage() is app.wizard.hardware


async def test_a_test_that_passes_after_one_failed_lets_the_owner_on(qtbot):
    """The same address, a queen that was down and is up now (the tester is the page's seam)."""
    answers = [ProbeResult(False, "nothing is listening at queen.example:443", "refused"),
               ProbeResult(True, "connected (worker id abc)")]

    async def tester(_url: str) -> ProbeResult:
        return answers.pop(0)

    page = QueenPage("queen.example", tester)
    qtbot.addWidget(page)
    assert page.isComplete()
    await page.run_test()
    assert not page.isComplete()
    await page.run_test()
    assert page.isComplete()
    assert page.result.text() == "✓ connected (worker id abc)"
