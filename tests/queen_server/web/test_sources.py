"""Each page shows what its JSON route answers: both come from one report
(``queen_server.reports``), which the page calls itself (no request to its own app), and a
report's error becomes the page's status."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from fastapi import Request

from queen_server.billing import ledger
from queen_server.errors import NotFound, Unauthorized
from queen_server.identity import public_id
from queen_server.payouts.lightning import NoneBackend
from queen_server.payouts.runner import PayoutRunner
from queen_server.web import pages
from tests.queen_server.billing.test_billing_api import funded_key
from tests.queen_server.web.support import ADMIN_TOKEN, chat, queen_with_pages
from tests.support.workers import ECHO_MODEL, ScriptedWorker

ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}
PAGE_DATA = re.compile(r'<script type="application/json" id="page-data">(.*?)</script>', re.S)
SOURCE = re.compile(r'data-source="([^"]+)"')


def page_data(html: str) -> tuple[str, Any]:
    """A page's JSON source and the data it was rendered from (embedded for app.js)."""
    source, data = SOURCE.search(html), PAGE_DATA.search(html)
    assert source is not None
    assert data is not None
    return source.group(1), json.loads(data.group(1))


async def test_every_page_shows_what_its_json_route_answers(tmp_path: Path) -> None:
    # Nothing here is about heartbeats, and every table must have its worker's rows: a worker
    # silent through one long pause of a loaded full run (its loop is the test's) is not
    # dropped. A full CI run once read /admin/models empty, here only, never alone.
    async with queen_with_pages(tmp_path, auth="keys", escrow_jobs=0,
                                heartbeat_misses=1000) as queen:
        worker = await ScriptedWorker(queen.ws_url).start()
        try:
            wid = public_id(worker.pubkey)
            secret, key_id = await funded_key(queen, 50)
            await chat(queen, ECHO_MODEL, api_key=secret, count=3)
            # A payout is reserved only out of what the worker has (issue 39): give it a sat.
            await queen.state.billing.ledger.post(ledger.Posting("test:earned", "settle", (
                (ledger.key_available(key_id), -1000),
                (ledger.worker_available(worker.pubkey), 1000))))
            await PayoutRunner(queen.state.settings, queen.state.db.engine,
                               queen.state.billing.ledger, NoneBackend(), None).pay(
                worker.pubkey, 1000, "worker@example.com")
            # Stop the stats' clock, so that uptimes and rates are the same on both reads.
            frozen = queen.state.stats.clock()
            queen.state.stats.clock = lambda: frozen
            pairs = {"/": "/stats", "/admin": "/admin/api/overview",
                     "/admin/workers": "/admin/api/workers",
                     f"/admin/workers/{wid}": f"/admin/api/workers/{wid}",
                     "/admin/models": "/admin/api/models", "/admin/jobs": "/admin/api/jobs",
                     "/admin/api-keys": "/admin/keys", "/admin/payouts": "/admin/api/payouts"}
            async with httpx.AsyncClient(base_url=queen.base_url, trust_env=False,
                                         headers=ADMIN) as http:
                for page, route in pairs.items():
                    html = await http.get(page)
                    answer = await http.get(route)
                    assert (html.status_code, answer.status_code) == (200, 200), page
                    assert page_data(html.text) == (route, answer.json()), page
                    assert answer.json(), page  # something to compare: no empty tables
                missing_page = await http.get("/admin/workers/nosuchworker")
                missing = await http.get("/admin/api/workers/nosuchworker")
        finally:
            await worker.stop()
    assert (missing_page.status_code, missing.status_code) == (404, 404)
    assert "Unknown worker" in missing_page.text
    assert missing.json()["error"]["code"] == "worker_not_found"


def request_for(state: Any) -> Request:
    app = SimpleNamespace(state=SimpleNamespace(queen=state))
    return Request({"type": "http", "app": app, "method": "GET", "scheme": "http",
                    "server": ("queen", 80), "path": "/admin/page", "root_path": "",
                    "query_string": b"", "headers": []})


async def test_load_gives_the_json_of_a_report_or_the_status_of_its_error(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    state = object()
    request = request_for(state)

    async def answers(given: Any) -> Any:
        assert given is state
        return {"pair": (1, 2.5), "none": None, "nan": math.nan}

    async def unknown(_state: Any) -> Any:
        raise NotFound("No worker x.", code="worker_not_found")

    async def refused(_state: Any) -> Any:
        raise Unauthorized("No.")

    async def broken(_state: Any) -> Any:
        raise RuntimeError("the report broke")

    async def stuck(_state: Any) -> Any:
        await asyncio.Event().wait()

    # As the JSON route would send it: tuples become lists, NaN becomes null.
    assert await pages.load(request, "/src", answers) == (
        200, {"pair": [1, 2.5], "none": None, "nan": None})
    with caplog.at_level(logging.WARNING, logger=pages.__name__):
        assert await pages.load(request, "/src", unknown) == (404, None)
        assert caplog.records == []  # a 404 is the page's own answer, not a problem
        assert await pages.load(request, "/src", refused) == (401, None)
        assert await pages.load(request, "/src", broken) == (0, None)
        monkeypatch.setattr(pages, "LOAD_TIMEOUT_S", 0.01)
        assert await pages.load(request, "/src", stuck) == (0, None)
    assert [r.getMessage() for r in caplog.records] == [
        "page /admin/page: /src answered 401", "page /admin/page: loading /src failed",
        "page /admin/page: loading /src failed"]
