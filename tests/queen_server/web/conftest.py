from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from playwright.async_api import Browser

from tests.queen_server.web.support import (
    CHROMIUM,
    chromium,
    chromium_available,
    queen_with_pages,
)
from tests.support.queen import QueenHarness


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    if not chromium_available():
        pytest.skip(f"Debian's chromium is not installed at {CHROMIUM}: run .ci/chromium.sh")
    async with chromium() as launched:
        yield launched


@pytest.fixture
async def web_queen(tmp_path: Path) -> AsyncIterator[QueenHarness]:
    """A real queen with the pages and an admin token; open auth, so any key may chat."""
    async with queen_with_pages(tmp_path) as harness:
        yield harness
