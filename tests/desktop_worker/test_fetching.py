"""The worker's side of the queen's fetches (``Fetcher``) against the fake hub with the real
SmolLM2 file: an ordinary fetch is downloaded and loaded; a fetch for a model group (issue 19)
is downloaded and checked but never loaded, since the model does not fit this worker alone."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import pytest

from desktop_worker.fetching import Fetcher
from desktop_worker.store import ModelStore
from shared_schema import Fetch, FetchFailed
from tests.support.fake_hub import FakeHub
from tests.support.on_demand import FILE, MODEL, REAL, REPO, repos


class Pool:
    """Records what the fetcher asks to load."""

    def __init__(self) -> None:
        self.loads: list[str] = []

    def loaded(self) -> frozenset[str]:
        return frozenset()

    async def load(self, name: str) -> Any:
        self.loads.append(name)

        class Plan:
            reason = "fits"

        return Plan()


async def run_fetch(tmp_path, *, group: bool) -> tuple[ModelStore, Pool, list[FetchFailed]]:
    with FakeHub(repos()) as hub:
        store = ModelStore(tmp_path / "models", endpoint=hub.url)
        pool = Pool()
        changed = asyncio.Event()
        fetcher = Fetcher(store, pool,  # type: ignore[arg-type]
                          evict=lambda: False, changed=changed.set)
        facts = await asyncio.to_thread(store.hub.list_files, REPO)
        failures: list[FetchFailed] = []

        async def report(failure: FetchFailed) -> None:
            failures.append(failure)

        sha256 = hashlib.sha256(REAL.read_bytes()).hexdigest()
        fetcher.start(Fetch(name=MODEL, repo_id=REPO, revision=facts.commit, paths=[FILE],
                            sha256=sha256, size_bytes=REAL.stat().st_size, group=group), report)
        async with asyncio.timeout(60):
            while fetcher.downloads():
                changed.clear()
                await changed.wait()
        await fetcher.close()
    return store, pool, failures


@pytest.mark.parametrize("group", [False, True])
async def test_a_fetch_for_a_group_is_downloaded_but_not_loaded(tmp_path, group: bool) -> None:
    store, pool, failures = await run_fetch(tmp_path, group=group)
    assert failures == []
    assert [m.name for m in store.list()] == [MODEL]
    assert pool.loads == ([] if group else [MODEL])
