"""A worker that knows several URLs of one queen (its replicas, issue 18), against real queen
processes on 127.0.0.1: SIGKILL the replica it is on and it is welcomed by another within
seconds; a dead first URL is skipped at once, not after a backoff."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from desktop_worker.hardware import HardwareReport, NullGpuDetector, detect_hardware
from desktop_worker.jobs import JobRunner
from desktop_worker.link.backoff import Backoff, QueenRotation
from desktop_worker.link.client import LinkClient
from desktop_worker.service import WorkerService
from desktop_worker.settings import WorkerSettings
from tests.support.config_home import config_home  # noqa: F401 (autouse)
from tests.support.processes import Proc, free_port, health, queen_process, wait_for

# Time for a worker dropped by a killed replica to be welcomed by another: the bound
# is 10 s; the link's first retry comes within 1 s, so this holds with room on a busy machine.
BACK_WITHIN_S = 10.0


def no_gpus(models_dir: Path) -> HardwareReport:
    return detect_hardware(models_dir, nvidia=NullGpuDetector(), opencl=NullGpuDetector())


def hello_factory(tmp_path: Path) -> Callable[[], Awaitable[Any]]:
    settings = WorkerSettings(models_dir=tmp_path / "models", key_path=tmp_path / "key.pem",
                              key_store="file")
    return WorkerService(settings, detector=no_gpus).hello_factory


@contextlib.contextmanager
def queens(tmp_path: Path, count: int) -> Iterator[list[tuple[Proc, int]]]:
    """``count`` real queen processes (each its own SQLite file), started and healthy."""
    started: list[tuple[Proc, int]] = []
    try:
        for i in range(count):
            port = free_port()
            home = tmp_path / f"queen-{i}"
            home.mkdir()
            started.append((queen_process(home, port).start(), port))
        for proc, port in started:
            wait_for(lambda p=proc, n=port: not p.alive() or health(n).get("status") == "ok",
                     30, f"the queen on port {port}")
            assert proc.alive(), proc.log()
        yield started
    finally:
        for proc, _port in started:
            proc.stop(kill=True)


class Welcomes:
    """The URL each welcome came through, as they come."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[str] = asyncio.Queue()
        self.link: LinkClient | None = None

    def __call__(self, _welcome: Any) -> None:
        assert self.link is not None
        self.queue.put_nowait(self.link.url)

    async def next(self, timeout_s: float) -> str:
        async with asyncio.timeout(timeout_s):
            return await self.queue.get()


@contextlib.asynccontextmanager
async def linked(tmp_path: Path, urls: list[str], backoff: Backoff) -> AsyncIterator[Welcomes]:
    welcomes = Welcomes()
    runner = JobRunner(object(), has_model=lambda _name: False)  # type: ignore[arg-type]
    link = LinkClient(urls, hello_factory(tmp_path), runner, shutdown_grace_s=0.1,
                      backoff=backoff, on_welcome=welcomes)
    welcomes.link = link
    stop = asyncio.Event()
    task = asyncio.create_task(link.run(stop))
    try:
        yield welcomes
    finally:
        stop.set()
        async with asyncio.timeout(15):
            await task


def ws(port: int) -> str:
    return f"ws://127.0.0.1:{port}/worker"


async def test_a_worker_on_a_killed_replica_is_back_on_another_within_seconds(
        tmp_path: Path) -> None:
    with queens(tmp_path, 2) as [(first, first_port), (_second, second_port)]:
        # A backoff that would wait 30 s and more after failures: only the quick retry after a
        # welcomed session can bring the worker back in time.
        backoff = Backoff(base_s=30, cap_s=60)
        async with linked(tmp_path, [ws(first_port), ws(second_port)], backoff) as welcomes:
            assert await welcomes.next(15) == ws(first_port)
            assert await asyncio.to_thread(lambda: health(first_port)["workers"]) == 1
            killed_at = time.monotonic()
            first.stop(kill=True)  # SIGKILL: no close frame, the socket simply dies
            assert await welcomes.next(BACK_WITHIN_S) == ws(second_port)
            back_after = time.monotonic() - killed_at
            assert back_after < BACK_WITHIN_S
            assert await asyncio.to_thread(lambda: health(second_port)["workers"]) == 1


async def test_a_dead_first_url_is_skipped_at_once(tmp_path: Path) -> None:
    dead = free_port()  # nothing listens there
    with queens(tmp_path, 1) as [(_queen, port)]:
        started = time.monotonic()
        async with linked(tmp_path, [ws(dead), ws(port)], Backoff(base_s=30)) as welcomes:
            assert await welcomes.next(10) == ws(port)
        # One failed connect hops to the next URL within a quarter second, not base_s.
        assert time.monotonic() - started < 10


async def test_when_every_url_fails_the_backoff_applies_per_round(tmp_path: Path) -> None:
    """Two dead URLs: the first failure hops at once, the second (a full round) waits the
    backoff, shown in the state as the app shows it."""
    states: list[tuple[str, str]] = []
    two_failures = asyncio.Event()

    def on_state(state: str, detail: str) -> None:
        states.append((state, detail))
        if sum(seen == "disconnected" for seen, _ in states) >= 2:
            two_failures.set()

    runner = JobRunner(object(), has_model=lambda _name: False)  # type: ignore[arg-type]
    urls = [ws(free_port()), ws(free_port())]
    link = LinkClient(urls, hello_factory(tmp_path), runner,
                      backoff=Backoff(base_s=20, first_s=1), on_state=on_state)
    stop = asyncio.Event()
    task = asyncio.create_task(link.run(stop))
    async with asyncio.timeout(20):
        await two_failures.wait()
    stop.set()
    async with asyncio.timeout(10):
        await task
    dialled = [detail for state, detail in states if state == "connecting"]
    assert dialled[:2] == urls
    waits = [float(detail.split()[2]) for state, detail in states if state == "disconnected"]
    assert waits[0] <= 0.25
    assert 10 <= waits[1] <= 20


@pytest.mark.parametrize("urls", [[], ["ws://127.0.0.1:1/worker", "not a url"]])
async def test_a_list_with_no_usable_queen_fails_clearly(tmp_path: Path, urls: list[str]) -> None:
    from desktop_worker.errors import LinkError

    runner = JobRunner(object(), has_model=lambda _name: False)  # type: ignore[arg-type]
    hello = hello_factory(tmp_path)

    async def run() -> None:
        await LinkClient(urls, hello, runner).run(asyncio.Event())

    with pytest.raises(LinkError, match="queen"):
        await run()


def test_a_welcomed_session_that_drops_is_retried_within_a_second() -> None:
    backoff = Backoff(base_s=1, cap_s=60, stable_s=30, rng=random.Random(3), first_s=1)
    for _ in range(5):
        backoff.next_delay()  # failures before the worker got in
    assert backoff.after_drop(session_s=5) <= 1.0  # the first drop: back within a second
    # Sessions that keep ending soon after the welcome wait longer each time (a flapping queen)
    ceilings = [backoff.after_drop(session_s=1) for _ in range(4)]
    assert ceilings[-1] <= 16
    assert backoff.short_sessions == 5
    assert backoff.after_drop(session_s=45) <= 1.0  # a stable session starts over
    assert backoff.short_sessions == 0
    assert backoff.failures == 0


def test_drops_spread_workers_over_the_first_second() -> None:
    delays = [Backoff(rng=random.Random(seed)).after_drop(10) for seed in range(200)]
    assert max(delays) <= 1.0
    assert min(delays) < 0.1 < 0.9 < max(delays)  # spread, not all at once


def test_the_rotation_hops_through_the_urls_then_backs_off() -> None:
    rotation = QueenRotation(["a", "b", "c"], Backoff(base_s=8, rng=random.Random(1)),
                             hop_s=0.25, rng=random.Random(2))
    assert rotation.current == "a"
    hops = [rotation.after_attempt(welcomed=False, session_s=0) for _ in range(2)]
    assert rotation.current == "c"
    assert all(hop <= 0.25 for hop in hops)
    assert 4 <= rotation.after_attempt(welcomed=False, session_s=0) <= 8  # a full round failed
    assert rotation.current == "a"
    assert rotation.after_attempt(welcomed=True, session_s=100) <= 1.0  # dropped: next, fast
    assert rotation.current == "b"
    with pytest.raises(ValueError, match="no queen URL"):
        QueenRotation([], Backoff())


def test_one_url_keeps_the_plain_backoff() -> None:
    rotation = QueenRotation(["only"], Backoff(base_s=2, rng=random.Random(5)))
    waits = [rotation.after_attempt(welcomed=False, session_s=0) for _ in range(3)]
    assert rotation.current == "only"
    assert [(2**i, 2 ** (i + 1)) for i in range(3)] == [
        (low, high) for low, high, wait in ((1, 2, waits[0]), (2, 4, waits[1]), (4, 8, waits[2]))
        if low <= wait <= high]
