"""The pages in real headless Chromium, against a real queen with connected scripted workers:
the landing page, the admin login, and the admin pages rendering the workers and updating their
numbers live as requests go through the queen."""

from __future__ import annotations

import asyncio
import contextlib
import io
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from playwright.async_api import Browser, Page, expect

from queen_server.billing import ledger
from queen_server.identity import public_id
from queen_server.payouts.lightning import NoneBackend
from queen_server.payouts.runner import PayoutRunner
from queen_server.web import SESSION_COOKIE
from tests.queen_server.billing.test_billing_api import funded_key
from tests.queen_server.web.support import (
    ADMIN_TOKEN,
    GpuWorker,
    chat,
    log_in,
    new_page,
    queen_with_pages,
)
from tests.support.fake_hub import FakeHub, pricing_repos
from tests.support.queen import QueenHarness
from tests.support.workers import ECHO_MODEL, ScriptedWorker

ALPHA = "test-org/alpha-GGUF:Q4_K_M"
BETA = "test-org/beta-GGUF:Q4_K_M"
GAMMA = "other-org/gamma-GGUF:Q8_0"


@contextlib.asynccontextmanager
async def workers(*started: ScriptedWorker) -> AsyncIterator[list[ScriptedWorker]]:
    running = [await worker.start() for worker in started]
    try:
        yield running
    finally:
        for worker in running:
            await worker.stop()


async def expect_order(page: Page, table: str, keys: list[str]) -> None:
    """The table's visible rows, in this order (retried until it holds)."""
    rows = page.locator(f"#{table} tbody tr:visible")
    await expect(rows).to_have_count(len(keys))
    for i, key in enumerate(keys):
        await expect(rows.nth(i)).to_have_attribute("data-key", key)



def numeric_collation(text: str) -> list[tuple[int, int | str]]:
    """The order the page's tables sort text in (``localeCompare`` with ``numeric``: runs of
    digits by their value, before letters): a public id may start with digits."""
    return [(0, int(run)) if run.isdigit() else (1, run.lower())
            for run in re.findall(r"\d+|\D+", text)]

async def test_landing_page_shows_the_swarm_models_prices_and_a_working_sdk_example(
        web_queen: QueenHarness, browser: Browser) -> None:
    errors: list[str] = []
    async with workers(GpuWorker(web_queen.ws_url, gpus=[("NVIDIA GeForce RTX 4090", 24564)])):
        page = await new_page(browser, errors)
        await page.goto(web_queen.base_url + "/")
        models = page.locator("#models tbody tr")
        await expect(models).to_have_count(1)
        row = page.locator(f'#models tbody tr[data-key="{ECHO_MODEL}"]')
        # 135M parameters: the "tiny" class, 100 and 200 msat per 1k tokens; and why (issue 35).
        await expect(row.locator("td")).to_have_text([
            ECHO_MODEL, "1", "tiny", "0.1", "0.2",
            "unverified: the queen could not read this model's file on the hub, so it is priced "
            "as the tiny class, this queen's class for unverified models"])
        await expect(page.locator('[data-field="workers_online"]')).to_have_text("1")
        await expect(page.locator('[data-kind="gpu_share"]')).to_have_text("1 with a GPU")
        await expect(page.locator('[data-field="vram_total_mb"]')).to_have_text("24.0 GB")

        base = web_queen.base_url
        sdk = page.locator("#sdk-example")
        await expect(sdk).to_contain_text(f'base_url="{base}/v1"')
        await expect(sdk).to_contain_text(f'model="{ECHO_MODEL}"')
        curl = page.locator("#curl-example")
        await expect(curl).to_contain_text(f"curl {base}/v1/chat/completions")
        await expect(curl).to_contain_text(f'"model": "{ECHO_MODEL}"')

        # The snippet, as copied from the page, runs against this queen (in a thread: the
        # sync SDK must not block the queen's event loop).
        snippet = await sdk.text_content()
        assert snippet is not None
        printed = io.StringIO()

        def run_snippet() -> None:
            with contextlib.redirect_stdout(printed):
                exec(snippet, {})

        await asyncio.to_thread(run_snippet)
        assert printed.getvalue().strip() == "echo: What color is the sky?"

        # Live: a new worker with another model shows up without a reload.
        async with workers(ScriptedWorker(web_queen.ws_url, models=[GAMMA])):
            await expect(models).to_have_count(2)
            await expect(page.locator('[data-field="workers_online"]')).to_have_text("2")
            await expect(page.locator('[data-kind="gpu_share"]')).to_have_text("1 with a GPU")
            await expect(page.locator(f'#models tbody tr[data-key="{GAMMA}"]')).to_be_visible()
        await expect(page.locator('[data-field="workers_online"]')).to_have_text("1")
        await expect(models).to_have_count(1)
    assert errors == []


async def test_login_rejects_a_wrong_token_and_accepts_the_right_one(
        web_queen: QueenHarness, browser: Browser) -> None:
    errors: list[str] = []
    page = await new_page(browser, errors)
    base = web_queen.base_url
    await page.goto(base + "/admin/workers")
    await expect(page).to_have_url(f"{base}/admin/login?next=%2Fadmin%2Fworkers")

    await page.fill("#token", "not-" + ADMIN_TOKEN)
    await page.click("button[type=submit]")
    await expect(page.locator("#login-error")).to_have_text("That is not the admin token.")
    assert not [c for c in await page.context.cookies() if c["name"] == SESSION_COOKIE]
    response = await page.request.get(base + "/admin/api/workers")
    assert response.status == 401

    await page.fill("#token", ADMIN_TOKEN)
    await page.click("button[type=submit]")
    await expect(page).to_have_url(base + "/admin/workers")
    await expect(page.locator("h1")).to_have_text("Workers")
    cookie = next(c for c in await page.context.cookies() if c["name"] == SESSION_COOKIE)
    assert cookie["httpOnly"] is True
    assert cookie["sameSite"] == "Lax"
    assert 12 * 3600 - 60 < cookie["expires"] - time.time() <= 12 * 3600
    assert ADMIN_TOKEN not in cookie["value"]
    # The admin JSON takes the same session.
    response = await page.request.get(base + "/admin/api/workers")
    assert response.status == 200
    # Already logged in: the login page sends you on.
    await page.goto(base + "/admin/login")
    await expect(page).to_have_url(base + "/admin")

    await page.click(".logout button")
    await expect(page).to_have_url(base + "/admin/login")
    assert not [c for c in await page.context.cookies() if c["name"] == SESSION_COOKIE]
    await page.goto(base + "/admin/models")
    await expect(page).to_have_url(f"{base}/admin/login?next=%2Fadmin%2Fmodels")
    # The only error: the wrong token's answer, a 401.
    assert errors == ["Failed to load resource: the server responded with a status of 401 "
                      "(Unauthorized)"]


async def test_admin_pages_redirect_to_the_login_when_logged_out(
        web_queen: QueenHarness, browser: Browser) -> None:
    paths = ["/admin", "/admin/workers", "/admin/workers/abcdefghijkl", "/admin/models",
             "/admin/jobs", "/admin/api-keys", "/admin/payouts"]
    page = await new_page(browser)
    for path in paths:
        await page.goto(web_queen.base_url + path)
        await expect(page).to_have_url(re.compile(r"/admin/login\?next="))
        await expect(page.locator("#token")).to_be_visible()
    # A cookie that is not the queen's signature is no session.
    await page.context.add_cookies([{"name": SESSION_COOKIE, "value": "eyJhZG1pbiI6dHJ1ZX0.x.y",
                                     "url": web_queen.base_url}])
    await page.goto(web_queen.base_url + "/admin")
    await expect(page).to_have_url(re.compile(r"/admin/login\?next="))


async def test_workers_table_lists_public_ids_sorts_filters_and_updates_live(
        web_queen: QueenHarness, browser: Browser) -> None:
    errors: list[str] = []
    started = [
        GpuWorker(web_queen.ws_url, models=[ALPHA], version="0.4.1",
                  gpus=[("NVIDIA GeForce RTX 3090", 24576)] * 2),
        GpuWorker(web_queen.ws_url, models=[BETA], version="0.4.0",
                  gpus=[("NVIDIA GeForce RTX 4090", 24564)]),
        GpuWorker(web_queen.ws_url, models=[GAMMA], version="0.3.9"),
    ]
    async with workers(*started) as (alpha, beta, gamma):
        ids = {w: public_id(w.pubkey) for w in (alpha, beta, gamma)}
        await chat(web_queen, ALPHA, count=3)
        await chat(web_queen, BETA, count=1)

        page = await new_page(browser, errors)
        await log_in(page, web_queen.base_url, then="/admin/workers")
        await expect(page.locator("#workers tbody tr")).to_have_count(3)
        row = page.locator(f'#workers tbody tr[data-key="{ids[alpha]}"]')
        await expect(row.locator("td")).to_have_text(
            [ids[alpha], "0.4.1", "2\u00d7 NVIDIA GeForce RTX 3090", "48.0 GB",
             "alpha-GGUF:Q4_K_M", re.compile(r"^(<0\.0001|[0-9.]+)$"),
             "\u2014",  # s/MP-step: it rendered no image
             "3", "0.0%", "0", re.compile(r"^\d+s$"), "online"])
        await expect(row.locator("a")).to_have_attribute("href", f"/admin/workers/{ids[alpha]}")
        html = await page.content()
        for worker in (alpha, beta, gamma):
            assert ids[worker] in html
            assert worker.pubkey not in html  # never a worker's full key

        # Sort by jobs (numbers), both ways, then by worker id (text).
        jobs = page.locator("th[data-key=jobs]")
        await jobs.click()
        await expect(jobs).to_have_attribute("aria-sort", "ascending")
        await expect_order(page, "workers", [ids[gamma], ids[beta], ids[alpha]])
        await jobs.click()
        await expect(jobs).to_have_attribute("aria-sort", "descending")
        await expect_order(page, "workers", [ids[alpha], ids[beta], ids[gamma]])
        await page.click("th[data-key=public_id]")
        await expect_order(page, "workers", sorted(ids.values(), key=numeric_collation))

        # Filter by a model (its full name, owner included), by an id, by a GPU.
        search = page.locator("#workers-filter")
        await search.fill("test-org/beta")
        await expect_order(page, "workers", [ids[beta]])
        await expect(page.locator('[data-count-for="workers"]')).to_have_text("1 of 3 rows")
        await search.fill(ids[gamma][:8].upper())
        await expect_order(page, "workers", [ids[gamma]])
        await search.fill("rtx")
        await expect_order(page, "workers", sorted([ids[alpha], ids[beta]], key=numeric_collation))
        await search.fill("no such worker")
        await expect(page.locator("#workers tbody tr:visible")).to_have_count(0)
        await expect(page.locator('[data-empty-for="workers"]')).to_have_text(
            "No rows match the filter.")
        await search.fill("")

        # Live: sorted by jobs, most first; gamma's jobs go up and it moves to the top.
        await jobs.click()
        await jobs.click()
        await expect_order(page, "workers", [ids[alpha], ids[beta], ids[gamma]])
        await chat(web_queen, GAMMA, count=5)
        gamma_jobs = page.locator(f'#workers tbody tr[data-key="{ids[gamma]}"] td').nth(7)
        await expect(gamma_jobs).to_have_text("5")
        await expect_order(page, "workers", [ids[gamma], ids[alpha], ids[beta]])

        # A worker that leaves stays listed, offline.
        await beta.stop()
        status = page.locator(f'#workers tbody tr[data-key="{ids[beta]}"] td').nth(11)
        await expect(status).to_have_text("offline")
        await expect(status.locator(".badge")).to_have_class("badge bad")
    assert errors == []


async def test_overview_numbers_and_charts_update_live(
        web_queen: QueenHarness, browser: Browser) -> None:
    errors: list[str] = []
    async with workers(GpuWorker(web_queen.ws_url, models=[ALPHA])):
        await chat(web_queen, ALPHA, count=2)
        page = await new_page(browser, errors)
        await log_in(page, web_queen.base_url)
        jobs_card = page.locator('[data-field="series"][data-agg="sum:jobs"]')
        workers_card = page.locator('[data-field="stats.workers_online"]')
        await expect(jobs_card).to_have_text("2")
        await expect(workers_card).to_have_text("1")
        await expect(page.locator(".chart canvas")).to_have_count(4)
        jobs_chart = page.locator('.chart[data-y="jobs"]')
        await expect(jobs_chart).to_have_attribute("data-sum", "2")

        await chat(web_queen, ALPHA, count=3)
        await expect(jobs_card).to_have_text("5")
        await expect(jobs_chart).to_have_attribute("data-sum", "5")
        await expect(page.locator('[data-field="stats.jobs_per_min"]')).to_have_text("5.0")
        tokens = page.locator('[data-field="series"][data-agg="sum:tokens_per_s"]')
        # "echo: hello there swarm": 4 completion tokens a job.
        await expect(tokens).to_have_text("20")

        async with workers(ScriptedWorker(web_queen.ws_url, models=[BETA])):
            await expect(workers_card).to_have_text("2")
            await expect(page.locator('[data-field="stats.models"]')).to_have_text("2")
        await expect(workers_card).to_have_text("1")
        await expect(page.locator("#live-status")).to_have_class("live good")
    assert errors == []


async def test_worker_detail_page_shows_its_jobs_and_updates_live(
        web_queen: QueenHarness, browser: Browser) -> None:
    errors: list[str] = []
    async with workers(GpuWorker(web_queen.ws_url, models=[ALPHA], version="0.4.1",
                                 gpus=[("AMD Radeon RX 7800 XT", 16368)])) as (worker,):
        wid = public_id(worker.pubkey)
        await chat(web_queen, ALPHA, count=2)
        page = await new_page(browser, errors)
        await log_in(page, web_queen.base_url, then="/admin/workers")
        await page.click(f'#workers a[href="/admin/workers/{wid}"]')
        await expect(page).to_have_url(f"{web_queen.base_url}/admin/workers/{wid}")
        await expect(page.locator("h1")).to_contain_text(wid)
        await expect(page.locator("h1 .badge")).to_have_text("online")
        await expect(page.locator('[data-field="worker.jobs"]')).to_have_text("2")
        await expect(page.locator('[data-field="worker.gpus"]')).to_have_text(
            "AMD Radeon RX 7800 XT")
        await expect(page.locator("#jobs tbody tr")).to_have_count(2)
        await expect(page.locator(".chart canvas")).to_have_count(2)
        assert worker.pubkey not in await page.content()

        await chat(web_queen, ALPHA, count=2)
        await expect(page.locator('[data-field="worker.jobs"]')).to_have_text("4")
        await expect(page.locator("#jobs tbody tr")).to_have_count(4)
        await expect(page.locator('.chart[data-y="jobs"]')).to_have_attribute("data-sum", "4")
        await expect(page.locator("#jobs tbody tr").first.locator("td").last).to_have_text(
            re.compile(r"^chatcmpl-"))

        response = await page.goto(f"{web_queen.base_url}/admin/workers/nosuchworker")
        assert response is not None
        assert response.status == 404
        await expect(page.locator("h1")).to_have_text("Unknown worker")
    assert errors == ["Failed to load resource: the server responded with a status of 404 "
                      "(Not Found)"]


@pytest.fixture
async def hub_queen(tmp_path: Path) -> AsyncIterator[QueenHarness]:
    """A queen with the pages that reads ALPHA's size (7B) from a fake hub's GGUF header."""
    with FakeHub(pricing_repos({ALPHA: 7_000_000_000})) as hub:
        async with queen_with_pages(tmp_path, hub_endpoint=hub.url) as harness:
            yield harness


async def test_models_and_jobs_pages_update_live(
        hub_queen: QueenHarness, browser: Browser) -> None:
    web_queen = hub_queen
    errors: list[str] = []
    # The worker claims 1 parameter; the queen shows and prices the 7B it read on the hub.
    async with workers(GpuWorker(web_queen.ws_url, models=[ALPHA],
                                 parameter_count=1)) as (worker,):
        await chat(web_queen, ALPHA)
        page = await new_page(browser, errors)
        await log_in(page, web_queen.base_url, then="/admin/models")
        await expect(page.locator(f'#rows tbody tr[data-key="{ALPHA}"] td')).to_have_text(
            [ALPHA, "1", "1", "7B", "verified", "yes", re.compile(r"^[0-9a-f]{12}…$"), "—",
             "medium", "0.8", "1.6",
             "verified: the queen read this model's file on the hub (7B parameters), so it is "
             "priced as the medium class"])
        async with workers(ScriptedWorker(web_queen.ws_url, models=[ALPHA, GAMMA])):
            await expect(page.locator("#rows tbody tr")).to_have_count(2)
            await expect(page.locator(f'#rows tbody tr[data-key="{ALPHA}"] td').nth(1)
                         ).to_have_text("2")

        await page.click("nav >> text=Jobs")
        await expect(page).to_have_url(f"{web_queen.base_url}/admin/jobs")
        rows = page.locator("#rows tbody tr")
        await expect(rows).to_have_count(1)
        await expect(rows.first.locator("td").nth(1)).to_have_text(public_id(worker.pubkey))
        await expect(rows.first.locator("td").nth(7)).to_have_text("ok")
        await chat(web_queen, ALPHA, "a longer question for the swarm today")
        await expect(rows).to_have_count(2)
        # Newest first: the new job is on top, with its own token counts.
        await expect(rows.first.locator("td").nth(4)).to_have_text("8")
    assert errors == []


async def test_keys_and_payouts_pages(tmp_path: Path, browser: Browser) -> None:
    errors: list[str] = []
    async with (queen_with_pages(tmp_path, auth="keys", escrow_jobs=0) as queen,
                workers(ScriptedWorker(queen.ws_url)) as (worker,)):
        wid = public_id(worker.pubkey)
        secret, key_id = await funded_key(queen, 50)
        await chat(queen, ECHO_MODEL, api_key=secret, count=2)
        # A payout is reserved only out of what the worker has (issue 39): give it a sat.
        await queen.state.billing.ledger.post(ledger.Posting("test:earned", "settle", (
            (ledger.key_available(key_id), -1000), (ledger.worker_available(worker.pubkey), 1000))))
        await PayoutRunner(queen.state.settings, queen.state.db.engine,
                           queen.state.billing.ledger, NoneBackend(), None).pay(
            worker.pubkey, 1000, "worker@example.com")

        page = await new_page(browser, errors)
        await log_in(page, queen.base_url, then="/admin/payouts")
        payout = page.locator("#rows tbody tr").first
        await expect(payout.locator("td").nth(1)).to_have_text(wid)
        await expect(payout.locator("td").nth(2)).to_have_text("1")
        await expect(payout.locator("td").nth(3)).to_have_text("manual")
        assert worker.pubkey not in await page.content()

        await page.click("nav >> text=Workers")
        earned = page.locator(f'#workers tbody tr[data-key="{wid}"] td').nth(9)
        await expect(earned).not_to_have_text("0")

        await page.click("nav >> text=Keys")
        await expect(page).to_have_url(queen.base_url + "/admin/api-keys")
        row = page.locator(f'#rows tbody tr[data-key="{key_id}"]')
        await expect(row.locator("td").nth(1)).to_have_text("dev")
        await expect(row.locator("td").last).to_have_text("active")
        assert secret not in await page.content()
        assert errors == []

        # Live refresh of this page polls GET /admin/keys with the session cookie.
        assert (await page.request.get(queen.base_url + "/admin/keys")).status == 200
        async with httpx.AsyncClient(base_url=queen.base_url, trust_env=False) as client:
            made = await client.post("/admin/keys", json={"name": "second"},
                                     headers={"authorization": f"Bearer {ADMIN_TOKEN}"})
            assert made.status_code == 201
        await expect(page.locator("#rows tbody tr")).to_have_count(2)
        assert errors == []


async def test_worker_supplied_text_is_escaped(web_queen: QueenHarness, browser: Browser) -> None:
    evil = 'x/<img src=x onerror="window.pwned=1">:<b>Q4</b>'
    errors: list[str] = []
    async with workers(GpuWorker(web_queen.ws_url, models=[evil], version="<i>1</i>",
                                 gpus=[("<script>window.pwned=2</script>", 8000)])):
        page = await new_page(browser, errors)
        await page.goto(web_queen.base_url + "/")
        await expect(page.locator("#models tbody tr td").first).to_have_text(evil)
        await log_in(page, web_queen.base_url, then="/admin/workers")
        row = page.locator("#workers tbody tr").first
        await expect(row.locator("td").nth(1)).to_have_text("<i>1</i>")
        await expect(row.locator("td").nth(2)).to_have_text("<script>window.pwned=2</script>")
        await expect(row.locator(".model")).to_have_attribute("title", evil)
        await expect(page.locator("#workers img, #workers b, #workers i, #workers script")
                     ).to_have_count(0)
        assert await page.evaluate("() => window.pwned") is None
    assert errors == []


async def test_admin_pages_are_off_without_a_token(tmp_path: Path, browser: Browser) -> None:
    async with queen_with_pages(tmp_path, admin_token=None) as queen:
        page = await new_page(browser)
        await page.goto(queen.base_url + "/admin")
        await expect(page).to_have_url(re.compile(r"/admin/login"))
        await expect(page.locator("#admin-off")).to_have_text(
            "The admin pages are off on this queen.")
        await expect(page.locator("main")).to_contain_text("APIARY_ADMIN_TOKEN")
        await expect(page.locator("#token")).to_have_count(0)
        async with httpx.AsyncClient(base_url=queen.base_url, trust_env=False) as client:
            response = await client.post("/admin/login", data={"token": "anything"})
            assert response.status_code == 404
            assert SESSION_COOKIE not in response.cookies
