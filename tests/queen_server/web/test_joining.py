"""The landing page's "Run a worker" part (in Chromium: the copy button puts this queen's worker
URL on the clipboard), the workers-with-a-GPU wording and the favicon over plain HTTP against a
real queen, and the worker URL and pay sentence rules on their own."""

from __future__ import annotations

import contextlib
import re
import struct
from collections.abc import AsyncIterator
from html import unescape
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.async_api import Browser, expect

from queen_server.web.joining import VARIANTS, first_url, pay_sentence, worker_url
from tests.queen_server.web.support import ADMIN_TOKEN, GpuWorker, new_page, queen_with_pages
from tests.support.queen import QueenHarness
from tests.support.workers import ScriptedWorker

# --- the rules --------------------------------------------------------------------------------


@pytest.mark.parametrize(("public_url", "request_url", "expected"), [
    (None, "http://127.0.0.1:8000/", "ws://127.0.0.1:8000/worker"),
    (None, "https://queen.example/", "wss://queen.example/worker"),
    (None, "https://queen.example:8443/", "wss://queen.example:8443/worker"),
    (None, "http://queen.example:80/", "ws://queen.example/worker"),
    (None, "http://[::1]:8000/", "ws://[::1]:8000/worker"),
    ("https://Queen.Example", "http://10.0.0.5:8000/", "wss://queen.example/worker"),
    (["https://queen.example/apiary/"], "http://x:1/", "wss://queen.example/apiary/worker"),
    ("https://a.example, https://b.example", "http://x:1/", "wss://a.example/worker"),
    (["", "http://b.example:9000"], "http://x:1/", "ws://b.example:9000/worker"),
    ("wss://queen.example/worker", "http://x:1/", "wss://queen.example/worker"),
    ("queen.example:8000", "http://x:1/", "ws://queen.example:8000/worker"),
    # Garbage in the setting: the request's own address, never a broken URL.
    ("ftp://queen.example", "http://127.0.0.1:8000/", "ws://127.0.0.1:8000/worker"),
    ("http://queen.example:99999", "http://127.0.0.1:8000/", "ws://127.0.0.1:8000/worker"),
    ("https://", "http://127.0.0.1:8000/", "ws://127.0.0.1:8000/worker"),
    (42, "http://127.0.0.1:8000/", "ws://127.0.0.1:8000/worker"),
    ([], "http://127.0.0.1:8000/", "ws://127.0.0.1:8000/worker"),
])
def test_the_worker_url(public_url: Any, request_url: str, expected: str) -> None:
    assert worker_url(public_url, request_url) == expected


def test_first_url_reads_every_shape_of_the_setting() -> None:
    assert first_url(None) is None
    assert first_url(" , ") is None
    assert first_url(" https://a , https://b") == "https://a"
    assert first_url(("", " https://b ")) == "https://b"
    assert first_url(3.5) is None


def test_the_pay_sentence() -> None:
    paying = {"pays": True, "open": False, "worker_share": 0.8, "payout_threshold_sats": 1000,
              "mode": "lightning"}
    assert pay_sentence(paying) == (
        "This queen pays its workers 80% of what each job costs, in sats over Lightning, "
        "automatically, once they have earned 1,000 sats and set a payout address in the app.")
    by_hand = {**paying, "mode": "manual", "note": "Ask bob@queen.example."}
    assert pay_sentence(by_hand) == (
        "This queen pays its workers 80% of what each job costs, in sats: its operator pays "
        "by hand what is due once a worker has earned 1,000 sats. The operator says: Ask "
        "bob@queen.example.")
    assert "does not pay" in pay_sentence({"pays": False, "open": True})
    assert "keeps no ledger" in pay_sentence({"pays": False, "open": False})


def test_every_variant_is_a_build_the_installers_make() -> None:
    assert [v.name for v in VARIANTS] == ["cuda", "vulkan", "metal", "cpu"]


# --- over HTTP --------------------------------------------------------------------------------

@contextlib.asynccontextmanager
async def client(queen: QueenHarness, address: str = "127.0.0.1") -> AsyncIterator[
        httpx.AsyncClient]:
    transport = httpx.AsyncHTTPTransport(local_address=address)
    async with httpx.AsyncClient(base_url=queen.base_url, transport=transport,
                                 trust_env=False) as http:
        yield http


def shown_worker_url(html: str) -> str:
    found = re.search(r'<pre id="worker-url"><code>([^<]*)</code></pre>', html)
    assert found, "no worker URL on the page"
    return unescape(found.group(1))


def bound(html: str, kind: str) -> list[str]:
    return [unescape(text) for text in
            re.findall(rf'data-kind="{kind}"[^>]*>([^<]*)</span>', html)]


async def test_the_landing_page_tells_a_worker_what_to_download_and_paste(
        tmp_path: Path) -> None:
    async with (queen_with_pages(tmp_path, auth="keys",
                                 worker_download_url="https://example.org/apiary/dl") as queen,
                client(queen) as http):
        html = (await http.get("/")).text
        assert shown_worker_url(html) == f"ws://127.0.0.1:{queen.port}/worker"
        assert 'href="https://example.org/apiary/dl"' in html
        for variant in VARIANTS:
            assert f'<tr data-key="{variant.name}">' in html
        assert "An NVIDIA graphics card" in html
        assert "This queen pays its workers 80%" in html
        assert 'data-copy="worker-url"' in html


async def test_behind_a_trusted_proxy_the_worker_url_is_wss(web_queen: QueenHarness) -> None:
    """uvicorn trusts X-Forwarded-Proto from loopback (FORWARDED_ALLOW_IPS) only: a proxy
    there makes the URL wss, while the same header from another address changes nothing."""
    async with client(web_queen) as proxy:
        html = (await proxy.get("/", headers={"x-forwarded-proto": "https",
                                              "host": "queen.example"})).text
        assert shown_worker_url(html) == "wss://queen.example/worker"
    async with client(web_queen, "127.0.0.2") as stranger:
        html = (await stranger.get("/", headers={"x-forwarded-proto": "https"})).text
        assert shown_worker_url(html) == f"ws://127.0.0.1:{web_queen.port}/worker"


async def test_the_public_url_setting_wins(tmp_path: Path) -> None:
    public = ["https://queen.example", "http://10.0.0.5:8000"]
    async with queen_with_pages(tmp_path, public_url=",".join(public)) as queen:
        settings = queen.state.settings
        if getattr(settings, "public_url", None) is None:  # the setting is not there yet
            object.__setattr__(settings, "public_url", public)
        async with client(queen) as http:
            assert shown_worker_url((await http.get("/")).text) == "wss://queen.example/worker"


async def test_an_open_queen_says_it_does_not_pay(web_queen: QueenHarness) -> None:
    async with client(web_queen) as http:
        html = (await http.get("/")).text
    assert ("This queen is open for demos: it serves requests for free, so it does not pay its "
            "workers.") in unescape(html)


async def test_the_workers_wording_reads_naturally(web_queen: QueenHarness) -> None:
    async with client(web_queen) as http:
        http.headers["authorization"] = f"Bearer {ADMIN_TOKEN}"
        assert bound((await http.get("/")).text, "gpu_share") == ["none with a GPU"]
        started = [await GpuWorker(web_queen.ws_url, gpus=[("NVIDIA RTX A6000", 49140)] * 2)
                   .start(),
                   await ScriptedWorker(web_queen.ws_url).start(),
                   await ScriptedWorker(web_queen.ws_url).start()]
        try:
            await web_queen.wait_until(lambda: len(web_queen.state.registry) == 3)
            stats = (await http.get("/stats")).json()
            assert (stats["workers_online"], stats["workers_with_gpu"], stats["gpus"]) == (3, 1, 2)
            for path in ("/", "/admin"):
                html = (await http.get(path)).text
                assert bound(html, "gpu_share") == ["1 with a GPU (2 GPUs in all)"], path
                assert "Workers online" in html
                assert "online workers" not in html  # the old "GPUs 0 / online workers"
        finally:
            for worker in started:
                await worker.stop()


async def test_the_favicon_is_a_real_icon_and_the_pages_link_it(
        web_queen: QueenHarness) -> None:
    async with client(web_queen) as http:
        icon = await http.get("/favicon.ico")
        assert icon.status_code == 200
        assert icon.headers["content-type"] == "image/x-icon"
        reserved, kind, count = struct.unpack("<HHH", icon.content[:6])
        assert (reserved, kind) == (0, 1)
        assert count == 3
        sizes = {icon.content[6 + 16 * i] for i in range(count)}
        assert sizes == {16, 32, 48}
        offset = struct.unpack("<I", icon.content[6 + 12:6 + 16])[0]
        assert icon.content[offset:offset + 8] == b"\x89PNG\r\n\x1a\n"
        for path in ("/", "/admin/login", "/docs"):
            html = (await http.get(path)).text
            assert re.search(r'<link rel="(shortcut )?icon" href="/favicon.ico"', html), path


async def test_the_copy_button_puts_the_worker_url_on_the_clipboard(
        web_queen: QueenHarness, browser: Browser) -> None:
    errors: list[str] = []
    page = await new_page(browser, errors)
    await page.context.grant_permissions(["clipboard-read", "clipboard-write"],
                                         origin=web_queen.base_url)
    await page.goto(web_queen.base_url + "/")
    expected = f"ws://127.0.0.1:{web_queen.port}/worker"
    section = page.locator("#run-a-worker")
    await expect(section.locator("h2")).to_have_text("Run a worker")
    await expect(section.locator("#worker-url")).to_have_text(expected)
    await expect(section.locator("#worker-variants tbody tr")).to_have_count(len(VARIANTS))
    await expect(section.locator("#worker-pay")).to_contain_text("does not pay its workers")
    button = section.locator('button[data-copy="worker-url"]')
    await button.click()
    await expect(button).to_have_text("Copied")
    assert await page.evaluate("navigator.clipboard.readText()") == expected
    await expect(button).to_have_text("Copy")  # and it goes back
    assert errors == []
