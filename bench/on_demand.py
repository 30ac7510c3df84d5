"""Time to the first token for a model no worker holds (issue 17), on loopback.

A queen (in this process, on a 127.0.0.1 port) with one real worker (``WorkerService``: store,
engine, link) that holds nothing, and the fake hub holding the real SmolLM2-135M Q4_1 file
(98 MB). A streamed chat request names the model; the queen resolves it on the hub (its GGUF
header by Range requests), places it on the worker, which downloads, checks the sha256, loads
it, and reports it; the request, which waited (``model_wait_s`` 120), is then dispatched. The
table splits the time: resolution (the queen's reading of the header), download and load until
the queen sees the model held, then the first token. The last column is the first token of the
next request, with the model loaded. Each round starts from an empty store.

    .venv/bin/python bench/on_demand.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.fake_hub import FakeHub  # noqa: E402
from tests.support.on_demand import ASK, MODEL, repos, worker  # noqa: E402
from tests.support.queen import running_queen  # noqa: E402


async def first_token(client, **extra) -> float:  # type: ignore[no-untyped-def]
    started = time.perf_counter()
    stream = await client.chat.completions.create(model=MODEL, stream=True, **ASK, **extra)
    ttft = None
    async for chunk in stream:
        if ttft is None and chunk.choices and chunk.choices[0].delta.content:
            ttft = time.perf_counter() - started
    assert ttft is not None, "no token came"
    return ttft


async def one_round(tmp: Path) -> dict[str, float]:
    with FakeHub(repos()) as hub:
        async with running_queen(tmp, hub_endpoint=hub.url, model_wait_s=120,
                                 total_timeout_s=180, first_token_timeout_s=180) as queen, \
                worker(tmp, queen, hub, "w"):
            client = queen.client(timeout=300)
            marks: dict[str, float] = {}
            state = queen.state
            started = time.perf_counter()

            async def watch() -> None:
                while "served" not in marks:
                    now = time.perf_counter() - started
                    if "resolved" not in marks and state.catalog.pin(MODEL) is not None:
                        marks["resolved"] = now
                    if MODEL in state.registry.model_names():
                        marks["served"] = now
                    await asyncio.sleep(0.005)

            watcher = asyncio.create_task(watch())
            ttft = await first_token(client)
            await asyncio.wait_for(watcher, 5)
            again = await first_token(client)
            return {"resolve_s": marks["resolved"],
                    "fetch_load_s": marks["served"] - marks["resolved"],
                    "ttft_s": ttft, "next_ttft_s": again}


async def main(rounds: int) -> None:
    rows = []
    for number in range(rounds):
        with tempfile.TemporaryDirectory(prefix="apiary-on-demand-") as tmp:
            row = await one_round(Path(tmp))
        rows.append(row)
        print(f"round {number + 1}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()),
              flush=True)
    print()
    print("| | resolution (header read) | download + check + load | first token, unknown "
          "model | first token, next request |")
    print("|---|---|---|---|---|")
    for label, pick in (("median", statistics.median), ("min", min), ("max", max)):
        cells = [pick(r[k] for r in rows) for k in ("resolve_s", "fetch_load_s", "ttft_s",
                                                    "next_ttft_s")]
        print(f"| {label} | " + " | ".join(f"{c:.2f} s" for c in cells) + " |")


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    asyncio.run(main(parser.parse_args().rounds))
