"""Fixtures of the group tests: the fake RPC server a gate forwards to."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.desktop_worker.groups.gate_fakes import FakeRpcServer


@pytest.fixture
async def rpc() -> AsyncIterator[FakeRpcServer]:
    """A fake llama.cpp RPC server on 127.0.0.1 that counts the connections it accepts."""
    server = FakeRpcServer()
    await server.start()
    yield server
    await server.stop()
