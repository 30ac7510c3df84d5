"""Fixtures of the group tests: the fake RPC server a gate forwards to, and the worker sides
(and one process's reference text) the roles' tests drive."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from tests.desktop_worker.groups.gate_fakes import FakeRpcServer
from tests.desktop_worker.groups.roles_support import ASK, Side, make_side
from tests.support.one_process import one_process_text as reference_text


@pytest.fixture
async def rpc() -> AsyncIterator[FakeRpcServer]:
    """A fake llama.cpp RPC server on 127.0.0.1 that counts the connections it accepts."""
    server = FakeRpcServer()
    await server.start()
    yield server
    await server.stop()


@pytest.fixture(scope="module")
def one_process_text() -> str:
    """What one process writes for the roles' request: the text a group's answer must equal."""
    return reference_text(ASK)


@pytest.fixture
async def sides(tmp_path: Path) -> AsyncIterator[Callable[..., Side]]:
    """Makes worker sides (roles, pool, store) under ``tmp_path``; every one is closed after."""
    made: list[Side] = []

    def side(name: str, **options: Any) -> Side:
        made.append(make_side(tmp_path / name, **options))
        return made[-1]

    yield side
    for one in made:
        await one.close()
