"""Routing at scale: routed requests/s with 32 and with 5,000 connected workers, a routing
decision at 10,000, and one released slot with 100 and with 10,000 jobs waiting.

Three parts (``--part``; all by default):

* ``swarm``: real processes on loopback. The queen (``python -m queen_server.cli``, open
  access), a worker process with protocol-v1 workers (``tests.support.workers.ScriptedWorker``,
  real handshakes, one slot each, answering at once, every one holding the model), and, in this
  process, 32 closed-loop keep-alive HTTP clients. It measures routed req/s with 32 workers
  connected, then connects more up to ``--workers`` (5,000) and measures again, in one run, and
  reads the queen's RSS. Goal (issue 18): the 5,000-worker figure at >= 0.7 of the 32-worker
  one, RSS <= 1 GB.
* ``decide``: in process. A registry of 10,000 workers; the time of one routing decision
  (``Registry.choose``) with its lease and release, against ``routing.rank`` over the same
  swarm (what every request did before). Goal: <= 100 µs at 10,000.
* ``release``: in process. The CPU of releasing one lease and handing the slot to the head of a
  queue of 100 and of 10,000 waiting jobs: it must not grow with the waiters.

    .venv/bin/python bench/routing_scale.py                     # all three (~2 min)
    .venv/bin/python bench/routing_scale.py --part decide,release
"""

from __future__ import annotations

import argparse
import asyncio
import random
import resource
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from admission import Client, cpu_s, read, request_bytes, write  # noqa: E402

from tests.support.processes import Proc, base_env, free_port, wait_for  # noqa: E402

MODEL = "test-org/echo-GGUF:Q4_K_M"


# --- swarm: real processes ----------------------------------------------------------------------


async def serve_workers(port: int, control: Path, report: Path) -> None:
    """Connect as many workers as ``control`` says, a hundred at a time; report how many."""
    from tests.support.workers import ScriptedWorker

    workers: list[ScriptedWorker] = []
    url = f"ws://127.0.0.1:{port}/worker"
    while True:
        try:
            wanted = int(read(control))
        except ValueError:
            wanted = 0
        while len(workers) < wanted:
            batch = min(100, wanted - len(workers))
            workers += await asyncio.gather(*(ScriptedWorker(url, max_jobs=1).start()
                                              for _ in range(batch)))
            write(report, str(len(workers)))
        write(report, str(len(workers)))
        await asyncio.sleep(0.2)


async def drive(port: int, concurrency: int, duration_s: float) -> tuple[int, int]:
    """Closed-loop clients for ``duration_s``: (answers with 200, other answers)."""
    loop = asyncio.get_running_loop()
    data = request_bytes(port)
    stop_at = loop.time() + duration_s
    counts = [0, 0]

    async def one() -> None:
        _, client = await loop.create_connection(Client, "127.0.0.1", port)
        import httptools
        while loop.time() < stop_at:
            client.parser = httptools.HttpResponseParser(client)
            client.done = loop.create_future()
            assert client.transport is not None
            client.transport.write(data)
            status = await client.done
            counts[0 if status == 200 else 1] += 1
            if status < 0:
                _, client = await loop.create_connection(Client, "127.0.0.1", port)
        assert client.transport is not None
        client.transport.close()

    await asyncio.gather(*(one() for _ in range(concurrency)))
    return counts[0], counts[1]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def part_swarm(args: argparse.Namespace) -> list[str]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="apiary-scale-") as name:
        tmp = Path(name)
        port = free_port()
        env = {**base_env(tmp), "APIARY_AUTH": "open", "APIARY_MAX_CONCURRENT_PER_KEY": "0",
               "APIARY_MAX_QUEUED_PER_KEY": "0"}
        queen = Proc([sys.executable, "-m", "queen_server.cli", "--port", str(port),
                      "--log-level", "warning", "--db",
                      f"sqlite+aiosqlite:///{tmp / 'queen.sqlite3'}"], tmp / "queen.log",
                     env).start()
        control, report = tmp / "wanted", tmp / "connected"
        workers = Proc([sys.executable, __file__, "--serve-workers", str(port), "--control",
                        str(control), "--report", str(report)], tmp / "workers.log",
                       base_env(tmp))
        try:
            wait_for(lambda: _answers(port), 30, "the queen")
            workers.start()
            assert queen.popen is not None
            for count in (32, args.workers):
                control.write_text(str(count))
                wait_for(lambda count=count: _connected(report) >= count or not workers.alive(),
                         600, f"{count} workers")
                if not workers.alive():
                    raise RuntimeError("the worker process died: " + workers.log()[-2000:])
                asyncio.run(drive(port, args.concurrency, 2.0))  # warm up
                before = cpu_s(queen.popen.pid)
                ok, other = asyncio.run(drive(port, args.concurrency, args.duration))
                used = cpu_s(queen.popen.pid) - before
                rows.append((count, ok / args.duration, other, used * 1e6 / max(1, ok),
                             rss_mb(queen.popen.pid)))
        finally:
            workers.stop()
            queen.stop()
    lines = [f"routed chat completions, {args.concurrency} closed-loop clients, "
             f"{args.duration:g} s per row",
             f"{'workers':>8} {'req/s':>8} {'errors':>7} {'queen µs/req':>13} {'RSS MB':>8}"]
    lines += [f"{count:>8} {rps:>8.0f} {other:>7} {us:>13.0f} {rss:>8.0f}"
              for count, rps, other, us, rss in rows]
    if len(rows) == 2 and rows[0][1]:
        lines.append(f"ratio at {rows[1][0]} workers: {rows[1][1] / rows[0][1]:.2f} of "
                     f"the {rows[0][0]}-worker figure (goal >= 0.7)")
    return lines


def _answers(port: int) -> bool:
    import httpx
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _connected(report: Path) -> int:
    try:
        return int(report.read_text())
    except (OSError, ValueError):
        return 0


# --- decide and release: in process ---------------------------------------------------------------


def swarm_of(count: int, seed: int = 1):  # type: ignore[no-untyped-def]
    from queen_server.swarm.registry import Registry
    from queen_server.swarm.worker import Worker
    from shared_schema import ModelDescriptor

    class Quiet:
        async def send_job(self, *args: object) -> None: ...
        async def send_cancel(self, *args: object) -> None: ...
        async def send_frame(self, frame: str) -> None: ...
        async def close(self, code: int, reason: str) -> None: ...

    rng = random.Random(seed)
    speeds = {}
    registry = Registry()
    workers = []
    for number in range(count):
        key = f"{number:064x}"
        worker = Worker(key=key, public_id=f"w{number}", session_id="s", max_jobs=2,
                        models=[ModelDescriptor(name=MODEL, loaded=rng.random() < 0.8)])
        speeds[key] = rng.uniform(0.01, 0.05)
        registry.add(worker, Quiet())
        workers.append(worker)
    registry.free.score = lambda w, _m: speeds[w.key] * w.trust
    for worker in workers:
        registry.models_changed(worker)
    return registry, workers, speeds


def part_decide(args: argparse.Namespace) -> list[str]:
    from queen_server.swarm.jobs import JobHandle
    from queen_server.swarm.routing import rank

    lines = [f"{'workers':>8} {'index µs/decision':>18} {'rank µs/decision':>17}"]
    for count in (32, 1000, args.decide_workers):
        registry, _workers, speeds = swarm_of(count)
        rounds = 20_000
        started = time.process_time()
        for number in range(rounds):
            worker = registry.choose(MODEL)
            assert worker is not None
            handle = JobHandle(f"j{number}", MODEL, worker.key, time.monotonic())
            registry.lease(worker, handle)
            registry.release(handle.id)
        index_us = (time.process_time() - started) / rounds * 1e6
        rng = random.Random(2)
        slow_rounds = max(20, 200_000 // count)
        started = time.process_time()
        for _ in range(slow_rounds):
            for worker in rank(MODEL, registry.candidates(MODEL), speeds, rng):
                if worker.free_slots > 0:
                    break
        rank_us = (time.process_time() - started) / slow_rounds * 1e6
        lines.append(f"{count:>8} {index_us:>18.1f} {rank_us:>17.1f}")
    return ["one routing decision (choose + lease + release), in process", *lines]


def part_release(args: argparse.Namespace) -> list[str]:
    from queen_server.swarm.jobs import JobHandle

    async def measure(waiting: int) -> float:
        registry, workers, _speeds = swarm_of(50)
        handles = []
        for number, worker in enumerate(workers):  # every slot taken
            for slot in range(worker.max_jobs):
                handle = JobHandle(f"busy-{number}-{slot}", MODEL, worker.key, time.monotonic())
                registry.lease(worker, handle)
                handles.append(handle)
        tasks = [asyncio.create_task(registry.wait_for_worker(MODEL, f"caller-{n % 7}", 600))
                 for n in range(waiting)]
        await asyncio.sleep(0)
        assert registry.waiting == waiting
        rounds = min(len(handles), waiting)
        started = time.process_time()
        for handle in handles[:rounds]:
            registry.release(handle.id)  # hands the slot to the head of the queue
        used = time.process_time() - started
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return used / rounds * 1e6

    lines = [f"{'waiting':>8} {'µs per release':>15}"]
    for waiting in (100, 10_000):
        lines.append(f"{waiting:>8} {asyncio.run(measure(waiting)):>15.1f}")
    return ["one released slot handed to the queue (release + hand-over), in process", *lines]


def raise_open_files() -> None:
    """Thousands of sockets: the soft limit on open files up to the hard one."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", default="swarm,decide,release")
    parser.add_argument("--workers", type=int, default=5000)
    parser.add_argument("--decide-workers", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--serve-workers", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--control", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--report", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_workers:
        raise_open_files()
        asyncio.run(serve_workers(args.serve_workers, args.control, args.report))
        return
    parts = {"swarm": part_swarm, "decide": part_decide, "release": part_release}
    for name in args.part.split(","):
        print("\n".join(parts[name](args)))
        print()


if __name__ == "__main__":
    main()
