"""The worker's side of the queen's fetches (``Fetcher``) against the fake hub with the real
SmolLM2 file: an ordinary fetch is downloaded and loaded; a fetch for a model group (issue 19)
is downloaded and checked but never loaded, since the model does not fit this worker alone.

The volunteer's disk (issue 34), played by a queen asking too much: a fetch bigger than the free
disk is refused before anything reaches the hub, and one that would cross the headroom midway
stops, deletes its partial file and reports ``disk_full``."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import httpx
import pytest

from desktop_worker.fetching import Fetcher
from desktop_worker.store import ModelStore
from desktop_worker.store.disk import GIB
from shared_schema import Fetch, FetchFailed
from tests.support.diffusion_fixture import diffusion_model  # noqa: F401  (a fixture)
from tests.support.fake_disk import FakeDisk, huge_file
from tests.support.fake_hub import FakeHub, FakeRepo, make_gguf
from tests.support.on_demand import ASK, FILE, MODEL, REAL, REPO, repos, worker
from tests.support.queen import running_queen


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


# --- the volunteer's disk (issue 34) -------------------------------------------------------------


class Failures:
    """The ``fetch_failed`` reports a fetcher sends, and an event set at the first."""

    def __init__(self) -> None:
        self.sent: list[FetchFailed] = []
        self.arrived = asyncio.Event()

    async def report(self, failure: FetchFailed) -> None:
        self.sent.append(failure)
        self.arrived.set()


async def fetch_and_fail(store: ModelStore, fetch: Fetch) -> tuple[Pool, FetchFailed]:
    pool = Pool()
    fetcher = Fetcher(store, pool, evict=lambda: False, changed=lambda: None)  # type: ignore[arg-type]
    failures = Failures()
    fetcher.start(fetch, failures.report)
    async with asyncio.timeout(60):
        await failures.arrived.wait()
    await fetcher.close()
    assert len(failures.sent) == 1
    return pool, failures.sent[0]


async def test_a_fetch_for_a_64_gb_file_with_30_gb_free_is_refused_before_any_byte(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "hub-files" / "huge-Q8_0.gguf"
    sha256 = huge_file(path, 64 * GIB, monkeypatch)
    with FakeHub([FakeRepo("someone/Huge-GGUF", files={path.name: path})]) as hub:
        disk = FakeDisk(total_bytes=500 * GIB, free_bytes=30 * GIB)
        store = ModelStore(tmp_path / "models", endpoint=hub.url, disk=disk)
        pool, failed = await fetch_and_fail(store, Fetch(
            name="someone/Huge-GGUF:Q8_0", repo_id="someone/Huge-GGUF", revision="a" * 40,
            paths=[path.name], sha256=sha256, size_bytes=64 * GIB))
        assert failed.code == "disk_full"
        assert "needs 64.0 GiB" in failed.message
        assert hub.count() == 0  # not a listing, not a HEAD, not a GET: nothing reached the hub
    assert pool.loads == []
    assert store.list() == []


async def test_a_fetch_that_would_cross_the_headroom_midway_stops_and_deletes_its_file(
        tmp_path) -> None:
    big = make_gguf(tmp_path / "big.gguf", name="big", filler_bytes=8 << 20)
    size = big.stat().st_size
    with FakeHub([FakeRepo("someone/Big-GGUF", files={"big-Q8_0.gguf": big})]) as hub:
        root = tmp_path / "models"
        # Room for the file at the start; then the disk fills twice as fast as the download.
        disk = FakeDisk(total_bytes=50 * GIB, free_bytes=10 * GIB + size + (2 << 20),
                        filled_by=root, cost_per_byte=2.0)
        store = ModelStore(root, endpoint=hub.url, disk=disk, disk_check_bytes=256 * 1024)
        listing = await asyncio.to_thread(store.hub.list_files, "someone/Big-GGUF")
        pool, failed = await fetch_and_fail(store, Fetch(
            name="someone/Big-GGUF:Q8_0", repo_id="someone/Big-GGUF", revision=listing.commit,
            paths=["big-Q8_0.gguf"], sha256=hub.file_sha256("someone/Big-GGUF", "big-Q8_0.gguf"),
            size_bytes=size))
        assert hub.count("GET", "/resolve/") == 1  # the download had begun
    assert failed.code == "disk_full"
    assert "stopped downloading" in failed.message
    assert list(root.rglob("*.incomplete")) == []
    assert list(root.rglob("*.gguf")) == []
    assert disk.lowest_free >= 10 * GIB  # the 10 GB headroom of a 50 GB disk was never crossed
    assert store.list() == []
    assert pool.loads == []


async def test_the_queen_hears_the_room_past_the_headroom_and_plans_no_fetch_beyond_it(
        tmp_path) -> None:
    with FakeHub(repos()) as hub:
        # A 100 GB disk keeps 10 GB free: 500 MB of room at first, no quota.
        disk = FakeDisk(total_bytes=100 * GIB, free_bytes=10 * GIB + (500 << 20))
        store = ModelStore(tmp_path / "w" / "models", endpoint=hub.url, disk=disk)
        async with running_queen(tmp_path, hub_endpoint=hub.url, model_wait_s=0) as queen, \
                worker(tmp_path, queen, hub, "w", store=store) as service:
            record = queen.state.registry.get(service.identity.pubkey)
            assert record.model_room_mb == 500
            disk.free_bytes = 10 * GIB + (50 << 20)  # the owner's own files take the rest
            service.link.send_status_now()
            await queen.wait_until(lambda: record.model_room_mb == 50, 10, "status")
            # The 98 MB file now fits no worker: the developer hears so, and no fetch is sent.
            async with httpx.AsyncClient(base_url=queen.base_url, timeout=30) as http:
                answer = await http.post("/v1/chat/completions", json={"model": MODEL, **ASK})
            assert answer.status_code == 503
            assert answer.json()["error"]["code"] == "no_worker_fits"
            assert not service.fetcher.downloads()
        downloads = [r for r in hub.requests
                     if FILE in r.path and r.method == "GET" and r.range is None]
        assert downloads == []  # the queen's own header read is a Range request
    assert store.list() == []


# --- a diffusion model (issue 38) ----------------------------------------------------------------


async def test_a_fetched_diffusion_model_is_kept_but_not_loaded_into_llama_cpp(
        tmp_path, diffusion_model) -> None:  # noqa: F811
    """Its image child loads it on its first job; llama.cpp never sees it."""
    repo, file = "org/tiny-sd-GGUF", "sdxs-512-ds-Q4_0.gguf"
    with FakeHub([FakeRepo(repo, {file: diffusion_model.path})]) as hub:
        store = ModelStore(tmp_path / "models", endpoint=hub.url)
        pool = Pool()
        changed = asyncio.Event()
        fetcher = Fetcher(store, pool,  # type: ignore[arg-type]
                          evict=lambda: False, changed=changed.set, images=lambda: True)
        listing = await asyncio.to_thread(store.hub.list_files, repo)
        failures = Failures()
        fetcher.start(Fetch(name=f"{repo}:Q4_0", repo_id=repo, revision=listing.commit,
                            paths=[file], sha256=diffusion_model.sha256,
                            size_bytes=diffusion_model.size_bytes, kind="image"),
                      failures.report)
        async with asyncio.timeout(60):
            while fetcher.downloads():
                changed.clear()
                await changed.wait()
        await fetcher.close()
    assert failures.sent == []
    [kept] = store.list()
    assert kept.info.is_diffusion
    assert pool.loads == []


async def test_a_fetch_of_an_image_model_is_refused_by_a_worker_without_images(tmp_path) -> None:
    """A queen that sends an image model to a worker whose owner never turned images on gets
    ``no_images``, and nothing is asked of the hub."""
    with FakeHub(repos()) as hub:
        store = ModelStore(tmp_path / "models", endpoint=hub.url)
        sha256 = hashlib.sha256(REAL.read_bytes()).hexdigest()
        pool, failed = await fetch_and_fail(store, Fetch(
            name=MODEL, repo_id=REPO, revision="a" * 40, paths=[FILE], sha256=sha256,
            size_bytes=REAL.stat().st_size, kind="image"))
        assert hub.count() == 0
    assert failed.code == "no_images"
    assert store.list() == []
    assert pool.loads == []


async def test_an_image_fetch_whose_file_is_an_llm_is_deleted_again(tmp_path) -> None:
    """The image engine could not load it, and llama.cpp is not to: ``wrong_kind``."""
    with FakeHub(repos()) as hub:
        store = ModelStore(tmp_path / "models", endpoint=hub.url)
        listing = await asyncio.to_thread(store.hub.list_files, REPO)
        pool = Pool()
        fetcher = Fetcher(store, pool, evict=lambda: False,  # type: ignore[arg-type]
                          changed=lambda: None, images=lambda: True)
        failures = Failures()
        fetcher.start(Fetch(name=MODEL, repo_id=REPO, revision=listing.commit, paths=[FILE],
                            sha256=hashlib.sha256(REAL.read_bytes()).hexdigest(),
                            size_bytes=REAL.stat().st_size, kind="image"), failures.report)
        async with asyncio.timeout(60):
            await failures.arrived.wait()
        await fetcher.close()
        assert hub.count("GET", "/resolve/") >= 1  # it was downloaded, then refused
    [failed] = failures.sent
    assert failed.code == "wrong_kind"
    assert store.list() == []
    assert list((tmp_path / "models").rglob("*.gguf")) == []
    assert pool.loads == []
