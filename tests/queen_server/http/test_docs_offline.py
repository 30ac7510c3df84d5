"""``/docs`` works with no internet: Swagger UI's script and style come from the queen itself
(the ``fastapi-swagger`` package's copy), checked in Chromium with every other host blocked,
down to the operations listed from the live ``/openapi.json``. ReDoc, which would need a CDN,
is off."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from playwright.async_api import Browser, Route, expect

from tests.queen_server.web.support import CHROMIUM, chromium, chromium_available, new_page
from tests.support.queen import QueenHarness, running_queen


@pytest.fixture
async def queen(tmp_path: Path) -> AsyncIterator[QueenHarness]:
    async with running_queen(tmp_path, admin_token="docs-test-token") as harness:
        yield harness


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    if not chromium_available():
        pytest.skip(f"Debian's chromium is not installed at {CHROMIUM}: run .ci/chromium.sh")
    async with chromium() as launched:
        yield launched


async def test_docs_render_with_every_other_host_blocked(queen: QueenHarness,
                                                         browser: Browser) -> None:
    own = urlsplit(queen.base_url).netloc
    blocked: list[str] = []
    served: list[str] = []

    async def only_the_queen(route: Route) -> None:
        url = route.request.url
        if urlsplit(url).netloc == own:
            served.append(urlsplit(url).path)
            await route.continue_()
        else:
            blocked.append(url)
            await route.abort("internetdisconnected")

    errors: list[str] = []
    page = await new_page(browser, errors)
    await page.context.route("**/*", only_the_queen)
    await page.goto(queen.base_url + "/docs")

    await expect(page.locator(".swagger-ui .info .title")).to_contain_text("Apiary queen")
    operations = page.locator(".opblock")
    await expect(operations.first).to_be_visible()
    assert await operations.count() >= 10  # the OpenAI routes, the admin API, stats...
    chat = page.locator(".opblock-post", has=page.locator('[data-path="/v1/chat/completions"]'))
    await expect(chat).to_be_visible()
    await chat.locator(".opblock-summary").first.click()  # it opens, with its parameters
    await expect(chat.locator(".opblock-body")).to_be_visible()

    assert blocked == []
    assert {"/docs", "/docs/assets/swagger-ui-bundle.js", "/docs/assets/swagger-ui.css",
            "/openapi.json"} <= set(served)
    assert errors == []


async def test_the_docs_page_names_no_other_host(queen: QueenHarness) -> None:
    async with httpx.AsyncClient(base_url=queen.base_url, trust_env=False) as http:
        html = (await http.get("/docs")).text
        sources = re.findall(r'(?:src|href)="([^"]+)"', html)
        assert sources
        assert all(source.startswith("/") for source in sources), sources
        assert "cdn." not in html
        assert "tiangolo" not in html
        for path in ("/docs/assets/swagger-ui-bundle.js", "/docs/assets/swagger-ui.css"):
            asset = await http.get(path)
            assert asset.status_code == 200, path
            assert len(asset.content) > 100_000, path
        assert (await http.get("/docs/assets/swagger-ui-bundle.js")).headers[
            "content-type"].startswith(("text/javascript", "application/javascript"))
        assert (await http.get("/redoc")).status_code == 404
        assert (await http.get("/docs/assets/../../queen.sqlite3")).status_code == 404
        # The docs route is the page's own, not an API operation.
        spec = (await http.get("/openapi.json")).json()
        assert not any(path.startswith("/docs") for path in spec["paths"])
