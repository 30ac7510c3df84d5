"""The worker's audit standing in the app: the Earnings tab's line, the header's warning and the
one-time notification, from an earnings answer served over real HTTP on 127.0.0.1.

A stub answers ``/worker/earnings`` with the body each test sets (the signed request is not
checked), so that every shape a queen may send, hostile ones included, reaches the real service
and widgets; the last test reads a real queen's answer."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler
from typing import Any

from PySide6.QtCore import Qt

from desktop_worker.gui.services.audit import NOT_CHECKED, AuditStanding, audit_header_text
from tests.desktop_worker.gui.conftest import open_app, until
from tests.support.http_server import ServedFake, TrackedHTTPServer
from tests.support.queen import running_queen

FLAGGED = {"state": "flagged", "audited": 40, "failed": 6, "payouts_held": True,
           "flagged_reason": "answers far less likely than the model's"}
GOOD = {"state": "good", "audited": 40, "failed": 1, "payouts_held": False,
        "flagged_reason": None}
FLAG_TITLE = "The queen stopped sending you work"


def answer(audit: Any = None, **figures: Any) -> dict[str, Any]:
    """An earnings answer as a paying queen sends it (``audit`` left out when None)."""
    body: dict[str, Any] = {
        "worker_id": "w-1", "jobs_settled": 45, "escrow_jobs_left": 0, "pending_msat": 0,
        "available_msat": 12_000, "paid_msat": 0, "today_msat": 3_000, "total_msat": 12_000,
        "pays_workers": True, "payout_threshold_msat": 1_000_000}
    body.update(figures)
    if audit is not None:
        body["audit"] = audit
    return body


class EarningsStub(ServedFake):
    """``GET /worker/earnings`` answering ``body`` (set by the test, read per request)."""

    name = "earnings-stub"

    def __init__(self, body: dict[str, Any]) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._body = body

    @property
    def body(self) -> dict[str, Any]:
        with self._lock:
            return self._body

    @body.setter
    def body(self, body: dict[str, Any]) -> None:
        with self._lock:
            self._body = body

    @property
    def ws_url(self) -> str:
        assert self._server is not None
        return f"ws://127.0.0.1:{self._server.server_address[1]}/worker"

    def _make_server(self) -> TrackedHTTPServer:
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                found = self.path == "/worker/earnings"
                data = json.dumps(stub.body if found else {"error": {"message": "no"}})
                payload = data.encode()
                self.send_response(200 if found else 404)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *_args: Any) -> None:
                pass

        return TrackedHTTPServer(Handler, self.name)


def flag_notices(app: Any) -> list[Any]:
    return [n for n in app.tray.notices if n.title == FLAG_TITLE]


async def test_a_flagged_worker_is_warned_in_the_tab_the_header_and_once_by_notice(
        settings_for, qtbot):
    with EarningsStub(answer(FLAGGED)) as queen:
        async with open_app(settings_for(queen_url=queen.ws_url),
                            earnings_interval_s=3600) as app:
            app.launch()
            view = app.window.earnings
            await until(lambda: app.earnings.audit is not None, 20, "the audit standing")
            standing = app.earnings.audit
            assert standing.flagged
            assert view.audit.isVisibleTo(view)
            assert view.audit.text() == (
                "This queen has stopped sending you work: checks found answers that did not "
                "match the model (answers far less likely than the model's). 6 of the 40 "
                "answers checked did not match. Your payouts are on hold. If you did not "
                "change the model file or the app, contact the queen's operator.")
            assert "fee2e2" in view.audit.styleSheet()  # the red box, not the quiet line
            header = app.header
            assert header.detail.text() == audit_header_text(standing)
            assert header.detail.text().startswith("This queen has stopped sending you work")
            height = header.detail.height()
            [notice] = flag_notices(app)
            assert notice.message == view.audit.text()
            # Read again: still shown, and not notified twice in one run.
            await app.earnings.refresh()
            assert header.detail.text() == audit_header_text(standing)
            assert len(flag_notices(app)) == 1
            assert header.detail.height() == height  # the header's lines are reserved
            # An admin clears the flag: the reassuring line, the header quiet, and told so.
            queen.body = answer(GOOD)
            await app.earnings.refresh()
            assert view.audit.text() == (
                "Checked 40 answers: 1 did not match, which is normal now and then.")
            assert "fee2e2" not in view.audit.styleSheet()
            assert header.detail.text() == app.controller.not_earning()[0]  # the flag gone
            assert [n.title for n in app.tray.notices].count("Flag cleared") == 1
            assert len(flag_notices(app)) == 1


async def test_a_good_standing_shows_the_reassuring_line(settings_for, qtbot):
    good = {"state": "good", "audited": 14, "failed": 0, "payouts_held": False,
            "flagged_reason": None}
    with EarningsStub(answer(good)) as queen:
        async with open_app(settings_for(queen_url=queen.ws_url),
                            earnings_interval_s=3600) as app:
            app.launch()
            view = app.window.earnings
            await until(lambda: app.earnings.audit is not None, 20, "the audit standing")
            assert view.audit.isVisibleTo(view)
            assert view.audit.text() == "Checked 14 answers: all matched the model."
            assert app.header.detail.text() == app.controller.not_earning()[0]  # no flag
            assert not flag_notices(app)
            # A new worker's standing: not checked yet, said plainly.
            queen.body = answer({"state": "unknown", "audited": 0, "failed": 0,
                                 "payouts_held": False, "flagged_reason": None})
            await app.earnings.refresh()
            assert view.audit.text() == NOT_CHECKED


async def test_an_older_queen_or_an_unreadable_audit_shows_no_line_and_keeps_the_figures(
        settings_for, qtbot):
    with EarningsStub(answer()) as queen:  # an older queen: no audit at all
        async with open_app(settings_for(queen_url=queen.ws_url),
                            earnings_interval_s=3600) as app:
            app.launch()
            view = app.window.earnings
            await until(lambda: view.cards["available"].value.text() == "12 sats", 20,
                        "the figures")
            assert app.earnings.audit is None
            assert not view.audit.isVisibleTo(view)
            for hostile in ("flagged", ["flagged"], {"state": "flagged", "audited": "40",
                                                     "failed": 6},
                            {"state": "flagged", "audited": 3, "failed": 9},
                            {"state": "banned", "audited": 1, "failed": 1}):
                queen.body = answer(hostile, available_msat=13_000)
                assert await app.earnings.refresh() is not None, hostile
                assert app.earnings.fresh
                assert view.cards["available"].value.text() == "13 sats"
                assert app.earnings.audit is None
                assert not view.audit.isVisibleTo(view)
                assert app.header.detail.text() == app.controller.not_earning()[0]  # no flag
                queen.body = answer(available_msat=12_000)
                await app.earnings.refresh()
            assert not flag_notices(app)
            assert "not available" not in view.note.text()


async def test_the_queens_reason_shows_literally_and_stays_short(settings_for, qtbot):
    reason = "<b>bold</b> <img src='http://127.0.0.1:9/x.png'>\n" + "z" * 500
    with EarningsStub(answer(dict(FLAGGED, flagged_reason=reason))) as queen:
        async with open_app(settings_for(queen_url=queen.ws_url),
                            earnings_interval_s=3600) as app:
            app.launch()
            view = app.window.earnings
            await until(lambda: app.earnings.audit is not None, 20, "the audit standing")
            assert view.audit.textFormat() == Qt.TextFormat.PlainText
            assert "(<b>bold</b> <img src='http://127.0.0.1:9/x.png'> zzz" in view.audit.text()
            assert len(app.earnings.audit.flagged_reason) == 160
            assert "\n" not in view.audit.text()


async def test_another_queens_flag_is_not_shown(settings_for, qtbot):
    with EarningsStub(answer(FLAGGED)) as queen:
        async with open_app(settings_for(queen_url=queen.ws_url),
                            earnings_interval_s=3600) as app:
            app.launch()
            await until(lambda: app.header.detail.text() != "", 20, "the flag")
            # The owner moves to another queen: its standing is unknown until it answers.
            app.settings_service.update(queen_url="ws://127.0.0.1:9/worker")
            assert app.earnings.audit is None
            assert app.header.detail.text() == app.controller.not_earning()[0]  # no flag
            assert not app.window.earnings.audit.isVisibleTo(app.window.earnings)


async def test_quit_right_after_a_poke_stops_the_poller(settings_for, qtbot):
    """A settings change pokes the poller; Quit right after must still end it. (With
    ``asyncio.wait_for`` on Python 3.11 the cancel was swallowed as the poke woke it, and
    Quit waited forever.)"""
    with EarningsStub(answer()) as queen:
        async with open_app(settings_for(queen_url=queen.ws_url),
                            earnings_interval_s=3600) as app:
            app.launch()
            await until(lambda: app.earnings.fresh, 20, "the first read")
            app.settings_service.update(queen_url="ws://127.0.0.1:9/worker")  # pokes
            async with asyncio.timeout(5):
                await app.earnings.stop()


async def test_a_new_worker_on_a_real_queen_is_not_checked_yet(tmp_path, settings_for, qtbot):
    """The real queen's answer, signed request and all: a worker it has never audited."""
    async with (running_queen(tmp_path, auth="keys") as queen,
                open_app(settings_for(queen_url=queen.ws_url),
                         earnings_interval_s=3600) as app):
        app.launch()
        view = app.window.earnings
        await until(lambda: app.earnings.audit is not None, 20, "the audit standing")
        assert app.earnings.audit == AuditStanding("unknown", 0, 0, False, None)
        assert view.audit.text() == NOT_CHECKED
        assert app.header.detail.text() == app.controller.not_earning()[0]  # no flag
