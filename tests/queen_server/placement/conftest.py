"""Fixtures for the placement service's tests (the harness is in ``harness.py``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.queen_server.placement.group_harness import Groups, GroupSettings
from tests.queen_server.placement.harness import Swarm
from tests.support.fake_hub import make_gguf


@pytest.fixture(scope="module")
def header(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = make_gguf(Path(tmp_path_factory.mktemp("gguf")) / "m.gguf", blocks=4, embedding=64)
    return path.read_bytes()


@pytest.fixture
async def swarm(header: bytes) -> AsyncIterator[Swarm]:
    made = Swarm(header)
    yield made
    await made.service.stop()
    await made.catalog.close()


@pytest.fixture(scope="module")
def big_header(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = make_gguf(Path(tmp_path_factory.mktemp("gguf")) / "m.gguf", blocks=8,
                     embedding=1024)
    return path.read_bytes()


@pytest.fixture
async def groups(big_header: bytes) -> AsyncIterator[Groups]:
    made = Groups(big_header, GroupSettings())
    await made.pin()
    yield made
    await made.service.stop()
    await made.swarm.catalog.close()
