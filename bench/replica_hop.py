"""The cross-replica hop between real queen processes (issue 18): added time to first token, and
relayed tokens/s, asked of the queen that holds the worker against asked of another replica.

One run starts, on loopback: a real ``redis-server``; two queen processes, A and B
(``python -m queen_server.cli`` with ``APIARY_REDIS_URL`` and ``APIARY_REPLICA_ID``), sharing
it and a database; and a process of stub workers (``bench/queen_overhead.py --role workers``:
``tests.support.workers.ScriptedWorker`` doing the real v1 handshake, answering every job at
once with ``max_tokens`` `` tok`` tokens) connected to **A only**. A request asked of A is
served by its own worker; one asked of B finds no worker there and crosses the bus to A
(``cluster.remote``), whose worker answers, every event coming back to B over Redis pub/sub.

The load generator lives in this process (keep-alive HTTP/1.1 connections parsed with
httptools, closed loop, the same for both targets), and measures:

* **TTFT**: from writing a streamed request to the first SSE event with content, p50/p95, at
  each ``--concurrency``; the added TTFT is B's figure less A's at the same load.
* **Long streams**: ``--tokens`` tokens an answer, the stub emitting as fast as it can, once
  with its tokens joined into frames as the real worker does (``--join-tokens``, default 32)
  and once one token a frame (1): tokens/s via A and via B, and the CPU each process spent
  per token (from /proc/<pid>/stat over the measured window), the SSE pieces the client read
  and the bus messages (Redis's own PUBLISH count) an answer.

**One machine for all, or a CPU for each queen.** On one small machine both queens, Redis, the
stub workers and the load generator share the CPU, so a relayed token costs the machine both
queens' work and B/A stays near 0.5-0.7 whatever the relay costs. ``--cpus-each CPUS`` puts
each queen in a cgroup of its own with that CPU quota (root, cgroup v1 or v2; it says why when
it cannot): each replica gets the same CPU of its own, as on separate machines, and B/A is
then what the issue's figure means. Choose the quota so the queens are the only bottleneck
(0.3 on a 2-core machine: the "capped" column near 1.00 for A serving locally and for the
busier queen relaying); the "per-queen bound" column estimates the same from CPU per token.

The database: PostgreSQL when ``--db`` or ``APIARY_TEST_POSTGRES_URL`` names a server (a fresh
database is made on it, migrated with ``db upgrade`` and dropped afterwards), else one SQLite
file per replica: with a development key nothing is billed and nothing needs the shared
ledger, so each replica can keep its own books (the run says which it used).

    .venv/bin/python bench/replica_hop.py                       # the whole run (~2 min)
    .venv/bin/python bench/replica_hop.py --quick               # a smoke run (a few seconds)
    .venv/bin/python bench/replica_hop.py --repeat 2 --concurrency 1,8 --tokens 256
    .venv/bin/python bench/replica_hop.py --profile /tmp/hop    # also py-spy both queens
    .venv/bin/python bench/replica_hop.py --cpus-each 0.3 --repeat 2 --concurrency 1 \
        --stream-concurrency 1,8,16                             # a CPU for each queen (root)

See bench/RESULTS.md, "Cross-replica hop (issue 18)" and "The relay with a CPU for each queen
(issue 40)".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import orjson
import uvloop

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from cpu_quota import CpuQuotas  # noqa: E402
from queen_overhead import (  # noqa: E402
    API_KEY,
    DEFAULT_JOIN,
    Connection,
    Processes,
    chat_request,
    int_list,
    machine,
    percentile,
    print_stack_summary,
    proc_cpu_s,
    py_spy,
    text_frames,
    wait_healthy,
)

from tests.support.processes import free_port  # noqa: E402
from tests.support.redis_server import RedisServer  # noqa: E402

TTFT_GOAL_MS = 1.0  # issue 18: added time to first token at p50
FIRST_CONTENT = b'"content":"'  # the queen writes compact JSON; the first event with text


# --- the load generator -----------------------------------------------------------------------


class SseConnection(Connection):
    """queen_overhead's keep-alive connection, timed: ``request`` resolves to (status, body,
    seconds to the first content event, seconds to the end)."""

    def __init__(self) -> None:
        super().__init__()
        self.sent = 0.0
        self.first = 0.0
        self.pieces = 0  # body pieces read (about one per write of the queen's SSE body)

    def on_body(self, body: bytes) -> None:
        if not self.first and FIRST_CONTENT in b"".join((*self.body[-1:], body)):
            self.first = time.perf_counter()
        self.body.append(body)
        self.pieces += 1

    def on_message_complete(self) -> None:
        done = time.perf_counter()
        body, self.body = b"".join(self.body), []
        waiter, self.waiter = self.waiter, None
        first = (self.first or done) - self.sent
        if waiter is not None and not waiter.done():
            waiter.set_result((self.parser.get_status_code(), body, first,  # type: ignore[arg-type]
                               done - self.sent))

    def request(self, data: bytes) -> asyncio.Future[tuple[int, bytes, float, float]]:
        self.first = 0.0
        self.sent = time.perf_counter()
        return super().request(data)  # type: ignore[return-value]


def stream_request(port: int, tokens: int) -> bytes:
    return chat_request(port, stream=True, tokens=tokens)


def whole(body: bytes, tokens: int) -> bool:
    return body.endswith(b"data: [DONE]\n\n") and body.count(b" tok") == tokens


def check_full(body: bytes, tokens: int) -> None:
    """The first answer of each phase, read whole: every chunk, the text, the finish."""
    events = [e for e in body.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]", events[-1][:200]
    chunks = [orjson.loads(e[len(b"data: "):]) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                   if c.get("choices"))
    assert text == " tok" * tokens, text[:80]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop", chunks[-1]


@dataclass
class Phase:
    """One measured window: one target, one load."""

    kind: str  # "ttft" (short streams) or "stream" (long ones)
    target: str  # "A" (holds the worker) or "B" (relays from A)
    tokens: int
    join: int
    concurrency: int
    seconds: float
    requests: int
    errors: int
    ttft_ms: list[float] = field(repr=False)
    total_ms: list[float] = field(repr=False)
    cpu_s: dict[str, float]
    pieces: int = 0  # SSE body pieces the client read over the measured answers
    published: int = 0  # PUBLISHes Redis ran meanwhile (jobs, events, outcomes; reports)
    # With ``--cpus-each``: the share of scheduler periods in which each queen used its whole
    # quota (near 1: that queen was the bottleneck; near 0: it waited on something else).
    capped: dict[str, float] = field(default_factory=dict)

    @property
    def rps(self) -> float:
        return self.requests / self.seconds

    @property
    def tokens_per_s(self) -> float:
        return self.rps * self.tokens

    def ttft(self, q: float) -> float:
        return percentile(self.ttft_ms, q)

    def total(self, q: float) -> float:
        return percentile(self.total_ms, q)

    def cpu_us_per_token(self, who: str) -> float:
        return 1e6 * self.cpu_s.get(who, 0.0) / max(self.requests * self.tokens, 1)


async def drive(kind: str, target: str, port: int, *, tokens: int, join: int, concurrency: int,
                warmup: float, duration: float, pids: dict[str, int],
                on_start: Callable[[], None] | None = None,
                on_stop: Callable[[], None] | None = None,
                quotas: CpuQuotas | None = None,
                publishes: Callable[[], int] | None = None) -> Phase:
    """Closed-loop load: each connection sends its next request when its answer is complete."""
    loop = asyncio.get_running_loop()
    request = stream_request(port, tokens)
    conns = []
    for _ in range(concurrency):
        _, conn = await loop.create_connection(SseConnection, "127.0.0.1", port)
        conns.append(conn)
    status, body, _, _ = await conns[0].request(request)
    assert status == 200, (target, status, body[:300])
    check_full(body, tokens)

    measuring = stopping = False
    ttft: list[float] = []
    total: list[float] = []
    errors = 0
    pieces = 0

    async def client(conn: SseConnection) -> None:
        nonlocal errors, pieces
        while not stopping:
            conn.pieces = 0
            status, body, first, end = await conn.request(request)
            if measuring:
                pieces += conn.pieces
                ttft.append(1e3 * first)
                total.append(1e3 * end)
                if status != 200 or not whole(body, tokens):
                    errors += 1

    tasks = [asyncio.create_task(client(conn)) for conn in conns]
    await asyncio.sleep(warmup)
    if on_start is not None:
        on_start()
    cpu0 = cpu_snapshot(pids)
    throttle0 = quotas.stats() if quotas is not None else {}
    published0 = publishes() if publishes is not None else 0
    t0 = time.perf_counter()
    measuring = True
    await asyncio.sleep(duration)
    measuring = False
    seconds = time.perf_counter() - t0
    cpu1 = cpu_snapshot(pids)
    capped = quotas.throttled_since(throttle0) if quotas is not None else {}
    published = publishes() - published0 if publishes is not None else 0
    if on_stop is not None:
        on_stop()
    stopping = True
    await asyncio.gather(*tasks)
    for conn in conns:
        assert conn.transport is not None
        conn.transport.close()
    return Phase(kind=kind, target=target, tokens=tokens, join=join, concurrency=concurrency,
                 seconds=seconds, requests=len(total), errors=errors, ttft_ms=sorted(ttft),
                 total_ms=sorted(total), cpu_s={k: cpu1[k] - cpu0[k] for k in cpu0},
                 capped=capped, pieces=pieces, published=published)


def publish_counter(url: str) -> Callable[[], int]:
    """How many PUBLISH commands Redis has run so far (its own command statistics)."""
    import redis as redis_client

    client = redis_client.Redis.from_url(url)

    def published() -> int:
        stats = client.info("commandstats").get("cmdstat_publish") or {}
        return int(stats.get("calls", 0))

    return published


def cpu_snapshot(pids: dict[str, int]) -> dict[str, float]:
    snap = {}
    for name, pid in pids.items():
        snap[name], snap[f"{name} (kernel)"] = proc_cpu_s(pid)
    user, system = os.times()[:2]
    snap["client"] = user + system
    return snap


# --- the processes ----------------------------------------------------------------------------


@contextmanager
def database(args: argparse.Namespace, workdir: Path) -> Iterator[dict[str, str]]:
    """Each replica's database URL: one fresh, migrated PostgreSQL database for both, or one
    SQLite file each; dropped or deleted afterwards."""
    server = args.db or os.environ.get("APIARY_TEST_POSTGRES_URL")
    if not server:
        args.db_used = "SQLite, one file per replica"
        yield {name: f"sqlite+aiosqlite:///{workdir / f'queen-{name}.sqlite3'}" for name in "AB"}
        return
    for plain in ("postgresql://", "postgres://"):
        if server.startswith(plain):
            server = "postgresql+asyncpg://" + server[len(plain):]
    name = f"apiary_hop_{uuid.uuid4().hex[:10]}"
    url = f"{server.rsplit('/', 1)[0]}/{name}"
    admin_sql(server, f'CREATE DATABASE "{name}"')
    try:
        migrated = subprocess.run(
            [sys.executable, "-m", "queen_server.cli", "--db", url, "db", "upgrade"],
            cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
            env={**os.environ, "PYTHONPATH": str(ROOT)})
        if migrated.returncode != 0:
            raise RuntimeError(f"db upgrade failed:\n{migrated.stderr[-2000:]}")
        args.db_used = "PostgreSQL, one database shared by both replicas"
        yield {"A": url, "B": url}
    finally:
        admin_sql(server, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def admin_sql(server: str, statement: str) -> None:
    """One statement outside a transaction (CREATE DATABASE cannot run in one), through the
    queen's own async driver."""
    from sqlalchemy import text
    from sqlalchemy.ext.asyncio import create_async_engine

    async def go() -> None:
        engine = create_async_engine(server, isolation_level="AUTOCOMMIT")
        try:
            async with engine.connect() as conn:
                await conn.execute(text(statement))
        finally:
            await engine.dispose()

    asyncio.run(go())


def start_queens(procs: Processes, redis_url: str, dbs: dict[str, str]) -> dict[str, int]:
    ports = {}
    secret = secrets.token_hex(16)  # both replicas' (a replica before issue 40 ignores it)
    for name in "AB":
        ports[name] = port = free_port()
        procs.start(f"queen{name}", [
            sys.executable, "-m", "queen_server.cli", "--port", str(port), "--log-level",
            "warning", "--db", dbs[name]], env={
                "PYTHONPATH": str(ROOT), "APIARY_API_KEYS": API_KEY, "APIARY_REDIS_URL": redis_url,
                "APIARY_CLUSTER_SECRET": secret,  # the replicas seal their bus (issue 40)
                "APIARY_REPLICA_ID": f"hop-{name.lower()}", "APIARY_ON_DEMAND": "false",
                "NO_PROXY": "127.0.0.1,localhost"})
    for port in ports.values():
        wait_healthy(procs, port, lambda health: health.get("status") == "ok", timeout=60)
    return ports


def start_workers(procs: Processes, args: argparse.Namespace, ports: dict[str, int],
                  join: int) -> None:
    """(Re)start the stub workers on A with ``join`` tokens a frame; wait until A holds them
    and B sees them, with their slots, in the shared directory."""
    if "worker" in procs.procs:
        procs.stop("worker")
        wait_healthy(procs, ports["A"], lambda health: health.get("workers") == 0)
    ready = procs.workdir / f"workers-{join}.ready"
    procs.start("worker", [
        sys.executable, str(ROOT / "bench" / "queen_overhead.py"), "--role", "workers",
        "--port", str(ports["A"]), "--workers", str(args.workers), "--max-jobs",
        str(args.max_jobs), "--ready-file", str(ready), "--join-tokens", str(join)],
        env={"PYTHONPATH": str(ROOT)})
    slots = args.workers * args.max_jobs
    wait_healthy(procs, ports["A"], lambda health: ready.exists()
                 and health.get("workers") == args.workers and health.get("job_slots") == slots)
    wait_relayed(procs, ports["B"])


def wait_relayed(procs: Processes, port: int, timeout: float = 30.0) -> None:
    """Ask B for a short stream until one comes back whole: B has read A's workers from the
    directory (its view is refreshed once a second)."""
    import httpx

    deadline = time.monotonic() + timeout
    last: object = None
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10, trust_env=False) as http:
        while time.monotonic() < deadline:
            procs.check_alive()
            answer = http.post("/v1/chat/completions", content=stream_request(port, 2).split(
                b"\r\n\r\n", 1)[1], headers={"Authorization": f"Bearer {API_KEY}",
                                               "Content-Type": "application/json"})
            if answer.status_code == 200 and whole(answer.content, 2):
                return
            last = (answer.status_code, answer.content[:300])
            time.sleep(0.2)
    raise RuntimeError(f"B relayed no answer from A's workers after {timeout:.0f} s: {last!r}")


# --- the run ----------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> list[Phase]:
    workdir = Path(tempfile.mkdtemp(prefix="replica-hop-"))
    procs = Processes(workdir)
    redis = RedisServer(workdir / "redis")
    spies: list[tuple[str, subprocess.Popen[bytes], Path]] = []
    quotas = CpuQuotas.open("replica-hop") if args.cpus_each else None
    try:
        redis.start()
        assert redis.popen is not None
        with database(args, workdir) as dbs:
            ports = start_queens(procs, redis.url, dbs)
            args.publishes = publish_counter(redis.url)
            if quotas is not None:
                for name in "AB":
                    quotas.limit(name, procs.pids()[f"queen{name}"], args.cpus_each)
                args.quotas = quotas
            print(f"# {machine()}; load average {os.getloadavg()[0]:.1f} at start; database: "
                  f"{args.db_used}; {args.workers} stub workers x {args.max_jobs} slots on A "
                  f"only; {args.duration:g} s (+{args.warmup:g} s warm-up) per row"
                  f"{f', best of {args.repeat}' if args.repeat > 1 else ''}"
                  f"{f'; each queen capped at {args.cpus_each:g} CPU' if quotas else ''}",
                  flush=True)
            phases: list[Phase] = []
            profiled_conc = max(args.concurrency if args.profile_load == "ttft"
                                else args.stream_concurrency)
            for join in args.join_tokens:
                start_workers(procs, args, ports, join)
                pids = {"A": procs.pids()["queenA"], "B": procs.pids()["queenB"],
                        "worker": procs.pids()["worker"], "redis": redis.popen.pid}
                plan = [("ttft", args.ttft_tokens, c) for c in args.concurrency]
                if join != args.join_tokens[0]:
                    plan = []  # TTFT once, with the first join setting (the real worker's)
                plan += [("stream", args.tokens, c) for c in args.stream_concurrency]
                for kind, tokens, conc in plan:
                    for target in "AB":
                        hooks = (None, None)
                        if args.profile and kind == args.profile_load \
                                and target == args.profile_via and conc == profiled_conc \
                                and join == args.join_tokens[0]:
                            hooks = spy_hooks(args, pids, spies)
                        tries = [run_phase(kind, target, ports[target], tokens=tokens, join=join,
                                           concurrency=conc, args=args, pids=pids, hooks=hooks
                                           if i == 0 else (None, None))
                                 for i in range(args.repeat)]
                        procs.check_alive()
                        # Other work on the machine only slows a row down: keep its best try.
                        best = (min(tries, key=lambda p: p.ttft(0.5)) if kind == "ttft"
                                else max(tries, key=lambda p: p.rps))
                        print(f"#   {kind} {target} join={join} c={conc}: {best.rps:,.0f} req/s, "
                              f"ttft p50 {best.ttft(0.5):.3f} ms, errors {best.errors}",
                              flush=True)
                        phases.append(best)
            for name, spy, stacks in spies:
                spy.communicate(timeout=60)
                tokens = args.ttft_tokens if args.profile_load == "ttft" else args.tokens
                verb = "relayed" if args.profile_via == "B" else "served"
                print(f"\n## py-spy of queen {name} while {args.profile_via} {verb} "
                      f"{tokens}-token streams "
                      f"({args.join_tokens[0]} tokens a frame) at c={profiled_conc}: {stacks}")
                print_stack_summary(stacks, args.profile_top)
            return phases
    except BaseException:
        for name in procs.procs:
            print(f"--- {name} log ---\n{procs.log_tail(name)}", file=sys.stderr)
        raise
    finally:
        for _, spy, _ in spies:
            if spy.poll() is None:
                spy.kill()
        procs.stop_all()
        if quotas is not None:
            quotas.close()
        redis.stop(kill=True)
        shutil.rmtree(workdir, ignore_errors=True)


def run_phase(kind: str, target: str, port: int, *, tokens: int, join: int, concurrency: int,
              args: argparse.Namespace, pids: dict[str, int],
              hooks: tuple[Callable[[], None] | None, Callable[[], None] | None]) -> Phase:
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(drive(kind, target, port, tokens=tokens, join=join,
                                concurrency=concurrency, warmup=args.warmup,
                                duration=args.duration, pids=pids, on_start=hooks[0],
                                on_stop=hooks[1], quotas=getattr(args, "quotas", None),
                                publishes=getattr(args, "publishes", None)))


def spy_hooks(args: argparse.Namespace, pids: dict[str, int],
              spies: list[tuple[str, subprocess.Popen[bytes], Path]]
              ) -> tuple[Callable[[], None], Callable[[], None]]:
    """py-spy attached to both queens for one measured window."""
    exe = py_spy()
    assert exe is not None, "py-spy is not installed"
    out = Path(args.profile)
    out.parent.mkdir(parents=True, exist_ok=True)

    def start() -> None:
        for name in "AB":
            stacks = out.with_name(f"{out.name}-{name}.collapsed")
            spies.append((name, subprocess.Popen(
                [exe, "record", "--pid", str(pids[name]), "--rate", str(args.profile_rate),
                 "--format", "raw", "--function", "--output", str(stacks)],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE), stacks))

    def stop() -> None:
        for _, spy, _ in spies:
            spy.send_signal(signal.SIGINT)

    return start, stop


# --- the tables -------------------------------------------------------------------------------


def find(phases: list[Phase], kind: str, target: str, join: int, conc: int) -> Phase | None:
    return next((p for p in phases if (p.kind, p.target, p.join, p.concurrency)
                 == (kind, target, join, conc)), None)


def tables(args: argparse.Namespace, phases: list[Phase]) -> tuple[str, dict[str, object]]:
    join0 = args.join_tokens[0]
    lines = ["", f"Time to first token ({args.ttft_tokens}-token streams, joined up to {join0} "
             "a frame; ms from writing the request to the first SSE event with content):", "",
             "| conc | via | req/s | TTFT p50 | TTFT p95 | whole answer p50 | errors |",
             "|---|---|---|---|---|---|---|"]
    summary: dict[str, object] = {"added_ttft": {}, "streams": {}}
    added_rows = []
    for conc in args.concurrency:
        a, b = find(phases, "ttft", "A", join0, conc), find(phases, "ttft", "B", join0, conc)
        for p in (a, b):
            if p is not None:
                via = "A (local)" if p.target == "A" else "B (relayed)"
                lines.append(f"| {conc} | {via} | {p.rps:,.0f} | {p.ttft(0.5):.3f} | "
                             f"{p.ttft(0.95):.3f} | {p.total(0.5):.3f} | {p.errors} |")
        if a is not None and b is not None:
            added = {"p50_ms": b.ttft(0.5) - a.ttft(0.5), "p95_ms": b.ttft(0.95) - a.ttft(0.95)}
            summary["added_ttft"][conc] = added  # type: ignore[index]
            added_rows.append(f"| {conc} | **{added['p50_ms']:.3f}** | {added['p95_ms']:.3f} | "
                              f"{'met' if added['p50_ms'] <= TTFT_GOAL_MS else 'NOT met'} |")
    if added_rows:
        lines += ["", "Added by the hop (B less A):", "",
                  f"| conc | added TTFT p50 ms | added TTFT p95 ms | goal p50 <= {TTFT_GOAL_MS:g}"
                  " ms |", "|---|---|---|---|", *added_rows]
    capped = bool(args.cpus_each)
    lines += ["", f"Long streams ({args.tokens} tokens an answer, the stub emitting at once; "
              "CPU µs per token over the measured window"
              f"{f'; each queen capped at {args.cpus_each:g} CPU' if capped else ''}):", "",
              "| tokens a frame | conc | via | tokens/s | B/A | queen A µs/tok | "
              "queen B µs/tok | worker µs/tok | redis µs/tok | per-queen bound | "
              f"{'capped A / B | ' if capped else ''}SSE reads an answer | bus messages an "
              "answer | errors |",
              f"|---|---|---|---|---|---|---|---|---|---|{'---|' if capped else ''}---|---|---|"]
    for join in args.join_tokens:
        frames = text_frames(args.tokens, join)
        for conc in args.stream_concurrency:
            a = find(phases, "stream", "A", join, conc)
            for p in (a, find(phases, "stream", "B", join, conc)):
                if p is None:
                    continue
                ratio = f"{p.tokens_per_s / a.tokens_per_s:.2f}" if a is not None else "-"
                via = "A (local)" if p.target == "A" else "B (relayed)"
                bound = "-"
                if p.target == "B" and a is not None:
                    busier = max(p.cpu_us_per_token("A"), p.cpu_us_per_token("B"))
                    bound = f"{a.cpu_us_per_token('A') / busier:.2f}" if busier else "-"
                caps = (f"{p.capped.get('A', 0):.2f} / {p.capped.get('B', 0):.2f} | "
                        if capped else "")
                lines.append(
                    f"| {join} ({args.tokens / frames:.1f}) | {conc} | {via} | "
                    f"{p.tokens_per_s:,.0f} | {ratio} | {p.cpu_us_per_token('A'):.1f} | "
                    f"{p.cpu_us_per_token('B'):.1f} | {p.cpu_us_per_token('worker'):.1f} | "
                    f"{p.cpu_us_per_token('redis'):.1f} | {bound} | {caps}"
                    f"{p.pieces / max(p.requests, 1):.1f} | "
                    f"{p.published / max(p.requests, 1):.1f} | {p.errors} |")
                summary["streams"][f"{join}/{conc}/{p.target}"] = {  # type: ignore[index]
                    "tokens_per_s": p.tokens_per_s, "cpu_us_per_token": {
                        who: p.cpu_us_per_token(who) for who in p.cpu_s}}
    lines.append(f"\n(tokens a frame: the most the stub joins, and in brackets the mean over a "
                 f"{args.tokens}-token answer's text frames; the first, with the role, goes "
                 "alone. Per-queen bound: A's CPU a token serving locally over the busier "
                 "queen's when relaying, the B/A each queen's CPU allows were it alone on its "
                 "CPU" + (". Capped: the share of scheduler periods the queen spent at its quota"
                          if capped else "") + ")")
    return "\n".join(lines), summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=5.0,
                        help="measured seconds per row (default 5)")
    parser.add_argument("--warmup", type=float, default=0.5,
                        help="unmeasured seconds before each row (default 0.5)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run each row this many times and keep the best (default 1)")
    parser.add_argument("--concurrency", type=int_list, default=[1, 8],
                        help="client connections for the TTFT rows (default 1,8)")
    parser.add_argument("--ttft-tokens", type=int, default=16,
                        help="tokens per answer in the TTFT rows (default 16)")
    parser.add_argument("--tokens", type=int, default=256,
                        help="tokens per answer in the long-stream rows (default 256)")
    parser.add_argument("--stream-concurrency", type=int_list, default=[1, 8],
                        help="client connections for the long-stream rows (default 1,8)")
    parser.add_argument("--join-tokens", type=int_list, default=[DEFAULT_JOIN, 1],
                        help=f"the stub's tokens per frame, one pass each (default "
                        f"{DEFAULT_JOIN},1: joined as the real worker does, then one a frame)")
    parser.add_argument("--workers", type=int, default=2, help="stub workers on A (default 2)")
    parser.add_argument("--max-jobs", type=int, default=32,
                        help="job slots per stub worker (default 32)")
    parser.add_argument("--db", help="a PostgreSQL server URL (postgresql+asyncpg://…/db) to "
                        "make the shared database on (default: APIARY_TEST_POSTGRES_URL, else "
                        "one SQLite file per replica)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run of a few seconds: short rows, c=1 and 4, 64 tokens")
    parser.add_argument("--json", help="also write every row and the summary to this file")
    parser.add_argument("--profile", metavar="PATH", help="py-spy both queens through one "
                        "relayed row (--profile-load, at its highest concurrency, the first "
                        "--join-tokens); writes PATH-A.collapsed and PATH-B.collapsed and "
                        "prints their summaries")
    parser.add_argument("--profile-load", choices=["ttft", "stream"], default="stream",
                        help="the relayed row to profile (default: the long streams)")
    parser.add_argument("--cpus-each", type=float, default=None, metavar="CPUS",
                        help="cap each queen at this many CPUs (a cgroup quota each; needs root): "
                             "each replica gets a CPU of its own, as on separate machines, and "
                             "neither takes the other's time (e.g. 0.5 on a 2-core machine)")
    parser.add_argument("--profile-via", choices=["A", "B"], default="B",
                        help="profile while the load goes to B (relayed; default) or to A (its "
                             "own workers: the baseline)")
    parser.add_argument("--profile-rate", type=int, default=250)
    parser.add_argument("--profile-top", type=int, default=20)
    args = parser.parse_args(argv)
    if args.quick:
        args.duration, args.warmup, args.repeat = 1.0, 0.2, 1
        args.concurrency = args.stream_concurrency = [1, 4]
        args.tokens = min(args.tokens, 64)
    started = time.monotonic()
    phases = run(args)
    text, summary = tables(args, phases)
    print(text, flush=True)
    print(f"\n# {time.monotonic() - started:.0f} s; load average {os.getloadavg()[0]:.1f} at "
          "the end", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "machine": machine(), "argv": sys.argv, "database": args.db_used,
            "phases": [asdict(p) for p in phases], "summary": summary}, indent=2))
    return 1 if any(p.errors for p in phases) else 0


if __name__ == "__main__":
    sys.exit(main())
