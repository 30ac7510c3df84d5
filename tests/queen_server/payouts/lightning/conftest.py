"""Fixtures for the Lightning payout tests: the fake services and an HTTP client for them."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import httpx
import pytest

from queen_server.payouts.lightning import PayoutAddress, parse_payout_address
from tests.support.fake_lightning import FakeLnbits, FakeLnurlServer

LOCAL = frozenset({"127.0.0.1"})


@pytest.fixture
def lnurl_server() -> Iterator[FakeLnurlServer]:
    with FakeLnurlServer() as server:
        yield server


@pytest.fixture
def lnbits(lnurl_server: FakeLnurlServer) -> Iterator[FakeLnbits]:
    with FakeLnbits(network=lnurl_server) as wallet:
        yield wallet


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=5.0, trust_env=False) as http:
        yield http


@pytest.fixture
def alice(lnurl_server: FakeLnurlServer) -> PayoutAddress:
    address = parse_payout_address(lnurl_server.address("alice"), insecure_hosts=LOCAL)
    assert address is not None
    return address
