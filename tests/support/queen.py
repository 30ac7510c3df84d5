"""A real queen for tests: uvicorn serving ``create_app`` on a free 127.0.0.1 port, in the
test's own event loop, so tests can both talk to it over sockets and look at its registry."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI
from openai import AsyncOpenAI

from queen_server.app import create_app
from queen_server.runtime import QueenState
from queen_server.settings import QueenSettings

log = logging.getLogger(__name__)


class QueenHarness:
    def __init__(self, server: uvicorn.Server, app: FastAPI, port: int) -> None:
        self.server = server
        self.app = app
        self.state: QueenState = app.state.queen
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self.ws_url = f"ws://127.0.0.1:{port}/worker"
        self.clients: list[AsyncOpenAI] = []

    async def funded_key(self, sats: float, name: str = "dev") -> tuple[str, int]:
        """A new API key (with ``auth="keys"``) credited ``sats``: its secret and its id."""
        from queen_server.billing import ledger

        billing = self.state.billing
        secret, record = await billing.keys.create(name)
        if sats:
            await billing.ledger.post(ledger.deposit(record.id, round(sats * 1000),
                                                     f"deposit:test:{record.id}"))
        await billing.refresh()
        return secret, record.id

    def client(self, api_key: str = "test-key", **kwargs: Any) -> AsyncOpenAI:
        kwargs.setdefault("max_retries", 0)
        kwargs.setdefault("timeout", 20)
        client = AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key=api_key, **kwargs)
        self.clients.append(client)
        return client

    async def wait_until(
        self, predicate: Callable[[], bool], timeout_s: float = 5.0, what: str = "condition"
    ) -> None:
        """Poll a condition on the queen's state until it holds (fails after ``timeout_s``)."""
        async with asyncio.timeout(timeout_s):
            # The queen's state has no change events for tests to await, so poll it briefly.
            while not predicate():  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        log.debug("%s reached", what)


@contextlib.asynccontextmanager
async def running_queen(
    tmp_path: Path, *, prepare: Callable[[FastAPI], None] | None = None, **overrides: Any
) -> AsyncIterator[QueenHarness]:
    """A queen with test-friendly timeouts and ``overrides`` as settings; ``prepare(app)`` runs
    after ``create_app`` and before the app starts (to add a middleware, say)."""
    values: dict[str, Any] = {
        "db": f"sqlite+aiosqlite:///{tmp_path / 'queen.sqlite3'}",
        "heartbeat_interval_s": 0.5,
        # A worker is dropped after 5 s of silence, not 1.5: the queen shares its event loop
        # with the test and its scripted workers, and late in a full run (a large heap, a
        # loaded CI machine) one pause of that loop can outlast three pings. Two tests failed
        # so in full runs and never alone: a trainer gone right after its welcome, a worker
        # gone mid-flood. The test of the drop itself asks for 3 misses.
        "heartbeat_misses": 10,
        "queue_timeout_s": 1.0,
        "first_token_timeout_s": 5.0,
        "total_timeout_s": 10.0,
        "auth": "open",
        # The scripted workers' models are on no hub: the queen finds that out at once (nothing
        # listens on port 9) and prices them as unverified, here the tiny class they are.
        # Tests of the queen's own reading pass a fake hub's endpoint.
        "hub_endpoint": "http://127.0.0.1:9",
        "unverified_price_class": "tiny",
    }
    values.update(overrides)
    settings = QueenSettings(**values)
    app = create_app(settings)
    if prepare is not None:
        prepare(app)
    config = uvicorn.Config(
        app, host="127.0.0.1", port=0, log_level="warning", lifespan="on",
        ws_max_size=settings.max_frame_bytes, ws_per_message_deflate=False,
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    async with asyncio.timeout(10):
        while not server.started:
            if task.done():
                task.result()
            await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    harness = QueenHarness(server, app, port)
    try:
        yield harness
    finally:
        for client in harness.clients:
            await client.close()
        server.should_exit = True
        await task
