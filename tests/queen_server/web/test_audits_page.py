"""The admin Audits page: the standings (flagged first, in plain words), a flagged worker's
evidence and its Clear flag button, end to end in Chromium against a real queen; then the
button's form over HTTP, where every forged or stale post is refused and changes nothing."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from html import unescape
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.async_api import Browser, expect

from queen_server.audits.decision import Standing
from queen_server.audits.store import Record
from queen_server.identity import public_id
from queen_server.web import SESSION_COOKIE
from tests.queen_server.web.support import ADMIN_TOKEN, log_in, new_page, queen_with_pages
from tests.support.queen import QueenHarness

EVIL = "https://evil.example"
CHEAT = "c" * 64  # worker keys are hex public keys
HONEST = "a" * 64
AUDITOR = "d" * 64


def audit(request_id: str, *, failed: bool, trusted: bool = True) -> dict[str, Any]:
    """One audited job's row, as the audit service writes it."""
    return {"request_id": request_id, "auditor_key": AUDITOR, "auditor_trusted": trusted,
            "model": "echo-model", "sha256": None, "temperature": 0.7, "answer_tokens": 8,
            "claimed_tokens": 40 if failed else 8, "positions": 8,
            "mismatches": 6 if failed else 0, "z": -5.25 if failed else 0.1,
            "suspicion": 4.0 if failed else 0.0, "failed": failed,
            "reason": "scores far below the model's" if failed else "", "key_id": None,
            "charged_msat": 12_000, "refunded": False, "audit_tokens": 28, "audit_s": 0.5}


async def flag_a_cheat(queen: QueenHarness) -> None:
    """An honest worker and a flagged one, with the audits that judged them."""
    store = queen.state.audits.store
    assert store is not None
    await store.save(HONEST, Record(Standing(audited=1, state="good")),
                     audit("req-honest", failed=False))
    await store.save(CHEAT, Record(Standing(audited=2, failed=1, reasons=("x",))),
                     audit("req-cheat-1", failed=True, trusted=False))
    await store.save(CHEAT, Record(Standing(llr=3.5, audited=3, failed=2, state="flagged",
                                            reasons=("x", "y")),
                                   flags=1, flagged_at=datetime.now(UTC)),
                     audit("req-cheat-2", failed=True))


# --- in Chromium ------------------------------------------------------------------------------

async def test_a_flag_is_shown_with_its_evidence_and_cleared_from_the_page(
        tmp_path: Path, browser: Browser) -> None:
    errors: list[str] = []
    async with queen_with_pages(tmp_path) as queen:
        await flag_a_cheat(queen)
        page = await new_page(browser, errors)
        await log_in(page, queen.base_url, then="/admin/audits")
        await expect(page.locator("h1")).to_have_text("Audits")
        await expect(page.locator("nav a.active")).to_have_text("Audits")
        await expect(page.locator("#audits-summary")).to_contain_text("Audits are on")

        # Flagged first, in plain words.
        rows = page.locator("#standings tbody tr")
        await expect(rows).to_have_count(2)
        await expect(rows.nth(0)).to_have_attribute("data-key", public_id(CHEAT))
        await expect(rows.nth(0).locator("td").nth(1)).to_have_text(
            "Flagged: gets no work, payouts held")
        await expect(rows.nth(1).locator("td").nth(1)).to_have_text("Passed its audits")

        # The evidence: both failed jobs, neither passed one; who audited and what they found.
        flagged = page.locator(f"#flagged-{public_id(CHEAT)}")
        evidence = flagged.locator("table.evidence tbody tr")
        await expect(evidence).to_have_count(2)
        await expect(evidence.nth(0).locator("td").nth(0)).to_have_text("req-cheat-2")
        await expect(evidence.nth(0).locator("td").nth(1)).to_have_text(
            f"{public_id(AUDITOR)} (trusted)")
        await expect(evidence.nth(1).locator("td").nth(1)).to_contain_text("(not trusted)")
        await expect(evidence.nth(0).locator("td").nth(3)).to_have_text("40 / 8")
        await expect(evidence.nth(0).locator("td").nth(4)).to_have_text("— / —")  # older rows
        await expect(evidence.nth(0).locator("td").nth(5)).to_have_text("-5.25")
        await expect(evidence.nth(0).locator("td").nth(8)).to_have_text("12")
        assert "req-honest" not in await flagged.inner_text()

        # The recent audits poll the JSON: all three, newest first.
        recent = page.locator("#recent tbody tr")
        await expect(recent).to_have_count(3)
        await expect(page.locator("#live-status")).to_be_visible()

        messages: list[str] = []

        async def accept(dialog: Any) -> None:
            messages.append(dialog.message)
            await dialog.accept()

        page.once("dialog", accept)
        await flagged.locator("button[type=submit]").click()
        await expect(page.locator("#audits-notice")).to_contain_text(
            f"Cleared worker {public_id(CHEAT)}'s flag")
        assert messages
        assert messages[0].startswith("Clear this worker's flag?")
        assert page.url == queen.base_url + "/admin/audits"
        assert queen.state.audits.standing(CHEAT).state == "unknown"
        await expect(page.locator(f"#flagged-{public_id(CHEAT)}")).to_have_count(0)
        await expect(rows.nth(0).locator("td").nth(1)).not_to_have_text(
            "Flagged: gets no work, payouts held")

        # The notice is shown once.
        await page.reload()
        await expect(page.locator("#audits-notice")).to_have_count(0)
    assert not errors, errors


# --- over HTTP --------------------------------------------------------------------------------

class Admin:
    """A logged-in admin's HTTP client, posting the Clear flag form as the page would."""

    def __init__(self, http: httpx.AsyncClient, base: str) -> None:
        self.http = http
        self.base = base
        self.csrf = ""

    async def load(self) -> httpx.Response:
        page = await self.http.get("/admin/audits")
        found = re.search(r'name="csrf" value="([^"]*)"', page.text)
        assert found is not None, page.text[:500]
        self.csrf = found.group(1)
        return page

    async def clear(self, worker: str, headers: dict[str, str] | None = None,
                    csrf: str | None = None) -> httpx.Response:
        return await self.http.post(f"/admin/audits/{worker}/clear",
                                    data={"csrf": self.csrf if csrf is None else csrf},
                                    headers={"origin": self.base, **(headers or {})})


def error_of(response: httpx.Response) -> str:
    found = re.search(r'id="audits-error">([^<]*)<', response.text)
    assert found is not None, response.text[:500]
    return unescape(found.group(1))


@pytest.fixture
async def admin(tmp_path: Path) -> AsyncIterator[tuple[QueenHarness, Admin]]:
    async with (queen_with_pages(tmp_path) as queen,
                httpx.AsyncClient(base_url=queen.base_url, trust_env=False) as http):
        await flag_a_cheat(queen)
        await http.post("/admin/login", data={"token": ADMIN_TOKEN, "next": "/admin"})
        assert SESSION_COOKIE in http.cookies
        page = Admin(http, queen.base_url)
        await page.load()
        yield queen, page


def state(queen: QueenHarness) -> str:
    return queen.state.audits.standing(CHEAT).state


async def flagged(queen: QueenHarness) -> str:
    store = queen.state.audits.store
    assert store is not None
    return (await store.record(CHEAT)).standing.state


async def test_the_page_shows_the_flag_and_its_evidence(
        admin: tuple[QueenHarness, Admin]) -> None:
    _, page = admin
    html = (await page.load()).text
    assert html.index(public_id(CHEAT)) < html.index(public_id(HONEST))  # flagged first
    assert "Flagged: gets no work, payouts held" in html
    assert "req-cheat-1" in html
    assert "req-cheat-2" in html
    assert f'action="/admin/audits/{public_id(CHEAT)}/clear"' in html
    assert html.count('class="clear-flag"') == 1  # only the flagged worker has a button


async def test_clear_flag_redirects_back_and_the_worker_is_unknown_again(
        admin: tuple[QueenHarness, Admin]) -> None:
    queen, page = admin
    cleared = await page.clear(public_id(CHEAT))
    assert cleared.status_code == 303
    assert cleared.headers["location"] == "/admin/audits"
    assert await flagged(queen) == "unknown"
    assert state(queen) == "unknown"
    shown = await page.http.get("/admin/audits")
    assert f"Cleared worker {public_id(CHEAT)}&#39;s flag" in shown.text
    assert 'class="clear-flag"' not in shown.text
    # Cleared twice (a second tab): the 404's message, on the page.
    again = await page.clear(public_id(CHEAT))
    assert again.status_code == 404
    assert error_of(again) == f"No flagged worker {public_id(CHEAT)}."


async def test_an_unknown_or_honest_worker_is_not_cleared(
        admin: tuple[QueenHarness, Admin]) -> None:
    queen, page = admin
    for worker in ("nobody", public_id(HONEST)):
        refused = await page.clear(worker)
        assert refused.status_code == 404
        assert error_of(refused) == f"No flagged worker {worker}."
    assert await flagged(queen) == "flagged"


async def test_forged_clear_forms_are_refused_and_change_nothing(
        admin: tuple[QueenHarness, Admin]) -> None:
    queen, page = admin
    worker = public_id(CHEAT)
    for csrf in ("", "0" * 64):
        refused = await page.clear(worker, csrf=csrf)
        assert refused.status_code == 403
        assert "Nothing was changed" in error_of(refused)
    for headers in ({"origin": EVIL}, {"origin": "null"},
                    {"origin": queen.base_url.replace("127.0.0.1", "localhost")}):
        refused = await page.clear(worker, headers=headers)
        assert refused.status_code == 403, headers
        assert refused.json()["error"]["code"] == "cross_origin_request"
    bare = await page.http.post(f"/admin/audits/{worker}/clear", data={"csrf": page.csrf})
    assert bare.status_code == 403  # neither Origin nor Referer
    async with httpx.AsyncClient(base_url=queen.base_url, trust_env=False) as script:
        # The bearer token alone has no session, so no form token: scripts use the API.
        scripted = await script.post(f"/admin/audits/{worker}/clear", data={"csrf": page.csrf},
                                     headers={"authorization": f"Bearer {ADMIN_TOKEN}"})
        assert scripted.status_code == 403
        # Not logged in: to the login page, for the page and its form alike.
        anonymous = await script.post(f"/admin/audits/{worker}/clear", data={"csrf": page.csrf})
        assert anonymous.status_code == 303
        assert anonymous.headers["location"].startswith("/admin/login")
        shown = await script.get("/admin/audits")
        assert shown.status_code == 303
        assert shown.headers["location"] == "/admin/login?next=%2Fadmin%2Faudits"
    assert await flagged(queen) == "flagged"
    assert (await page.clear(worker)).status_code == 303  # the real form still works


async def test_a_queen_with_no_audits_yet_shows_an_empty_page(tmp_path: Path) -> None:
    async with (queen_with_pages(tmp_path) as queen,
                httpx.AsyncClient(base_url=queen.base_url, trust_env=False) as http):
        await http.post("/admin/login", data={"token": ADMIN_TOKEN, "next": "/admin"})
        shown = await http.get("/admin/audits")
        assert shown.status_code == 200
        assert "No worker has been audited yet." in shown.text
        assert "No audits yet." in shown.text
