"""Screenshots of the pages (1280x800) from a real queen with a few workers and some traffic.

    .venv/bin/python -m tests.queen_server.web.make_screenshots [--out docs/screenshots]
        [--only landing,admin-keys]

Writes landing.png (the whole page, "Run a worker" included), admin-overview.png,
admin-workers.png, admin-worker.png and admin-keys.png (a key just made on the page, its secret
shown once), or only those named with --only. Needs Debian's chromium at /usr/bin/chromium
(.ci/chromium.sh installs it).

Everything shown is real: scripted workers (reporting GPUs) connect over the websocket, real
chat requests go through the queen on a paid key, and the pages poll the real endpoints. Only
the stats clock is set back while the traffic runs, so that a minute of requests lands as the
last 45 minutes of history and the charts have a shape.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import re
import tempfile
import time
from pathlib import Path

import httpx
from playwright.async_api import expect

from tests.queen_server.web.support import (
    ADMIN_TOKEN,
    GpuWorker,
    chat,
    chromium,
    log_in,
    new_page,
    queen_with_pages,
)
from tests.support.queen import QueenHarness
from tests.support.workers import ScriptedWorker

log = logging.getLogger("make_screenshots")

LLAMA = "bartowski/Llama-3.2-3B-Instruct-GGUF:Q4_K_M"
QWEN = "Qwen/Qwen2.5-7B-Instruct-GGUF:Q4_K_M"
SMOL = "HuggingFaceTB/SmolLM2-1.7B-Instruct-GGUF:Q8_0"
WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "while", "bees", "hum",
         "in", "hive", "and", "carry", "pollen", "home")
PARAMS = {LLAMA: 3_210_000_000, QWEN: 7_620_000_000, SMOL: 1_710_000_000}
HISTORY_MIN = 45
SLOT_S = 10
AT_LEAST_2 = re.compile(r"^([2-9]|\d{2,})$")  # live updates: the server's, then a poll

# (minutes ago it connects, worker spec)
FLEET = [
    (45, dict(models=[LLAMA, SMOL], gpus=[("NVIDIA GeForce RTX 4090", 24564)], version="0.4.1",
              parameter_count=PARAMS, seconds_per_token=0.002)),
    (44, dict(models=[QWEN, LLAMA], gpus=[("NVIDIA RTX A6000", 49140)], version="0.4.1",
              parameter_count=PARAMS, seconds_per_token=0.003)),
    (38, dict(models=[LLAMA], gpus=[("NVIDIA GeForce RTX 3060", 12288)], version="0.4.1",
              parameter_count=PARAMS, seconds_per_token=0.006)),
    (30, dict(models=[QWEN], gpus=[("NVIDIA GeForce RTX 3090", 24576)] * 2, version="0.4.0",
              parameter_count=PARAMS, seconds_per_token=0.004)),
    (21, dict(models=[SMOL], gpus=[("AMD Radeon RX 7800 XT", 16368)], version="0.3.9",
              parameter_count=PARAMS, seconds_per_token=0.005)),
]


def set_back(queen: QueenHarness, seconds: float) -> None:
    """Point the queen's stats clock ``seconds`` into the past (0: the real clock)."""
    stats = queen.state.stats  # type: ignore[attr-defined]
    stats.clock = time.time if seconds <= 0 else (lambda: time.time() - seconds)


async def paid_key(queen: QueenHarness) -> str:
    async with httpx.AsyncClient(base_url=queen.base_url, trust_env=False) as client:
        response = await client.post(
            "/admin/keys", json={"name": "screenshots", "credit_sats": 20_000},
            headers={"authorization": f"Bearer {ADMIN_TOKEN}"})
        response.raise_for_status()
        return response.json()["key"]


async def history(queen: QueenHarness, key: str) -> list[ScriptedWorker]:
    rng = random.Random(7)
    workers: list[ScriptedWorker] = []
    pending = sorted(FLEET, key=lambda item: -item[0])
    flaky: ScriptedWorker | None = None
    for slot in range(HISTORY_MIN * 60 // SLOT_S, -1, -1):
        ago = slot * SLOT_S
        set_back(queen, ago)
        while pending and pending[0][0] * 60 >= ago:
            workers.append(await GpuWorker(queen.ws_url, **pending.pop(0)[1], max_jobs=2).start())
        if ago == 26 * 60:
            flaky = await ScriptedWorker(queen.ws_url, models=[SMOL], behaviour="error").start()
        if ago == 17 * 60 and flaky is not None:
            await flaky.stop()
        # Busier as the swarm grows, with a lunchtime bump and some noise.
        busy = len(workers) * (1.0 + 0.8 * (15 * 60 < ago < 25 * 60)) * rng.uniform(0.1, 0.45)
        requests = []
        for _ in range(round(busy)):
            model = rng.choice([LLAMA, LLAMA, QWEN, SMOL])
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 40)))
            requests.append(chat(queen, model, text, api_key=key, stream=rng.random() < 0.5))
        await asyncio.gather(*requests)
    set_back(queen, 0)
    return workers


async def more_keys(queen: QueenHarness) -> None:
    """A few more keys for the Keys page: one with a budget and limits, one revoked."""
    admin = {"authorization": f"Bearer {ADMIN_TOKEN}"}
    async with httpx.AsyncClient(base_url=queen.base_url, trust_env=False) as client:
        for body in ({"name": "research-team", "credit_sats": 125_000, "budget_sats": 500_000,
                      "rpm_limit": 120, "concurrency_limit": 8},
                     {"name": "old-demo", "credit_sats": 40}):
            made = await client.post("/admin/keys", json=body, headers=admin)
            made.raise_for_status()
        old = made.json()["id"]
        (await client.post(f"/admin/keys/{old}/revoke", headers=admin)).raise_for_status()


async def main(out: Path, only: set[str] | None = None) -> None:
    def path(name: str) -> str | None:
        return str(out / f"{name}.png") if only is None or name in only else None

    with tempfile.TemporaryDirectory() as tmp:
        async with queen_with_pages(Path(tmp), auth="keys", total_timeout_s=30.0) as queen:
            key = await paid_key(queen)
            workers = await history(queen, key)
            await more_keys(queen)
            async with chromium() as browser:
                page = await new_page(browser)
                await page.goto(queen.base_url + "/")
                await page.wait_for_selector("#models tbody tr")
                await page.screenshot(path=path("landing"), full_page=True)
                await log_in(page, queen.base_url)
                await page.locator("canvas").nth(3).wait_for()
                await expect(page.locator("#live")).to_have_attribute("data-updates", AT_LEAST_2)
                await page.screenshot(path=path("admin-overview"))
                await page.goto(queen.base_url + "/admin/workers")
                await page.click("th[data-key=jobs]")
                await page.click("th[data-key=jobs]")
                await page.screenshot(path=path("admin-workers"))
                first = await page.get_attribute("#workers tbody tr", "data-key")
                await page.goto(f"{queen.base_url}/admin/workers/{first}")
                await page.locator("canvas").nth(1).wait_for()
                await page.screenshot(path=path("admin-worker"))
                await page.goto(queen.base_url + "/admin/api-keys")
                await page.fill("#create-name", "bob's laptop")
                await page.fill("#create-credit", "10,000")
                await page.click("#create-form button[type=submit]")
                await page.locator("#new-key").wait_for()
                await page.screenshot(path=path("admin-keys"), full_page=True)
            for worker in workers:
                await worker.stop()
    log.info("screenshots in %s", out)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/screenshots"))
    parser.add_argument("--only", help="comma-separated names to write (default: all)")
    logging.basicConfig(level=logging.WARNING)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    asyncio.run(main(args.out, set(args.only.split(",")) if args.only else None))
