"""Helpers for the page tests and the screenshot script: a real queen with an admin token,
workers that report GPUs, headless Debian chromium through Playwright, and an admin login."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any
from unittest import mock

from playwright.async_api import Browser, Page, async_playwright

from queen_server.web import pages as web_pages
from shared_schema import Hello, Job, ModelDescriptor, NvGpu
from tests.support.queen import QueenHarness, running_queen
from tests.support.workers import ScriptedWorker, echo_words

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
ADMIN_TOKEN = "admin-token-for-page-tests"
VIEWPORT = {"width": 1280, "height": 800}
TIMEOUT_MS = 10_000


@contextlib.asynccontextmanager
async def queen_with_pages(tmp_path: Path, refresh_ms: int = 1000,
                           **overrides: Any) -> AsyncIterator[QueenHarness]:
    """A real queen with the pages and an admin token; its pages poll every ``refresh_ms``
    (the shortest app.js allows, so that live updates show up quickly in tests)."""
    overrides.setdefault("admin_token", ADMIN_TOKEN)
    with mock.patch.dict(web_pages.templates.env.globals, refresh_ms=refresh_ms):
        async with running_queen(tmp_path, **overrides) as harness:
            yield harness


class GpuWorker(ScriptedWorker):
    """A scripted worker whose hello reports NVIDIA GPUs, a version and parameter counts (one
    for all its models, or one per model), and which takes ``seconds_per_token`` to answer."""

    def __init__(self, ws_url: str, *, gpus: list[tuple[str, int]] | None = None,
                 version: str = "0.4.0", parameter_count: int | Mapping[str, int] = 135_000_000,
                 seconds_per_token: float = 0.0, **kwargs: Any) -> None:
        super().__init__(ws_url, **kwargs)
        self.gpus = [NvGpu(name=name, memory=memory) for name, memory in (gpus or [])]
        self.version = version
        self.seconds_per_token = seconds_per_token
        self.models = [
            ModelDescriptor(name=m.name, size_bytes=m.size_bytes, loaded=m.loaded,
                            parameter_count=parameter_count if isinstance(parameter_count, int)
                            else parameter_count[m.name])
            for m in self.models
        ]

    def hello(self, nonce: str) -> Hello:
        """ScriptedWorker's hello, with the GPUs and version added (the signature covers only
        the nonce, key and payout address)."""
        return super().hello(nonce).model_copy(update={
            "worker_version": self.version, "nv_gpus": self.gpus, "nv_gpu_count": len(self.gpus),
            "vram": sum(gpu.memory for gpu in self.gpus)})


    async def _run(self, job: Job) -> None:
        if self.seconds_per_token and job.openai_url != "/v1/embeddings":
            await asyncio.sleep(self.seconds_per_token * len(echo_words(job.openai_req)))
        await super()._run(job)


def chromium_available() -> bool:
    return CHROMIUM.exists()


@contextlib.asynccontextmanager
async def chromium() -> AsyncIterator[Browser]:
    """Debian's chromium, headless (never a downloaded browser). Playwright gives each launch a
    fresh, temporary profile (its --user-data-dir)."""
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            await browser.close()


async def new_page(browser: Browser, errors: list[str] | None = None) -> Page:
    context = await browser.new_context(viewport=VIEWPORT)
    page = await context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    if errors is not None:
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
    return page


async def log_in(page: Page, base_url: str, token: str = ADMIN_TOKEN,
                 then: str = "/admin") -> None:
    await page.goto(f"{base_url}/admin/login?next={then}")
    await page.fill("#token", token)
    await page.click("button[type=submit]")
    await page.wait_for_url(f"{base_url}{then}")


async def chat(queen: QueenHarness, model: str, text: str = "hello there swarm",
               count: int = 1, api_key: str = "test-key", stream: bool = False) -> None:
    client = queen.client(api_key)
    for _ in range(count):
        if stream:
            chunks = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": text}], stream=True)
            async for _chunk in chunks:
                pass
        else:
            await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": text}])
