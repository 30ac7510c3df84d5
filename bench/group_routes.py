"""Model groups through a real queen (issue 19): tokens/s of one streamed answer as a developer
sees it, from one worker alone, a group linked directly, and a group relayed through the queen.

Everything real on 127.0.0.1: a queen (uvicorn), ``WorkerService``s with llama.cpp's RPC
backend, the fake hub with the real SmolLM2 (30 layers), the OpenAI client. The group rows use
the end-to-end test's set-up (``tests/e2e/test_groups.py``): each worker claims 256 MB and the
queen keeps 176 MB of each free, so no worker holds the model alone and the queen forms a group
of three (the head and two members); "direct": the workers turn ``lan_groups`` on and the head
dials the members' TLS gates; "relayed": ``lan_groups`` off (the default), nothing listens, and
every RPC byte goes head -> queen -> member and back over the workers' websockets. "1 worker":
one worker with room for the model. Every process 1 thread. Tokens/s: completion tokens over the
stream's wall time (a greedy answer of ``--tokens`` tokens), best of ``--repeat``, after a
warm-up answer (a worker's first job is its unpaid proof of work, and the head's first graphs).
Per token: the bytes the queen relayed each way (``GroupRelay.usage``) over the measured answers.

    .venv/bin/python bench/group_routes.py                  # about 1 min on 2 cores
    .venv/bin/python bench/group_routes.py --tokens 128 --repeat 3
    python bench/group_routes.py --gpu                      # a group on one GPU (issue 41)

``--gpu``: every worker also caps its GPU memory at ``GPU_CAP_MB`` (256 MB, the owner's
``vram_cap_mb``), so the queen is told 256 MB of the GPU for each (``device_free_mb``) and, as
on the CPU, forms a group of three; on a machine with one GPU the head and both members then
offload their layers to that same GPU, each from its own sandboxed child. Where llama.cpp lists
no GPU it measures what it measures without the flag.

See bench/RESULTS.md, "Model groups (issue 19)".
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from desktop_worker.store import ModelStore  # noqa: E402
from queen_server.placement.groups import Group, Phase  # noqa: E402
from tests.queen_server.billing.test_billing_api import funded_key  # noqa: E402
from tests.support.fake_hub import FakeHub  # noqa: E402
from tests.support.on_demand import MODEL, repos, worker  # noqa: E402
from tests.support.queen import QueenHarness, running_queen  # noqa: E402

GROUPS = {"group_heads": "*", "group_reserve_mb": 176, "group_headroom_fraction": 0.0,
          "group_interval_s": 0.5, "group_setup_timeout_s": 60, "group_load_timeout_s": 120}
QUEEN = {"auth": "keys", "escrow_jobs": 0, "total_timeout_s": 120, "first_token_timeout_s": 60}
MEMBER = {"memory_budget_mb": 256, "threads": 1, "max_jobs": 1}
GPU_CAP_MB = 256  # --gpu: each worker's vram_cap_mb, as the group rows' memory budget
MESSAGES = [{"role": "user", "content": "Write a long story about a lighthouse."}]


@dataclass
class Row:
    setup: str
    tokens_per_s: float
    text: str
    bytes_to_members: float = 0.0  # per token
    bytes_to_head: float = 0.0


async def answer(queen: QueenHarness, secret: str, tokens: int) -> tuple[float, str]:
    client = queen.client(api_key=secret)
    started = time.perf_counter()
    stream = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=tokens, stream=True,
        stream_options={"include_usage": True})
    parts: list[str] = []
    made = 0
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            made = chunk.usage.completion_tokens
    return made / (time.perf_counter() - started), "".join(parts)


async def ready_group(queen: QueenHarness) -> Group:
    def ready() -> bool:
        group = queen.state.groups.by_model.get(MODEL)
        return group is not None and group.phase is Phase.READY

    await queen.wait_until(ready, 180, "a ready group")
    return queen.state.groups.by_model[MODEL]


async def measure(tmp: Path, hub: FakeHub, setup: str, args: argparse.Namespace) -> Row:
    store = ModelStore(tmp / setup / "head" / "models", endpoint=hub.url)
    await asyncio.to_thread(store.pull, MODEL)
    alone = setup == "1 worker"
    settings = {**QUEEN, **({} if alone else GROUPS)}
    member = {"threads": 1, "max_jobs": 1} if alone else {
        **MEMBER, "lan_groups": setup.endswith("direct")}
    if args.gpu and not alone:
        member["vram_cap_mb"] = GPU_CAP_MB
    async with running_queen(tmp / setup, hub_endpoint=hub.url, **settings) as queen, \
            contextlib.AsyncExitStack() as stack:
        await stack.enter_async_context(
            worker(tmp / setup, queen, hub, "head", store=store, **member))
        if not alone:
            for name in ("w1", "w2"):
                await stack.enter_async_context(worker(tmp / setup, queen, hub, name, **member))
            group = await ready_group(queen)
        secret, _ = await funded_key(queen, 1000)
        await answer(queen, secret, 8)  # warm-up
        relay = queen.state.groups.relay
        before = None if alone else relay.usage(group.id)
        runs = [await answer(queen, secret, args.tokens) for _ in range(args.repeat)]
        rate, text = max(runs, key=lambda run: run[0])
        row = Row(setup, rate, text)
        if before is not None:
            after = relay.usage(group.id)
            tokens = args.tokens * args.repeat
            row.bytes_to_members = (after.bytes_to_members - before.bytes_to_members) / tokens
            row.bytes_to_head = (after.bytes_to_head - before.bytes_to_head) / tokens
        return row


async def run(args: argparse.Namespace) -> list[Row]:
    with tempfile.TemporaryDirectory() as tmp, FakeHub(repos()) as hub:
        return [await measure(Path(tmp), hub, setup, args)
                for setup in ("1 worker", "group of 3, direct", "group of 3, relayed")]


def table(rows: list[Row]) -> str:
    base = rows[0].tokens_per_s
    lines = ["| setup (through the queen) | tokens/s | vs 1 worker | same text | relayed per "
             "token: to members / to head |", "|---|---|---|---|---|"]
    for row in rows:
        relayed = (f"{row.bytes_to_members:,.0f} / {row.bytes_to_head:,.0f} B"
                   if row.bytes_to_members else "-")
        lines.append(f"| {row.setup} | {row.tokens_per_s:.1f} | {row.tokens_per_s / base:.2f} | "
                     f"{'yes' if row.text == rows[0].text else 'NO'} | {relayed} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--gpu", action="store_true",
                        help=f"the group rows' workers cap their GPU memory at {GPU_CAP_MB} MB")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    rows = asyncio.run(run(args))
    print(f"SmolLM2-135M Q4_1 through a queen on 127.0.0.1, {args.tokens} tokens greedy, best "
          f"of {args.repeat}, 1 thread a process, {os.cpu_count()} cores"
          + (f", group workers' GPU memory capped at {GPU_CAP_MB} MB" if args.gpu else ""))
    print(table(rows))


if __name__ == "__main__":
    main()
