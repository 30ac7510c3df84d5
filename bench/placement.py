"""The queen's placement decision time: how long choosing a worker for a model nobody holds
takes with thousands of workers connected (issue 17).

N real ``Worker`` objects sit in a real ``Registry`` on connections that send nowhere, varied
as a real swarm is: room for models from 2 GB to 2 TB, memory budgets from 2 to 96 GB, free
VRAM none or 4 to 80 GB, speed records on 70% of them, 20% opted in to "let the swarm choose",
10% paused, 2% flagged by the audits, 5% holding another file under the model's name, 5%
downloading another model, 10% taking no fetches (legacy or not offered). The model is an 8B
Q4_K_M (32 layers, 4.9 GB file).

Two figures, median and p95 over ``--runs`` runs each:

* ``choose``: ``planner.choose`` alone, over ``registry.takers()``, best worker kept, as the
  service calls it.
* ``prepare``: ``PlacementService.prepare`` of a pinned name (its resolution cached in the
  catalog, as after its first request) from the call to the ``fetch`` frame handed to the
  chosen worker's connection: the settings check, the hourly budget, the need from the shape,
  the choice, the frame's encoding. Between runs the placement is forgotten, so each run
  places anew.

    .venv/bin/python bench/placement.py [--workers 500,1000,5000] [--runs 300] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

sys.path.insert(0, os.getcwd())

from queen_server.catalog import ModelCatalog
from queen_server.catalog.catalog import Reading
from queen_server.catalog.facts import HeaderFacts, ModelFacts, RemoteFile, RepoFiles, model_facts
from queen_server.errors import ModelLoading
from queen_server.placement.planner import choose, need_of
from queen_server.placement.service import PlacementService
from queen_server.swarm.registry import Registry
from queen_server.swarm.worker import Worker
from shared_schema import DownloadProgress, ModelDescriptor
from shared_schema.capabilities import FETCH
from shared_schema.gguf_shape import GgufShape

MODEL = "bench/Llama-8B-GGUF:Q4_K_M"
PATH = "Llama-8B-Q4_K_M.gguf"
SHA = "5" * 64
COMMIT = "c" * 40
SIZE = 4_920_000_000
SHAPE = GgufShape(architecture="llama", block_count=32, context_length=131_072,
                  embedding_length=4096, head_count=32, head_count_kv=8,
                  layer_bytes=(140_000_000,) * 32, other_bytes=440_000_000,
                  has_chat_template=True)


@dataclass
class Settings:
    on_demand: bool = True
    model_allow: list[str] = field(default_factory=list)
    model_deny: list[str] = field(default_factory=lambda: ["evil/*", "bad-*/*"])
    max_model_gb: float | None = 64.0
    model_wait_s: float = 0.0  # answer model_loading at once: the run ends at the fetch
    price_wait_s: float = 10.0
    fetch_stall_s: float = 120.0
    max_fetch_attempts: int = 3
    assumed_download_mb_s: float = 20.0
    max_copies_per_model: int = 4
    placements_per_hour: int = 1 << 30
    demand_interval_s: float = 60.0


class Reader:
    """One repo holding the model's file (read once, to pin the name)."""

    def listing(self, repo_id: str) -> RepoFiles:
        return RepoFiles(repo_id, COMMIT, (RemoteFile(PATH, SIZE, SHA),))

    def read_prefix(self, repo_id: str, commit: str, path: str, nbytes: int) -> bytes:
        raise AssertionError("the bench pins the name without reading a header")


class Connection:
    """Sends nowhere; notes when a fetch was handed to it."""

    sent_at = 0.0

    async def send_frame(self, frame: str) -> None:
        Connection.sent_at = time.perf_counter()

    async def send_job(self, *args: Any, **kwargs: Any) -> None: ...

    async def send_cancel(self, job_id: str, reason: str) -> None: ...

    async def close(self, code: int, reason: str) -> None: ...


def swarm(n: int, rng: random.Random) -> tuple[Registry, dict[str, float]]:
    registry = Registry()
    speeds: dict[str, float] = {}
    for i in range(n):
        roll = rng.random()
        legacy = roll < 0.03
        takes = roll >= 0.10
        models = []
        if rng.random() < 0.05:
            models.append(ModelDescriptor(name=MODEL, sha256="6" * 64, loaded=True))
        worker = Worker(key=f"{i:064x}", public_id=f"w{i}", session_id="s", legacy=legacy,
                        capabilities=[FETCH] if takes else [], models=models,
                        max_jobs=rng.choice((1, 2, 4, 8)))
        worker.model_room_mb = rng.choice((2_000, 8_000, 20_000, 60_000, 200_000, 2_000_000))
        worker.memory_budget_mb = rng.choice((2_000, 6_000, 12_000, 24_000, 48_000, 96_000))
        worker.vram_free_mb = rng.choice((None, 4_000, 8_000, 12_000, 24_000, 80_000))
        worker.swarm_models = rng.random() < 0.20
        if rng.random() < 0.05:
            worker.downloads["other/model-GGUF:Q8_0"] = DownloadProgress(
                name="other/model-GGUF:Q8_0", downloaded_bytes=1 << 30)
        registry.add(worker, Connection())
        if rng.random() < 0.10:
            registry.set_paused(worker, "on battery")
        elif rng.random() < 0.02:
            registry.set_flagged(worker, True)
        if rng.random() < 0.70:
            speeds[worker.key] = rng.uniform(0.005, 0.2)
    return registry, speeds


def summary(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    p95 = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
    return statistics.median(ordered) * 1e3, p95 * 1e3


async def measure(n: int, runs: int) -> dict[str, Any]:
    registry, speeds = swarm(n, random.Random(n))
    need = need_of(MODEL, SHA, SIZE, SHAPE)
    for _ in range(10):  # warm-up
        choose(need, list(registry.takers()), speeds, 1)
    gc.collect()
    chose: list[float] = []
    best = None
    for _ in range(runs):
        started = time.perf_counter()
        picked = choose(need, list(registry.takers()), speeds, 1)
        chose.append(time.perf_counter() - started)
        best = picked[0] if picked else None
    assert best is not None, "no worker fits: the bench's swarm is wrong"

    catalog = ModelCatalog(Reader())
    facts = _pinned()  # as the catalog holds them after its first reading of the name
    catalog._pins[MODEL] = facts
    catalog._remember(MODEL, Reading(facts, None, float("inf")))
    service = PlacementService(Settings(), registry, catalog, speeds_for=lambda _c: speeds,
                               size_class_of=lambda _m: "8B", earn_msat_per_1k=lambda _m: 0)
    prepared: list[float] = []
    for run in range(runs + 10):
        started = time.perf_counter()
        try:
            await service.prepare(MODEL)
        except ModelLoading:
            pass
        else:
            raise AssertionError("prepare did not place the model")
        if run >= 10:
            prepared.append(Connection.sent_at - started)
        for key in list(service.loading[MODEL].asked):  # forget it: the next run places anew
            worker = registry.get(key)
            if worker is not None:
                worker.downloads.pop(MODEL, None)
        service.loading.clear()
    await catalog.close()
    takers = len(registry.takers())
    fits = len(choose(need, list(registry.takers()), speeds, n))
    return {"n": n, "takers": takers, "fits": fits, "choose": summary(chose),
            "prepare": summary(prepared), "best": best.public_id}


def _pinned() -> ModelFacts:
    """The name's facts as the catalog pins them after its first reading."""
    listing = Reader().listing("bench/Llama-8B-GGUF")
    header = HeaderFacts(parameter_count=8_030_000_000, architecture="llama",
                         context_length=131_072, split_count=1, shape=SHAPE)
    return model_facts(MODEL, listing, listing.files, [header])


async def main(args: argparse.Namespace) -> None:
    sizes = [int(n) for n in args.workers.split(",")]
    runs = 50 if args.quick else args.runs
    print(f"# {os.cpu_count()} CPUs, Python {platform.python_version()}, {sys.platform}; "
          f"{runs} runs per row; model {MODEL} ({SIZE / 1e9:.1f} GB, 32 layers)")
    print("| workers | take fetches | fit the model | choose median ms | choose p95 ms | "
          "prepare to fetch median ms | prepare to fetch p95 ms |")
    print("|---|---|---|---|---|---|---|")
    for n in sizes:
        row = await measure(n, runs)
        print(f"| {n:,} | {row['takers']:,} | {row['fits']:,} | {row['choose'][0]:.2f} | "
              f"{row['choose'][1]:.2f} | {row['prepare'][0]:.2f} | {row['prepare'][1]:.2f} |",
              flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="500,1000,5000",
                        help="swarm sizes, comma-separated (default 500,1000,5000)")
    parser.add_argument("--runs", type=int, default=300, help="runs per figure (default 300)")
    parser.add_argument("--quick", action="store_true", help="50 runs per figure")
    asyncio.run(main(parser.parse_args()))
