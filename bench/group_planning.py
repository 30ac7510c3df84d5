"""The queen's group planning with thousands of workers connected (issue 19).

N real ``Worker`` objects sit in a real ``Registry`` on connections that send nowhere: memory
budgets from 8 to 32 GB (none holds the model alone), 60% with the ``rpc`` capability and one
llama.cpp build (5% of those another), households of 2 to 8 workers behind one address with one
LAN hint (a third of them with ``lan_groups`` off: no hint), 5% holding the pinned 70B-class
file (43 GB with its KV cache), 10% paused. ``GroupService.tick`` is what runs every
``group_interval_s``: it scans the workers for models held in the pinned file, builds the
planner's candidates, plans in a thread and, when a plan exists, forms the group (frames handed
to the connections). Each run ends the group it formed, so the next plans anew.

Printed: the median and p95 of one ``tick`` (milliseconds), the candidates and the members of
the plan. Nothing here runs per request: routing asks ``serves_model`` only when a worker is
indexed.

    .venv/bin/python bench/group_planning.py [--workers 500,1000,5000] [--runs 20]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
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
from queen_server.catalog.facts import ModelFacts
from queen_server.placement.groups import GroupService
from queen_server.swarm.registry import Registry
from queen_server.swarm.worker import Worker
from shared_schema import ModelDescriptor
from shared_schema.capabilities import RPC
from shared_schema.gguf_shape import GgufShape

MODEL = "bench/Llama-70B-GGUF:Q4_K_M"
SHA = "7" * 64
SHAPE = GgufShape(architecture="llama", block_count=80, context_length=131_072,
                  embedding_length=8192, head_count=64, head_count_kv=8,
                  layer_bytes=(512 << 20,) * 80, other_bytes=1050 << 20,
                  has_chat_template=True)


@dataclass
class Settings:
    groups: bool = True
    group_heads: list[str] = field(default_factory=lambda: ["*"])
    group_interval_s: float = 15.0
    group_setup_timeout_s: float = 3600.0
    group_load_timeout_s: float = 3600.0
    group_headroom_fraction: float = 0.10
    group_reserve_mb: int = 512
    group_retry_s: float = 0.0


class Connection:
    async def send_frame(self, frame: str) -> None: ...

    async def send_job(self, *args: Any, **kwargs: Any) -> None: ...

    async def send_cancel(self, job_id: str, reason: str) -> None: ...

    async def close(self, code: int, reason: str) -> None: ...


def swarm(n: int, rng: random.Random) -> Registry:
    registry = Registry()
    i = 0
    while i < n:
        household = rng.randint(2, 8)
        host = f"198.51.{(i // 250) % 250}.{i % 250}"
        hint = f"{i:032x}" if rng.random() < 0.67 else None
        for _ in range(min(household, n - i)):
            models = ([ModelDescriptor(name=MODEL, sha256=SHA)] if rng.random() < 0.05
                      else [])
            rpc = rng.random() < 0.60
            worker = Worker(key=f"{i:064x}", public_id=f"w{i}", session_id="s",
                            capabilities=[RPC] if rpc else [], models=models)
            worker.memory_budget_mb = rng.choice((8_000, 16_000, 24_000, 32_000))
            worker.llama_build = "b1" if rng.random() < 0.95 else "b2"
            worker.lan_hint, worker.peer_host = hint, host
            registry.add(worker, Connection())
            if rng.random() < 0.10:
                registry.set_paused(worker, "on battery")
            i += 1
    return registry


def catalog() -> ModelCatalog:
    made = ModelCatalog(None)  # type: ignore[arg-type]  # never reads: the name is pinned
    facts = ModelFacts(name=MODEL, repo_id="bench/Llama-70B-GGUF", commit="c" * 40,
                       paths=("m.gguf",), sha256s=(SHA,), parameter_count=70_000_000_000,
                       architecture="llama", context_length=131_072,
                       size_bytes=42_000_000_000, shape=SHAPE)
    made._pins[MODEL] = facts
    made._remember(MODEL, Reading(facts, None, float("inf")))
    return made


async def measure(n: int, runs: int) -> dict[str, Any]:
    registry = swarm(n, random.Random(n))
    service = GroupService(Settings(), registry, catalog())
    samples: list[float] = []
    members = 0
    for _ in range(runs):
        started = time.perf_counter()
        await service.tick()
        samples.append(time.perf_counter() - started)
        group = service.by_model.get(MODEL)
        assert group is not None, service.outcomes.get(MODEL)
        members = len(group.parts)
        service.end(group, "bench")
        await asyncio.sleep(0)
    candidates = len(service._candidates(MODEL, SHA))
    await service.stop()
    ordered = sorted(samples)
    return {"n": n, "candidates": candidates, "members": members,
            "median": statistics.median(ordered) * 1e3,
            "p95": ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))] * 1e3}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="500,1000,5000")
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)  # each run ends its group, with a warning
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"Python {platform.python_version()}")
    print("| workers | candidates | group size | tick median (ms) | tick p95 (ms) |")
    print("|---|---|---|---|---|")
    for n in (int(x) for x in args.workers.split(",")):
        row = await measure(n, args.runs)
        print(f"| {row['n']:,} | {row['candidates']:,} | {row['members']} | "
              f"{row['median']:.1f} | {row['p95']:.1f} |")


if __name__ == "__main__":
    asyncio.run(main())
