"""What the queen costs: routed requests per second, added latency, and relay cost per token.

One run starts three processes besides this one and drives the same HTTP load at each target:

* ``baseline``: a stub OpenAI server (raw asyncio + httptools on uvloop) that answers every chat
  completion at once, plain JSON or SSE, in the same shape as the queen's answers;
* ``queen``: the real queen (``python -m queen_server.cli``, API key required) with stub workers
  in a third process (``tests.support.workers.ScriptedWorker`` doing the real v1 handshake, many
  job slots each) that answer every job at once.

The load generator lives in this process: N keep-alive HTTP/1.1 connections, each sending the
next request as soon as the last answer is complete (closed loop), parsed with httptools in
``asyncio.Protocol`` callbacks so that it costs a few microseconds per request. It reports req/s,
latency percentiles, and the CPU time each process used (from /proc), so the queen's CPU per
request and per relayed token can be read apart from the stub worker's and the client's share.

    .venv/bin/python bench/queen_overhead.py                  # the whole benchmark (~1 min)
    .venv/bin/python bench/queen_overhead.py --repeat 2       # best of 2 per row (~2 min)
    .venv/bin/python bench/queen_overhead.py --duration 5 --concurrency 1,16,64 --tokens 1,256
    .venv/bin/python bench/queen_overhead.py --profile /tmp/prof/plain   # py-spy the queen
    .venv/bin/python bench/queen_overhead.py --profile /tmp/prof/stream --profile-load stream

The answer's size is asked for with ``max_tokens`` (the stub worker and the baseline both answer
with that many `` tok`` tokens), so one worker process serves every row. See bench/RESULTS.md.

The stub workers stream as the real worker does (``desktop_worker.link.coalesce``): their tokens
are made at once, faster than frames go out, so after the opening chunk they go out joined,
``--join-tokens`` to a frame (1: one frame per token, as before issue 18). Each streamed row
also gives the queen's CPU per token (``srv µs/tok``: its CPU per request over the tokens), and
the run says how many tokens each of the stub's frames carried.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httptools
import orjson
import uvloop

ROOT = Path(__file__).resolve().parents[1]
MODEL = "test-org/echo-GGUF:Q4_K_M"  # tests.support.workers.ECHO_MODEL
PLAIN_TOKENS = 16  # tokens in each non-streamed answer
API_KEY = "bench-key"  # the queen checks it on every request, as it would in production
CLK_TCK = os.sysconf("SC_CLK_TCK")

TARGETS = {"per_token_us": 50.0, "added_p50_ms": 2.0, "routed_rps": 2000.0}
DEFAULT_JOIN = 32  # desktop_worker.link.coalesce.DEFAULT_MAX_TOKENS (checked in main)


# --- the load generator ---------------------------------------------------------------------


class Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 client connection; ``request`` sends bytes, returns the answer."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(exc)

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        body = b"".join(self.body)
        self.body = []
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result((self.parser.get_status_code(), body))

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(exc or ConnectionError("the server closed the connection"))

    def _fail(self, exc: BaseException) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)

    def request(self, data: bytes) -> asyncio.Future[tuple[int, bytes]]:
        assert self.transport is not None
        self.waiter = waiter = asyncio.get_running_loop().create_future()
        self.transport.write(data)
        return waiter


def chat_request(port: int, *, stream: bool, tokens: int) -> bytes:
    body = orjson.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hello there, queen"}],
            "max_tokens": tokens,
            "stream": stream,
        }
    )
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nAuthorization: Bearer {API_KEY}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def answer_check(
    stream: bool, tokens: int
) -> tuple[Callable[[bytes], bool], Callable[[bytes], None]]:
    """A cheap check for every answer, and a full one for the first answer of each phase.
    (A streamed answer's tokens may come several to an event: the queen relays the frames its
    workers joined, ``desktop_worker.link.coalesce``.)"""
    token_count = b" tok"

    def cheap(body: bytes) -> bool:
        if stream:
            return body.endswith(b"data: [DONE]\n\n") and body.count(token_count) == tokens
        return body.count(b'"content":"' + b" tok" * tokens + b'"') == 1

    def full(body: bytes) -> None:
        if stream:
            events = [e for e in body.split(b"\n\n") if e]
            assert events[-1] == b"data: [DONE]", events[-1]
            chunks = [orjson.loads(e[len(b"data: "):]) for e in events[:-1]]
            text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
            assert all(c["object"] == "chat.completion.chunk" and c["model"] == MODEL
                       for c in chunks), chunks[0]
            assert chunks[-1]["choices"][0]["finish_reason"] == "stop", chunks[-1]
        else:
            answer = orjson.loads(body)
            assert answer["object"] == "chat.completion", answer
            assert answer["model"] == MODEL, answer
            text = answer["choices"][0]["message"]["content"]
        assert text == " tok" * tokens, text[:80]

    return cheap, full


@dataclass
class Phase:
    target: str
    load: str
    tokens: int
    concurrency: int
    seconds: float
    requests: int
    errors: int
    rps: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float
    cpu_s: dict[str, float]  # CPU seconds each process used in the measured window

    def cpu_pct(self, who: str) -> float:
        return 100.0 * self.cpu_s.get(who, 0.0) / self.seconds

    def cpu_us_per_request(self, who: str) -> float:
        return 1e6 * self.cpu_s.get(who, 0.0) / max(self.requests, 1)


def percentile(ordered: list[float], q: float) -> float:
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def proc_cpu_s(pid: int) -> tuple[float, float]:
    """(utime + stime, stime) of a process, in seconds (10 ms resolution)."""
    with open(f"/proc/{pid}/stat", "rb") as fh:
        fields = fh.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK, int(fields[12]) / CLK_TCK


def machine_busy_s() -> float:
    """CPU seconds the whole machine spent busy (all CPUs), from /proc/stat."""
    with open("/proc/stat", "rb") as fh:
        ticks = [int(x) for x in fh.readline().split()[1:]]
    idle = ticks[3] + ticks[4]  # idle + iowait
    return (sum(ticks[:8]) - idle) / CLK_TCK


def cpu_snapshot(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds used so far by each process (and its kernel share as ``name.sys``), by this
    load generator (``client``), and by everything else on the machine (``other``)."""
    snap: dict[str, float] = {}
    for name, pid in pids.items():
        snap[name], snap[f"{name}.sys"] = proc_cpu_s(pid)
    user, system = os.times()[:2]
    snap["client"] = user + system
    snap["other"] = machine_busy_s() - sum(v for k, v in snap.items() if "." not in k)
    return snap


async def drive(
    target: str,
    port: int,
    *,
    stream: bool,
    tokens: int,
    concurrency: int,
    warmup: float,
    duration: float,
    pids: dict[str, int],
    on_start: Callable[[], None] | None = None,
    on_stop: Callable[[], None] | None = None,
) -> Phase:
    """Closed-loop load: each connection sends its next request when its answer is complete."""
    loop = asyncio.get_running_loop()
    request = chat_request(port, stream=stream, tokens=tokens)
    cheap, full = answer_check(stream, tokens)
    conns = []
    for _ in range(concurrency):
        _, conn = await loop.create_connection(Connection, "127.0.0.1", port)
        conns.append(conn)
    status, body = await conns[0].request(request)
    assert status == 200, (status, body[:300])
    full(body)

    measuring = False
    stopping = False
    latencies: list[float] = []
    errors = 0
    clock = time.perf_counter

    async def client(conn: Connection) -> None:
        nonlocal errors
        record = latencies.append
        while not stopping:
            t0 = clock()
            status, body = await conn.request(request)
            t1 = clock()
            if measuring:
                record(t1 - t0)
                if status != 200 or not cheap(body):
                    errors += 1

    tasks = [asyncio.create_task(client(conn)) for conn in conns]
    await asyncio.sleep(warmup)
    if on_start is not None:
        on_start()
    cpu0 = cpu_snapshot(pids)
    t0 = clock()
    measuring = True
    await asyncio.sleep(duration)
    measuring = False
    t1 = clock()
    cpu1 = cpu_snapshot(pids)
    if on_stop is not None:
        on_stop()
    stopping = True
    await asyncio.gather(*tasks)
    for conn in conns:
        assert conn.transport is not None
        conn.transport.close()

    seconds = t1 - t0
    ordered = sorted(latencies)
    return Phase(
        target=target,
        load="stream" if stream else "plain",
        tokens=tokens,
        concurrency=concurrency,
        seconds=seconds,
        requests=len(ordered),
        errors=errors,
        rps=len(ordered) / seconds,
        p50_ms=1e3 * percentile(ordered, 0.50),
        p90_ms=1e3 * percentile(ordered, 0.90),
        p99_ms=1e3 * percentile(ordered, 0.99),
        mean_ms=1e3 * sum(ordered) / max(len(ordered), 1),
        cpu_s={name: cpu1[name] - cpu0[name] for name in cpu0},
    )


# --- the baseline: a stub OpenAI server -------------------------------------------------------


class StubOpenAI(asyncio.Protocol):
    """Answers ``POST /v1/chat/completions`` at once with ``max_tokens`` `` tok`` tokens, in the
    same JSON or SSE shape as the queen; ``GET /health`` answers ``{"status":"ok"}``."""

    def __init__(self) -> None:
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            assert self.transport is not None
            self.transport.close()

    def on_message_begin(self) -> None:
        self.url = b""
        self.body = []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        assert self.transport is not None
        if self.url == b"/health":
            self._send(b"application/json", b'{"status":"ok"}')
            return
        req = orjson.loads(b"".join(self.body))
        tokens = int(req.get("max_tokens") or 1)
        completion_id = "chatcmpl-" + secrets.token_hex(12)
        created = int(time.time())
        usage = {"prompt_tokens": 7, "completion_tokens": tokens, "total_tokens": 7 + tokens}
        if not req.get("stream"):
            self._send(b"application/json", orjson.dumps({
                "id": completion_id, "object": "chat.completion", "created": created,
                "model": req["model"],
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": " tok" * tokens}}],
                "usage": usage,
            }))
            return
        out = [b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
               b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n"]
        stamp = {"id": completion_id, "object": "chat.completion.chunk", "created": created,
                 "model": req["model"]}
        for seq in range(tokens + 2):
            if seq < tokens:
                delta = {"content": " tok"}
                if seq == 0:
                    delta = {"role": "assistant", "content": " tok"}
                choice = {"index": 0, "delta": delta, "finish_reason": None}
                event = b"data: " + orjson.dumps({**stamp, "choices": [choice]}) + b"\n\n"
            elif seq == tokens:
                choice = {"index": 0, "delta": {}, "finish_reason": "stop"}
                event = b"data: " + orjson.dumps({**stamp, "choices": [choice]}) + b"\n\n"
            else:
                event = b"data: [DONE]\n\n"
            out.append(b"%x\r\n%s\r\n" % (len(event), event))
        out.append(b"0\r\n\r\n")
        self.transport.write(b"".join(out))

    def _send(self, content_type: bytes, body: bytes) -> None:
        assert self.transport is not None
        self.transport.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s"
            % (content_type, len(body), body)
        )


async def serve_baseline(port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(StubOpenAI, "127.0.0.1", port)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


# --- the stub workers -------------------------------------------------------------------------


def answer_frames(job_id: str, stream: bool, tokens: int, join: int) -> list[str]:
    """The frames ScriptedWorker sends for an echo job of ``tokens`` `` tok`` tokens, joining up
    to ``join`` tokens a frame, built with orjson instead of pydantic models (same JSON, byte
    for byte; checked at start-up)."""
    from desktop_worker.link.coalesce import Coalescer

    usage = {"prompt_tokens": 7, "completion_tokens": tokens, "total_tokens": 7 + tokens}
    if not stream:
        data = {"choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": " tok" * tokens}}]}
        return [orjson.dumps({"type": "result", "id": job_id, "data": data,
                              "usage": usage}).decode()]
    outbox = Coalescer(join)
    for seq in range(tokens):
        delta = {"content": " tok", "role": "assistant"} if seq == 0 else {"content": " tok"}
        outbox.add({"choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
    outbox.add({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    frames = [orjson.dumps({"type": "chunk", "id": job_id, "seq": seq, "data": data,
                            "tokens": count}).decode()
              for seq, (data, count) in enumerate(outbox.drain())]
    frames.append(orjson.dumps({"type": "result", "id": job_id, "data": {},
                                "usage": usage}).decode())
    return frames


def text_frames(tokens: int, join: int) -> int:
    """How many frames carry the text of a streamed answer of ``tokens`` tokens."""
    return len(answer_frames("x", True, tokens, join)) - 2  # less the finish and the result


async def serve_workers(
    ws_url: str, count: int, max_jobs: int, ready_file: str, frames: str, join: int
) -> None:
    sys.path.insert(0, str(ROOT))
    from websockets.exceptions import ConnectionClosed

    from tests.support.workers import ECHO_MODEL, ScriptedWorker

    assert ECHO_MODEL == MODEL

    class BenchWorker(ScriptedWorker):
        """The scripted echo worker, answering with as many tokens as the job's ``max_tokens``.

        With ``frames == "orjson"`` it sends the same frames as ScriptedWorker, serialised
        without pydantic, so that the stub costs less than the queen it feeds."""

        async def _run(self, job: Any) -> None:
            tokens = int(job.openai_req.get("max_tokens") or 1)
            if frames == "pydantic":
                # ScriptedWorker._run reads tokens_per_answer before its first await, so
                # setting it just before is safe even with many jobs in flight.
                self.tokens_per_answer = tokens
                await super()._run(job)
                return
            assert self._ws is not None
            send = self._ws.send
            with contextlib.suppress(ConnectionClosed):
                for frame in answer_frames(job.id, bool(job.openai_req.get("stream")), tokens,
                                           self.chunk_tokens()):
                    await send(frame)

    await check_answer_frames(BenchWorker, join)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    workers = [await BenchWorker(ws_url, max_jobs=max_jobs, join_tokens=join).start()
               for _ in range(count)]
    # The queen lists a worker in /health before it has sent the worker its welcome, and a job
    # sent in that gap breaks ScriptedWorker.start; so the bench also waits for this file.
    await asyncio.to_thread(Path(ready_file).write_text, "ready")
    await stop.wait()
    for worker in workers:
        with contextlib.suppress(Exception):
            await worker.stop()


async def check_answer_frames(worker_class: Any, join: int) -> None:
    """Assert that ``answer_frames`` matches what ScriptedWorker itself sends."""
    from shared_schema import Job, Welcome
    from shared_schema.protocol import MAX_CHUNK_TOKENS

    for stream in (False, True):
        job = Job(id="bench-check.1", openai_url="/v1/chat/completions",
                  openai_req={"model": MODEL, "messages": [], "max_tokens": 3, "stream": stream})
        worker = worker_class("ws://unused", join_tokens=join)
        worker.welcome = Welcome(session_id="s", worker_id="w", heartbeat_interval_s=1,
                                 chunk_tokens=MAX_CHUNK_TOKENS)
        sent: list[str] = []

        async def capture(message: Any, sent: list[str] = sent) -> None:
            from shared_schema import encode

            sent.append(encode(message))

        worker._send = capture
        worker.tokens_per_answer = 3
        await super(worker_class, worker)._run(job)
        expected = answer_frames(job.id, stream, 3, worker.chunk_tokens())
        assert sent == expected, (sent, expected)


# --- processes --------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def http_get(port: int, path: str, timeout: float = 2.0) -> tuple[int, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     "Connection: close\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
            head, sep, body = data.partition(b"\r\n\r\n")
            length = _content_length(head) if sep else None
            if length is not None and len(body) >= length:
                break
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def _content_length(head: bytes) -> int | None:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return None


class Processes:
    """The child processes of a run; stopped (SIGINT, then SIGKILL) when the run ends."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> int:
        with open(self.workdir / f"{name}.log", "wb") as log:
            self.procs[name] = subprocess.Popen(
                argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
            )
        return self.procs[name].pid

    def pids(self) -> dict[str, int]:
        return {name: proc.pid for name, proc in self.procs.items()}

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.log_tail(name)}")

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self.workdir / f"{name}.log"
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, name: str, timeout: float = 30.0) -> int | None:
        proc = self.procs.pop(name, None)
        if proc is None or proc.poll() is not None:
            return None if proc is None else proc.returncode
        proc.send_signal(signal.SIGINT)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()

    def stop_all(self) -> None:
        for name in list(self.procs):
            self.stop(name, timeout=10.0)


def wait_healthy(
    procs: Processes, port: int, ready: Callable[[dict[str, Any]], bool], timeout: float = 30.0
) -> None:
    """Poll ``GET /health`` until ``ready`` holds for its JSON, or fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        procs.check_alive()
        try:
            status, body = http_get(port, "/health")
            if status == 200 and ready(orjson.loads(body)):
                return
            last = body
        except (OSError, ValueError, IndexError) as exc:
            last = exc
        time.sleep(0.05)
    raise RuntimeError(f"port {port} was not ready after {timeout:.0f} s: {last!r}")


def use_billed_key(db: str) -> None:
    """Make a key funded with 100 million sats, and send it instead of the development key, so
    every request is reserved, settled and written to the ledger."""
    global API_KEY
    made = subprocess.run(
        [sys.executable, "-m", "queen_server.cli", "--db", db, "keys", "create", "--name",
         "bench", "--credit-sats", "100000000"],
        capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    API_KEY = next(line for line in made.stdout.splitlines() if line.startswith("sk-apiary-"))


def start_queen(
    procs: Processes, args: argparse.Namespace, profile_session: Path | None = None
) -> int:
    port = free_port()
    db = f"sqlite+aiosqlite:///{procs.workdir / 'queen.sqlite3'}"
    queen = ["-m", "queen_server.cli", "--port", str(port), "--log-level", "warning",
             "--db", db]
    if args.billing:
        use_billed_key(db)
    prefix = [sys.executable]
    if profile_session is not None:
        prefix += ["-m", "pyinstrument", "-r", "pyisession", "-o", str(profile_session),
                   "-i", str(args.profile_interval)]
    procs.start("queen", prefix + queen,
                env={"PYTHONPATH": str(ROOT), "APIARY_API_KEYS": API_KEY})
    wait_healthy(procs, port, lambda health: health.get("status") == "ok")
    ready = procs.workdir / "workers.ready"
    procs.start("worker", [sys.executable, __file__, "--role", "workers", "--port", str(port),
                           "--workers", str(args.workers), "--max-jobs", str(args.max_jobs),
                           "--ready-file", str(ready), "--worker-frames", args.worker_frames,
                           "--join-tokens", str(args.join_tokens)],
                env={"PYTHONPATH": str(ROOT)})
    wait_healthy(procs, port, lambda health: ready.exists()
                 and health.get("workers") == args.workers
                 and health.get("job_slots") == args.workers * args.max_jobs)
    return port


def start_baseline(procs: Processes) -> int:
    port = free_port()
    procs.start("baseline", [sys.executable, __file__, "--role", "baseline", "--port", str(port)])
    wait_healthy(procs, port, lambda health: health.get("status") == "ok")
    return port


# --- the run ----------------------------------------------------------------------------------


def run_phases(args: argparse.Namespace, procs: Processes, ports: dict[str, int]) -> list[Phase]:
    pids = procs.pids()
    plan: list[tuple[str, bool, int, int]] = []  # (target, stream, tokens, concurrency)
    for concurrency in args.concurrency:
        for target in ports:
            plan.append((target, False, PLAIN_TOKENS, concurrency))
    for tokens in args.tokens:
        for concurrency in sorted({1, args.stream_concurrency}):
            for target in ports:
                plan.append((target, True, tokens, concurrency))

    async def go() -> list[Phase]:
        phases = []
        for target, stream, tokens, concurrency in plan:
            tries = []
            for _ in range(args.repeat):
                tries.append(await drive(
                    target, ports[target], stream=stream, tokens=tokens,
                    concurrency=concurrency, warmup=args.warmup, duration=args.duration,
                    pids={name: pid for name, pid in pids.items() if name == target
                          or (target == "queen" and name == "worker")},
                ))
                procs.check_alive()
            # Other work on the machine only ever slows a row down: keep its fastest try.
            phase = max(tries, key=lambda p: p.rps)
            print(row(phase), flush=True)
            phases.append(phase)
        return phases

    print(HEADER, flush=True)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(go())


HEADER = (
    f"{'target':<9}{'load':<12}{'conc':>5}{'req/s':>10}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}"
    f"{'errors':>7}{'srv cpu%':>9}{'wrk cpu%':>9}{'cli cpu%':>9}{'oth cpu%':>9}"
    f"{'srv µs/req':>11}{'srv µs/tok':>11}"
)


def row(p: Phase) -> str:
    load = f"{p.load} k={p.tokens}"
    server = p.target
    worker = f"{p.cpu_pct('worker'):9.0f}" if p.target == "queen" else f"{'-':>9}"
    return (
        f"{p.target:<9}{load:<12}{p.concurrency:>5}{p.rps:>10.0f}{p.p50_ms:>9.3f}{p.p90_ms:>9.3f}"
        f"{p.p99_ms:>9.3f}{p.errors:>7}{p.cpu_pct(server):>9.0f}{worker}"
        f"{p.cpu_pct('client'):>9.0f}{p.cpu_pct('other'):>9.0f}"
        f"{p.cpu_us_per_request(server):>11.0f}"
        + (f"{p.cpu_us_per_request(server) / p.tokens:>11.1f}" if p.load == "stream"
           else f"{'-':>11}")
    )


def find(phases: list[Phase], target: str, load: str, tokens: int, conc: int) -> Phase | None:
    for p in phases:
        if (p.target, p.load, p.tokens, p.concurrency) == (target, load, tokens, conc):
            return p
    return None


def summarise(args: argparse.Namespace, phases: list[Phase]) -> dict[str, Any]:
    lines: list[str] = []
    summary: dict[str, Any] = {"added": {}, "per_token": {}}
    for conc in args.concurrency:
        q = find(phases, "queen", "plain", PLAIN_TOKENS, conc)
        b = find(phases, "baseline", "plain", PLAIN_TOKENS, conc)
        if q is None or b is None:
            continue
        if not lines:
            lines = ["", "Added by the queen (queen minus baseline, non-streamed, same "
                         "concurrency):",
                     f"{'conc':>5}{'p50 ms':>9}{'p99 ms':>9}{'mean ms':>9}{'queen req/s':>13}"
                     f"{'baseline req/s':>16}{'queen cpu µs/req':>18}{'(kernel)':>10}"]
        added = {"p50_ms": q.p50_ms - b.p50_ms, "p99_ms": q.p99_ms - b.p99_ms,
                 "mean_ms": q.mean_ms - b.mean_ms}
        summary["added"][conc] = added
        lines.append(f"{conc:>5}{added['p50_ms']:>9.3f}{added['p99_ms']:>9.3f}"
                     f"{added['mean_ms']:>9.3f}{q.rps:>13.0f}{b.rps:>16.0f}"
                     f"{q.cpu_us_per_request('queen'):>18.0f}"
                     f"{q.cpu_us_per_request('queen.sys'):>10.0f}")
    small, big = min(args.tokens, default=0), max(args.tokens, default=0)
    if big > small:
        extra = big - small
        lines += ["", f"Relay cost per streamed token (k={big} against k={small}, "
                      f"divided by {extra} extra tokens):"]
        for conc in sorted({1, args.stream_concurrency}):
            q_big = find(phases, "queen", "stream", big, conc)
            q_small = find(phases, "queen", "stream", small, conc)
            if q_big is None or q_small is None:
                continue
            cpu = (q_big.cpu_us_per_request("queen") - q_small.cpu_us_per_request("queen")) / extra
            # Wall time per request from throughput (1/rps): at c=1 that is the mean latency, at
            # higher concurrency the time the whole pipeline spends per answer.
            wall_q = 1e6 * (1 / q_big.rps - 1 / q_small.rps) / extra
            figures = {"queen_cpu_us": cpu, "queen_wall_us": wall_q,
                       "tokens_per_s": q_big.rps * big}
            line = (f"  conc {conc:>3}: queen CPU {cpu:6.1f} µs/token; wall {wall_q:6.1f} "
                    f"µs/token")
            b_big = find(phases, "baseline", "stream", big, conc)
            b_small = find(phases, "baseline", "stream", small, conc)
            if b_big is not None and b_small is not None:
                wall_b = 1e6 * (1 / b_big.rps - 1 / b_small.rps) / extra
                figures.update(baseline_wall_us=wall_b, added_wall_us=wall_q - wall_b,
                               baseline_tokens_per_s=b_big.rps * big)
                line += f" (baseline {wall_b:5.1f}, added {wall_q - wall_b:6.1f})"
            line += f"; relayed {figures['tokens_per_s']:,.0f} tokens/s"
            if "baseline_tokens_per_s" in figures:
                line += f" (baseline {figures['baseline_tokens_per_s']:,.0f})"
            summary["per_token"][conc] = figures
            lines.append(line)
    routed = max((p.rps for p in phases if p.target == "queen" and p.load == "plain"), default=0)
    summary["routed_rps"] = routed
    lines += ["", "Targets:"]
    lines.append(f"  routed req/s      {routed:8.0f}   target >= {TARGETS['routed_rps']:.0f}   "
                 f"{'MET' if routed >= TARGETS['routed_rps'] else 'NOT MET'}")
    if 1 in summary["added"]:
        p50 = summary["added"][1]["p50_ms"]
        lines.append(f"  added p50 (c=1)   {p50:8.3f} ms target <= {TARGETS['added_p50_ms']} ms  "
                     f"{'MET' if p50 <= TARGETS['added_p50_ms'] else 'NOT MET'}")
    if summary["per_token"]:
        conc = max(summary["per_token"])
        worst = summary["per_token"][conc]["queen_cpu_us"]
        what = f"queen CPU at c={conc}"
        if "added_wall_us" in summary["per_token"].get(1, {}):
            worst = max(worst, summary["per_token"][1]["added_wall_us"])
            what = f"worse of queen CPU at c={conc} and added wall at c=1"
        target = TARGETS["per_token_us"]
        lines.append(f"  per token         {worst:8.1f} µs target <= {target:.0f} µs  "
                     f"{'MET' if worst <= target else 'NOT MET'}  ({what})")
    print("\n".join(lines), flush=True)
    return summary


def run_benchmark(args: argparse.Namespace) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="queen-bench-"))
    procs = Processes(workdir)
    try:
        ports = {}
        if "baseline" in args.targets:
            ports["baseline"] = start_baseline(procs)
        if "queen" in args.targets:
            ports["queen"] = start_queen(procs, args)
        print(f"# {machine()}; duration {args.duration:g} s (+{args.warmup:g} s warm-up) per row"
              f"{f', best of {args.repeat}' if args.repeat > 1 else ''}; "
              f"{args.workers} stub workers x {args.max_jobs} slots; plain answers carry "
              f"{PLAIN_TOKENS} tokens", flush=True)
        print("# srv = the server under test (baseline stub or queen); wrk = the stub workers' "
              "process; cli = this load generator; oth = everything else on the machine; "
              "cpu% of one core; srv µs/tok = srv µs/req over the tokens of a streamed answer",
              flush=True)
        for tokens in sorted(set(args.tokens)):
            frames = text_frames(tokens, args.join_tokens)
            print(f"# stub workers join up to {args.join_tokens} tokens a frame: a k={tokens} "
                  f"stream's text comes in {frames} frames ({tokens / frames:.1f} tokens a frame;"
                  " the first, with the role, alone)", flush=True)
        phases = run_phases(args, procs, ports)
        summary = summarise(args, phases)
        if args.json:
            Path(args.json).write_text(json.dumps(
                {"machine": machine(), "argv": sys.argv, "phases": [asdict(p) for p in phases],
                 "summary": summary}, indent=2))
    except BaseException:
        for name in procs.procs:
            tail = procs.log_tail(name)
            if tail:
                print(f"--- {name} log ---\n{tail}", file=sys.stderr)
        raise
    finally:
        procs.stop_all()
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


def py_spy() -> str | None:
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.exists() else shutil.which("py-spy")


def run_profile(args: argparse.Namespace) -> int:
    """Profile the queen through one load: py-spy attached for the measured window only, or the
    whole queen process run under pyinstrument."""
    profiler = args.profiler or ("py-spy" if py_spy() else "pyinstrument")
    workdir = Path(tempfile.mkdtemp(prefix="queen-bench-"))
    procs = Processes(workdir)
    out = Path(args.profile)
    out.parent.mkdir(parents=True, exist_ok=True)
    stream = args.profile_load == "stream"
    tokens = max(args.tokens) if stream else PLAIN_TOKENS
    conc = args.stream_concurrency if stream else max(args.concurrency)
    session = out.with_suffix(".pyisession")
    stacks = out.with_suffix(".collapsed")
    spy: list[subprocess.Popen[bytes]] = []

    def spy_start() -> None:
        exe = py_spy()
        assert exe is not None, "py-spy is not installed"
        spy.append(subprocess.Popen(
            [exe, "record", "--pid", str(procs.pids()["queen"]), "--rate", str(args.profile_rate),
             "--format", "raw", "--function", "--output", str(stacks)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))

    def spy_stop() -> None:
        spy[0].send_signal(signal.SIGINT)

    try:
        port = start_queen(procs, args,
                           profile_session=session if profiler == "pyinstrument" else None)
        print(HEADER, flush=True)
        hooks = (spy_start, spy_stop) if profiler == "py-spy" else (None, None)
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            phase = runner.run(drive(
                "queen", port, stream=stream, tokens=tokens, concurrency=conc,
                warmup=args.warmup, duration=args.duration, pids=procs.pids(),
                on_start=hooks[0], on_stop=hooks[1]))
        print(row(phase), flush=True)
        if spy:
            _, err = spy[0].communicate(timeout=60)
            if not stacks.exists():
                raise RuntimeError(f"py-spy wrote nothing: {err.decode(errors='replace')}")
        procs.stop("worker")
        code = procs.stop("queen", timeout=60.0)
        if profiler == "pyinstrument" and not session.exists():
            raise RuntimeError(f"pyinstrument wrote no session (exit {code}):\n"
                               f"{procs.log_tail('queen')}")
    finally:
        for proc in spy:
            if proc.poll() is None:
                proc.kill()
        procs.stop_all()
        shutil.rmtree(workdir, ignore_errors=True)
    if profiler == "pyinstrument":
        for renderer, suffix in (("text", ".txt"), ("pstats", ".pstats")):
            subprocess.run(
                [sys.executable, "-m", "pyinstrument", "--load", str(session), "-r", renderer,
                 "--no-color", "--show-all", "-o", str(out.with_suffix(suffix))],
                check=True,
            )
        print(f"profile: {out.with_suffix('.txt')} (call tree), "
              f"{out.with_suffix('.pstats')} (pstats); wall-clock samples of the whole run")
        print_pstats_self_time(out.with_suffix(".pstats"), args.profile_top)
    else:
        print(f"profile: {stacks} (py-spy collapsed stacks, CPU samples of the measured window)")
        print_stack_summary(stacks, args.profile_top)
    return 0


def print_pstats_self_time(path: Path, top: int) -> None:
    """The functions with the most self time, as shares of all sampled time."""
    import pstats

    stats = pstats.Stats(str(path))
    rows = [(tottime, cumtime, func) for func, (_cc, _nc, tottime, cumtime, _callers)
            in stats.stats.items()]  # type: ignore[attr-defined]
    total = sum(r[0] for r in rows) or 1.0
    print(f"\nself time, top {top} of {total:.2f} s sampled:")
    for tottime, _cumtime, (filename, line, name) in sorted(rows, reverse=True)[:top]:
        where = filename.replace(str(ROOT) + "/", "").split("site-packages/")[-1]
        print(f"  {100 * tottime / total:5.1f}%  {name}  ({where}:{line})")


# Where a sample's innermost Python frame lives, by file path; first match wins. C code (uvloop,
# pydantic-core, orjson, the socket syscalls) counts in the Python frame that called it.
BUCKETS = (
    ("queen_server/", "queen_server (api, dispatch, relay, sessions, jobs, routing)"),
    ("shared_schema/", "shared_schema (encode/decode of frames)"),
    ("fastapi/", "FastAPI (routing, dependency solving, middleware, telemetry)"),
    ("starlette/", "Starlette (requests, responses, middleware, websockets)"),
    ("uvicorn/protocols/http", "uvicorn HTTP protocol (httptools)"),
    ("uvicorn/protocols/websockets", "uvicorn websocket protocol (sans-I/O)"),
    ("websockets/", "websockets (frame parsing/serialising)"),
    ("uvicorn/", "uvicorn (other)"),
    ("pydantic", "pydantic (Python layer)"),
    ("opentelemetry", "opentelemetry"),
    ("anyio/", "anyio"),
    ("asyncio/", "asyncio (Python layer)"),
)


def bucket(frame: str) -> str:
    for needle, name in BUCKETS:
        if needle in frame:
            return name
    return "other (stdlib, built-ins)"


def print_stack_summary(path: Path, top: int) -> None:
    """Self and inclusive shares of py-spy's collapsed stacks, and self time per library."""
    from collections import Counter

    total = 0
    threads = 0
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    libraries: Counter[str] = Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        frames = stack.split(";")
        if "threading.py" in frames[0]:
            # Other threads (aiosqlite's) block in C calls that py-spy cannot tell from work.
            threads += n
            continue
        total += n
        own[frames[-1]] += n
        libraries[bucket(frames[-1])] += n
        for frame in set(frames):
            inclusive[frame] += n
    if not total:
        print("no samples")
        return
    print(f"\n{total} samples of the event-loop thread ({threads} of other, idle threads "
          "left out); self time by library:")
    for name, n in libraries.most_common():
        print(f"  {100 * n / total:5.1f}%  {name}")
    print(f"\nself time, top {top} functions:")
    for frame, n in own.most_common(top):
        print(f"  {100 * n / total:5.1f}%  {frame}")
    print(f"\ninclusive time, top {top} functions below the event loop:")
    shown = 0
    for frame, n in inclusive.most_common():
        if n >= 0.97 * total:  # the event loop and its callers: in (almost) every sample
            continue
        print(f"  {100 * n / total:5.1f}%  {frame}")
        shown += 1
        if shown >= top:
            break


def machine() -> str:
    model = "unknown CPU"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as fh:
        for line in fh:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return (f"{os.cpu_count()} CPUs ({model}), Python {sys.version.split()[0]}, "
            f"{sys.platform}")


def int_list(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=3.0,
                        help="measured seconds per row (default 3)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run each row this many times and keep the fastest (default 1)")
    parser.add_argument("--warmup", type=float, default=0.5,
                        help="unmeasured seconds before each row (default 0.5)")
    parser.add_argument("--concurrency", type=int_list, default=[1, 16, 64],
                        help="client connections for the non-streamed rows (default 1,16,64)")
    parser.add_argument("--tokens", type=int_list, default=[1, 256],
                        help="tokens per streamed answer (default 1,256)")
    parser.add_argument("--stream-concurrency", type=int, default=16,
                        help="connections for the saturated streaming rows (default 16)")
    parser.add_argument("--workers", type=int, default=4, help="stub workers (default 4)")
    parser.add_argument("--max-jobs", type=int, default=64,
                        help="job slots per stub worker (default 64)")
    parser.add_argument("--join-tokens", type=int, default=DEFAULT_JOIN,
                        help="the most tokens a stub worker joins into one chunk frame, as the "
                        f"real worker does (default {DEFAULT_JOIN}; 1: one frame per token)")
    parser.add_argument("--worker-frames", choices=["orjson", "pydantic"], default="orjson",
                        help="how the stub workers build their answer frames: orjson (default, "
                        "cheap) or pydantic (ScriptedWorker's own code path); same frames")
    parser.add_argument("--targets", type=lambda text: text.split(","),
                        default=["baseline", "queen"],
                        help="servers to load (default baseline,queen)")
    parser.add_argument("--billing", action="store_true",
                        help="send a funded, billed key (default: a development key, unbilled)")
    parser.add_argument("--json", help="also write every row and the summary to this file")
    parser.add_argument("--profile", metavar="PATH",
                        help="instead of the benchmark: profile the queen through one load; "
                        "writes PATH.collapsed (py-spy) or PATH.txt and PATH.pstats (pyinstrument)")
    parser.add_argument("--profiler", choices=["py-spy", "pyinstrument"],
                        help="default: py-spy if installed (samples only the measured window, "
                        "only while the queen is on a CPU), else pyinstrument")
    parser.add_argument("--profile-rate", type=int, default=250,
                        help="py-spy samples per second (default 250)")
    parser.add_argument("--profile-load", choices=["plain", "stream"], default="plain",
                        help="the load to profile: non-streamed at the highest --concurrency, or "
                        "streamed with the most --tokens at --stream-concurrency")
    parser.add_argument("--profile-interval", type=float, default=0.0005,
                        help="pyinstrument sampling interval in seconds (default 0.0005)")
    parser.add_argument("--profile-top", type=int, default=25)
    parser.add_argument("--role", choices=["bench", "baseline", "workers"], default="bench",
                        help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--ready-file", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from desktop_worker.link.coalesce import DEFAULT_MAX_TOKENS

    assert DEFAULT_JOIN == DEFAULT_MAX_TOKENS, "the stub must join as the real worker does"

    if args.role == "baseline":
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(serve_baseline(args.port))
        return 0
    if args.role == "workers":
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(serve_workers(f"ws://127.0.0.1:{args.port}/worker", args.workers,
                                     args.max_jobs, args.ready_file, args.worker_frames,
                                     args.join_tokens))
        return 0
    if args.profile:
        return run_profile(args)
    return run_benchmark(args)


if __name__ == "__main__":
    sys.exit(main())
