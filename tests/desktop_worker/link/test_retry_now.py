"""The owner's "Retry now" (issue 35): ``LinkClient.retry_now`` ends the backoff's wait at once,
against a real closed port on 127.0.0.1, and does nothing where there is no wait to cut."""

from __future__ import annotations

import asyncio
import random
import time

from desktop_worker.jobs import JobRunner
from desktop_worker.link.backoff import Backoff
from desktop_worker.link.client import LinkClient
from tests.support.processes import free_port

LONG_WAIT_S = 300.0  # the backoff's wait: a retry that waited it out would time the test out


async def no_hello() -> tuple[object, int]:
    """Never used: nothing listens, so no connection gets as far as a hello."""
    return (lambda _nonce, _origin: None), 1


def client_for(port: int, states: list[tuple[str, float]], changed: asyncio.Event) -> LinkClient:
    def on_state(state: str, _detail: str) -> None:
        states.append((state, time.monotonic()))
        changed.set()

    return LinkClient(f"ws://127.0.0.1:{port}/worker", no_hello,  # type: ignore[arg-type]
                      JobRunner(None, has_model=lambda _name: False),  # type: ignore[arg-type]
                      backoff=Backoff(base_s=LONG_WAIT_S, cap_s=LONG_WAIT_S,
                                      rng=random.Random(1)),
                      on_state=on_state)


async def next_state(states: list[tuple[str, float]], changed: asyncio.Event, wanted: str,
                     timeout_s: float = 10.0) -> float:
    """When the link next entered ``wanted`` (after what ``states`` already holds)."""
    seen = len(states)
    async with asyncio.timeout(timeout_s):
        while True:
            for state, at in states[seen:]:
                if state == wanted:
                    return at
            seen = len(states)
            changed.clear()
            await changed.wait()


async def test_retry_now_dials_again_at_once() -> None:
    states: list[tuple[str, float]] = []
    changed = asyncio.Event()
    client = client_for(free_port(), states, changed)
    assert not client.retry_now()  # stopped: nothing to cut
    stop = asyncio.Event()
    running = asyncio.create_task(client.run(stop))
    try:
        await next_state(states, changed, "disconnected")
        assert client.state == "disconnected"  # now waiting LONG_WAIT_S / 2 or more
        asked = time.monotonic()
        assert client.retry_now()
        again = await next_state(states, changed, "connecting", timeout_s=5.0)
        assert again - asked < 5.0
        # The attempt fails again (nothing listens): the link waits once more, and a second
        # Retry now cuts that wait too.
        await next_state(states, changed, "disconnected")
        assert client.retry_now()
        await next_state(states, changed, "connecting", timeout_s=5.0)
    finally:
        stop.set()
        await asyncio.wait_for(running, 10)
    assert client.state == "stopped"
    assert not client.retry_now()

