"""Goodput under overload: how many of the answers the workers make reach a client still waiting.

Real processes on loopback: the queen (``python -m queen_server.cli``, open access, per-caller
limits off since every client here is one address), a worker process with ``--workers``
protocol-v1 workers that take ``--service-s`` per answer (``tests.support.workers.ScriptedWorker``
with a sleep; a cancel frees the slot at once, as a real worker's does), and, in this process,
``--clients`` closed-loop HTTP clients with ``--patience-s`` of patience. A client that waits
longer closes its connection (the queen sees the disconnect) and sends its next request on a
new one; a client told 503 waits out its ``Retry-After`` (at most its patience) first.

    .venv/bin/python bench/admission.py                        # 300 and 1,500 clients, 15 s each
    .venv/bin/python bench/admission.py --clients 300 --duration 10

Goodput is the answers clients received (HTTP 200 within their patience) over the answers the
workers finished. It also prints the queen's CPU per finished answer, from /proc. The issue's
goal (issue 18): goodput >= 80 % with 10x more clients than the workers can serve, and queen CPU
per released slot that does not grow with the number of waiters (see also
``bench/routing_scale.py``, which times one release with 100 and with 10,000 jobs waiting).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import httptools

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.processes import Proc, base_env, free_port, wait_for  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")


def write(path: Path, text: str) -> None:
    """A small status file between the bench's processes (written whole, at once)."""
    path.write_text(text)


def read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


# --- the worker process -------------------------------------------------------------------------


async def serve_workers(port: int, count: int, service_s: float, report: Path) -> None:
    from tests.support.workers import ScriptedWorker

    finished = 0

    class SlowWorker(ScriptedWorker):
        async def _run(self, job):  # type: ignore[no-untyped-def]
            nonlocal finished
            await asyncio.sleep(service_s)
            if any(cancel.id == job.id for cancel in self.cancels):
                return  # the queen cancelled it (its client left): no answer made
            await super()._run(job)
            finished += 1

    workers = [await SlowWorker(f"ws://127.0.0.1:{port}/worker", max_jobs=1).start()
               for _ in range(count)]
    write(report, json.dumps({"ready": True, "finished": 0}))
    try:
        while True:
            await asyncio.sleep(0.5)
            write(report, json.dumps({"ready": True, "finished": finished}))
    finally:
        for worker in workers:
            await worker.stop()


# --- the clients ---------------------------------------------------------------------------------


class Client(asyncio.Protocol):
    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.done: asyncio.Future[int] | None = None
        self.retry_after = 0.0
        self._header = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self._finish(-1)

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"retry-after":
            self.retry_after = float(value)

    def on_message_complete(self) -> None:
        self._finish(self.parser.get_status_code())

    def connection_lost(self, exc: Exception | None) -> None:
        self._finish(-1)

    def _finish(self, status: int) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_result(status)


def request_bytes(port: int) -> bytes:
    body = json.dumps({"model": "test-org/echo-GGUF:Q4_K_M", "max_tokens": 8,
                       "messages": [{"role": "user", "content": "hello"}]}).encode()
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            ).encode() + body


async def run_clients(port: int, clients: int, patience_s: float, duration_s: float,
                      ) -> dict[str, int]:
    loop = asyncio.get_running_loop()
    counts = {"ok": 0, "gave_up": 0, "shed": 0, "other": 0}
    data = request_bytes(port)
    stop_at = loop.time() + duration_s

    async def one_client() -> None:
        client: Client | None = None
        while loop.time() < stop_at:
            if client is None or client.transport is None or client.transport.is_closing():
                _, client = await loop.create_connection(Client, "127.0.0.1", port)
            client.parser = httptools.HttpResponseParser(client)
            client.done = loop.create_future()
            client.retry_after = 0.0
            assert client.transport is not None
            client.transport.write(data)
            try:
                status = await asyncio.wait_for(asyncio.shield(client.done), patience_s)
            except TimeoutError:
                counts["gave_up"] += 1
                client.transport.close()  # the client leaves; the queen sees the disconnect
                client = None
                continue
            if status == 200:
                counts["ok"] += 1
            elif status == 503:
                counts["shed"] += 1
                await asyncio.sleep(min(client.retry_after or 1.0, patience_s))
            else:
                counts["other"] += 1
                client = None
                await asyncio.sleep(0.1)

    await asyncio.gather(*(one_client() for _ in range(clients)))
    return counts


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def finished_answers(report: Path) -> int:
    try:
        return int(json.loads(report.read_text())["finished"])
    except (OSError, ValueError, KeyError):
        return -1


def one_run(args: argparse.Namespace, clients: int, tmp: Path) -> dict[str, float]:
    port = free_port()
    queen = Proc([sys.executable, "-m", "queen_server.cli", "--port", str(port), "--log-level",
                  "warning", "--db", f"sqlite+aiosqlite:///{tmp / f'q{clients}.sqlite3'}"],
                 tmp / f"queen-{clients}.log",
                 {**base_env(tmp), "APIARY_AUTH": "open", "APIARY_MAX_QUEUED_PER_KEY": "0",
                  "APIARY_MAX_CONCURRENT_PER_KEY": "0", "APIARY_MAX_QUEUED_JOBS": "100000",
                  "APIARY_QUEUE_TIMEOUT_S": str(args.queue_timeout_s)}).start()
    report = tmp / f"workers-{clients}.json"
    workers = Proc([sys.executable, __file__, "--serve-workers", str(port), "--workers",
                    str(args.workers), "--service-s", str(args.service_s), "--report",
                    str(report)], tmp / f"workers-{clients}.log", base_env(tmp))
    try:
        wait_for(lambda: _healthy(port), 30, "the queen")
        workers.start()
        wait_for(lambda: report.exists(), 60, "the workers")
        assert queen.popen is not None
        before_cpu, before_done = cpu_s(queen.popen.pid), finished_answers(report)
        counts = asyncio.run(run_clients(port, clients, args.patience_s, args.duration))
        time.sleep(1.0)  # the report file is rewritten every 0.5 s
        after_cpu, after_done = cpu_s(queen.popen.pid), finished_answers(report)
    finally:
        workers.stop()
        queen.stop()
    finished = after_done - before_done
    return {"clients": clients, "finished": finished, **counts,
            "goodput": counts["ok"] / finished if finished > 0 else 0.0,
            "queen_cpu_ms_per_answer": (after_cpu - before_cpu) * 1000 / max(1, finished)}


def _healthy(port: int) -> bool:
    import httpx
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default="300,1500")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--service-s", type=float, default=1.0)
    parser.add_argument("--patience-s", type=float, default=3.0)
    parser.add_argument("--duration", type=float, default=15.0)
    parser.add_argument("--queue-timeout-s", type=float, default=30.0)
    parser.add_argument("--serve-workers", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--report", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_workers:
        asyncio.run(serve_workers(args.serve_workers, args.workers, args.service_s, args.report))
        return
    rows = []
    with tempfile.TemporaryDirectory(prefix="apiary-admission-") as tmp:
        for clients in (int(value) for value in args.clients.split(",")):
            rows.append(one_run(args, clients, Path(tmp)))
    print(f"{args.workers} workers x {args.service_s:g} s per answer, clients wait "
          f"{args.patience_s:g} s, {args.duration:g} s per row, queue timeout "
          f"{args.queue_timeout_s:g} s")
    print(f"{'clients':>8} {'finished':>9} {'received':>9} {'gave up':>8} {'shed 503':>9} "
          f"{'other':>6} {'goodput':>8} {'queen ms/answer':>16}")
    for row in rows:
        print(f"{row['clients']:>8} {row['finished']:>9} {row['ok']:>9} {row['gave_up']:>8} "
              f"{row['shed']:>9} {row['other']:>6} {row['goodput']:>8.0%} "
              f"{row['queen_cpu_ms_per_answer']:>16.2f}")


if __name__ == "__main__":
    main()
