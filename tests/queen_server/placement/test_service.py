"""``PlacementService`` driven directly: a real ``Registry`` and ``ModelCatalog`` (over a fake
``FileReader`` that serves a real GGUF header), real ``Worker``s on fake connections that record
the frames the queen sends, and an injected clock for stalls. No HTTP, no sleeping: every wait
is on an event with a timeout."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from queen_server.catalog import ModelCatalog
from queen_server.catalog.facts import RemoteFile, RepoFiles
from queen_server.errors import (
    ApiError,
    InvalidRequest,
    ModelForbidden,
    ModelLoading,
    ModelNotFound,
    ModelUnverified,
    NoCapacity,
    RateLimited,
    WorkerFailed,
)
from queen_server.placement.service import PlacementService, refusal
from queen_server.swarm.registry import Registry
from queen_server.swarm.worker import Worker
from shared_schema import (
    Demand,
    DownloadProgress,
    Fetch,
    FetchFailed,
    ModelDescriptor,
    Status,
    decode,
)
from shared_schema.capabilities import FETCH
from shared_schema.fitting import MB
from tests.support.fake_hub import make_gguf

MODEL = "org/small-GGUF:Q4_K_M"
BIG = "org/big-GGUF:Q4_K_M"
GB = 1024 * MB
WAIT = 5.0  # the longest any test waits for an event


@dataclass
class Settings:
    """The queen's placement settings (``PlacementSettings``)."""

    on_demand: bool = True
    model_allow: list[str] = field(default_factory=list)
    model_deny: list[str] = field(default_factory=list)
    max_model_gb: float | None = 64.0
    model_wait_s: float = 20.0
    price_wait_s: float = 5.0
    fetch_stall_s: float = 120.0
    max_fetch_attempts: int = 3
    assumed_download_mb_s: float = 20.0
    max_copies_per_model: int = 4
    placements_per_hour: int = 30
    demand_interval_s: float = 60.0


class Clock:
    def __init__(self) -> None:
        self.now = 10_000.0

    def __call__(self) -> float:
        return self.now


class FakeReader:
    """A hub of repos whose ``.gguf`` files all carry one real small header; each file's
    listed size is what the test says (the queen never reads past the header)."""

    def __init__(self, header: bytes) -> None:
        self.header = header
        self.repos: dict[str, dict[str, int]] = {}
        self.errors: dict[str, ModelUnverified] = {}
        self.listings = 0

    def add(self, name: str, size: int, *extra_paths: str) -> None:
        repo_id, _, filter_ = name.partition(":")
        files = self.repos.setdefault(repo_id, {})
        files[f"model-{filter_}.gguf"] = size
        for path in extra_paths:
            files[path] = size

    def commit(self, repo_id: str) -> str:
        return hashlib.sha1(repo_id.encode()).hexdigest()

    def sha256(self, repo_id: str, path: str) -> str:
        return hashlib.sha256(f"{repo_id}/{path}".encode()).hexdigest()

    def listing(self, repo_id: str) -> RepoFiles:
        self.listings += 1
        if repo_id in self.errors:
            raise self.errors[repo_id]
        files = self.repos.get(repo_id)
        if files is None:
            raise ModelUnverified(f"{repo_id} was not found", lasting=True, kind="not_found")
        return RepoFiles(repo_id, self.commit(repo_id), tuple(
            RemoteFile(path, size, self.sha256(repo_id, path)) for path, size in files.items()))

    def read_prefix(self, repo_id: str, commit: str, path: str, nbytes: int) -> bytes:
        return self.header[:nbytes]


class FakeConnection:
    """Records the frames the queen sends a worker, and queues its fetches."""

    def __init__(self, key: str, sent: asyncio.Queue[tuple[str, Any]],
                 broken: bool = False) -> None:
        self.key = key
        self.frames: list[Any] = []
        self.sent = sent
        self.broken = broken

    async def send_frame(self, frame: str) -> None:
        if self.broken:
            raise ConnectionResetError("the socket is gone")
        message = decode(frame)
        self.frames.append(message)
        if isinstance(message, Fetch):  # the queue is of fetches; demands stay in ``frames``
            self.sent.put_nowait((self.key, message))

    async def send_job(self, job_id: str, openai_url: str, openai_req: dict[str, Any],
                       continuation: str | None = None) -> None:
        raise AssertionError("placement sends no jobs")

    async def send_cancel(self, job_id: str, reason: str) -> None:
        raise AssertionError("placement cancels no jobs")

    async def close(self, code: int, reason: str) -> None:
        pass

    def fetches(self) -> list[Fetch]:
        return [f for f in self.frames if isinstance(f, Fetch)]


class Swarm:
    def __init__(self, header: bytes, settings: Settings | None = None) -> None:
        self.settings = settings or Settings()
        self.clock = Clock()
        self.registry = Registry()
        self.reader = FakeReader(header)
        self.reader.add(MODEL, 100 * MB)
        self.reader.add(BIG, 4 * GB)
        self.catalog = ModelCatalog(self.reader)
        self.speeds: dict[str, float] = {}
        self.service = PlacementService(
            self.settings, self.registry, self.catalog, speeds_for=lambda _c: self.speeds,
            size_class_of=lambda _m: "small", earn_msat_per_1k=lambda _m: 7, clock=self.clock)
        self.sent: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.connections: dict[str, FakeConnection] = {}
        self.workers: dict[str, Worker] = {}

    def add(self, name: str, *, room_mb: int = 50_000, memory_mb: int = 16_000,
            legacy: bool = False, fetch: bool = True, swarm_models: bool = False,
            models: Iterable[ModelDescriptor] = (), broken: bool = False) -> Worker:
        key = hashlib.sha256(name.encode()).hexdigest()
        worker = Worker(key=key, public_id=name, session_id="s", legacy=legacy,
                        capabilities=[FETCH] if fetch else [], models=models)
        worker.model_room_mb, worker.memory_budget_mb = room_mb, memory_mb
        worker.swarm_models = swarm_models
        connection = FakeConnection(name, self.sent, broken)
        self.registry.add(worker, connection)
        self.connections[name] = connection
        self.workers[name] = worker
        return worker

    def report(self, worker: Worker, *, models: list[ModelDescriptor] | None = None,
               downloads: Iterable[DownloadProgress] = (), paused: str | None = None) -> None:
        """A worker's status, handled as ``http.worker_ws`` does."""
        status = Status(models=models, downloads=list(downloads), paused=paused)
        self.registry.apply_status(worker, models=models)
        self.service.on_status(worker, status)

    def holds(self, worker: Worker, name: str, sha256: str | None = None) -> None:
        facts = self.catalog.pin(name)
        assert facts is not None
        self.report(worker, models=[ModelDescriptor(name=name, sha256=sha256 or facts.sha256,
                                                    loaded=True)])

    async def next_frame(self) -> tuple[str, Any]:
        return await asyncio.wait_for(self.sent.get(), WAIT)

    def no_frame(self) -> bool:
        return self.sent.empty()

    def all_fetches(self) -> list[tuple[str, Fetch]]:
        return [(name, f) for name, c in self.connections.items() for f in c.fetches()]


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


async def settle(task: asyncio.Task[Any]) -> None:
    """Let a task run until it waits (on the queen's events), without sleeping a fixed time."""
    for _ in range(50):
        await asyncio.sleep(0)
        if task.done():
            return


# --- one placement, one download ---------------------------------------------------------


async def test_two_concurrent_requests_share_one_placement(swarm: Swarm):
    swarm.add("a")
    swarm.add("b")
    first = asyncio.create_task(swarm.service.prepare(MODEL))
    second = asyncio.create_task(swarm.service.prepare(MODEL))
    name, _fetch = await swarm.next_frame()
    await settle(first)
    await settle(second)
    assert swarm.no_frame()  # one fetch, to one worker
    assert not first.done()
    assert not second.done()
    assert swarm.service.book.rows()[0].queued == 2
    swarm.holds(swarm.workers[name], MODEL)
    await asyncio.wait_for(asyncio.gather(first, second), WAIT)
    assert len(swarm.all_fetches()) == 1
    assert swarm.reader.listings == 1  # one resolution
    assert swarm.service.loading == {}
    assert swarm.service.book.rows() == []  # none waits now (``started`` counts them next)


async def test_the_fetch_names_the_pinned_commit_paths_and_sha256(swarm: Swarm):
    swarm.add("a")
    task = asyncio.create_task(swarm.service.prepare(MODEL))
    name, fetch = await swarm.next_frame()
    assert isinstance(fetch, Fetch)
    repo = "org/small-GGUF"
    assert fetch.name == MODEL
    assert fetch.repo_id == repo
    assert fetch.revision == swarm.reader.commit(repo)
    assert fetch.paths == ["model-Q4_K_M.gguf"]
    assert fetch.sha256 == swarm.reader.sha256(repo, "model-Q4_K_M.gguf")
    assert fetch.size_bytes == 100 * MB
    assert swarm.service.pinned(MODEL) == fetch.sha256
    swarm.holds(swarm.workers[name], MODEL)
    await asyncio.wait_for(task, WAIT)


async def test_a_worker_holding_another_file_does_not_end_the_wait(swarm: Swarm):
    worker = swarm.add("a")
    task = asyncio.create_task(swarm.service.prepare(MODEL))
    await swarm.next_frame()
    swarm.holds(worker, MODEL, sha256="f" * 64)  # the name, but not the pinned file
    await settle(task)
    assert not task.done()
    swarm.holds(worker, MODEL)
    await asyncio.wait_for(task, WAIT)


async def test_a_model_that_will_take_too_long_answers_model_loading(swarm: Swarm):
    swarm.add("a")
    with pytest.raises(ModelLoading) as caught:
        await swarm.service.prepare(BIG)
    error = caught.value
    assert (error.status_code, error.code) == (503, "model_loading")
    # 4 GB at the assumed 20 MB/s, then loading: about 211 s.
    estimate = error.extra["estimated_time"]
    assert isinstance(estimate, float)
    assert 205 < estimate < 215
    assert error.headers["Retry-After"] == str(round(estimate))
    assert "ready in about" in error.message
    assert len(swarm.all_fetches()) == 1  # the fetch went out all the same
    assert swarm.service.book.rows()[0].unmet_per_min > 0
    # Asking again joins the placement: no second fetch.
    with pytest.raises(ModelLoading):
        await swarm.service.prepare(BIG)
    assert len(swarm.all_fetches()) == 1


async def test_the_estimate_falls_with_reported_progress(swarm: Swarm):
    worker = swarm.add("a")
    with pytest.raises(ModelLoading):
        await swarm.service.prepare(BIG)
    loading = swarm.service.loading[BIG]
    before = swarm.service.estimate_s(loading)
    swarm.report(worker, downloads=[DownloadProgress(
        name=BIG, downloaded_bytes=2 * GB, total_bytes=4 * GB, bytes_per_s=200 * MB)])
    after = swarm.service.estimate_s(loading)
    assert after == pytest.approx(2048 / 200 + 4 + 2, abs=0.1)
    assert after < before
    rows = swarm.service.placements()
    assert rows[0]["downloaded_bytes"] == 2 * GB
    assert rows[0]["progress"] == 0.5
    # Now it will be ready within model_wait_s: the next request waits for it.
    task = asyncio.create_task(swarm.service.prepare(BIG))
    await settle(task)
    assert not task.done()
    swarm.holds(worker, BIG)
    await asyncio.wait_for(task, WAIT)


async def test_a_request_that_waits_in_vain_gets_model_loading(header: bytes):
    swarm = Swarm(header, Settings(model_wait_s=0.05, assumed_download_mb_s=1000))
    swarm.add("a")
    with pytest.raises(ModelLoading):  # the estimate (2 s) is past 0.05 s: no wait at all
        await swarm.service.prepare(MODEL)


# --- failures, departures and stalls -----------------------------------------------------


async def test_a_failed_fetch_moves_to_the_next_worker_then_gives_up(header: bytes):
    swarm = Swarm(header, Settings(max_fetch_attempts=2))
    for name in ("a", "b", "c"):
        swarm.add(name)
    task = asyncio.create_task(swarm.service.prepare(MODEL))
    first, _ = await swarm.next_frame()
    swarm.service.fetch_failed(swarm.workers[first], FetchFailed(
        name=MODEL, code="disk_full", message="no room"))
    second, fetch = await swarm.next_frame()
    assert second != first
    assert fetch.name == MODEL
    assert not task.done()
    swarm.service.fetch_failed(swarm.workers[second], FetchFailed(
        name=MODEL, code="sha256_mismatch", message="not the file named"))
    with pytest.raises(WorkerFailed) as caught:
        await asyncio.wait_for(task, WAIT)
    assert caught.value.code == "fetch_failed"
    assert "disk_full" in caught.value.message
    assert "sha256_mismatch" in caught.value.message
    assert len(swarm.all_fetches()) == 2  # the third worker was never asked
    assert MODEL not in swarm.service.loading


async def test_a_worker_that_left_is_replaced(swarm: Swarm):
    swarm.add("a")
    swarm.add("b")
    task = asyncio.create_task(swarm.service.prepare(MODEL))
    first, _ = await swarm.next_frame()
    worker = swarm.workers[first]
    swarm.service.left(worker)  # as http.worker_ws does: placement first, then the registry
    swarm.registry.remove(worker, "gone")
    second, _ = await swarm.next_frame()
    assert second != first
    swarm.holds(swarm.workers[second], MODEL)
    await asyncio.wait_for(task, WAIT)


async def test_a_fetch_that_cannot_be_sent_goes_to_the_next_worker(swarm: Swarm):
    swarm.add("broken", broken=True, room_mb=900_000)  # the most room: asked first
    swarm.add("b")
    task = asyncio.create_task(swarm.service.prepare(MODEL))
    name, _ = await swarm.next_frame()
    assert name == "b"
    await settle(task)
    assert not task.done()  # it waits for b (before the fix: 503 no_worker_fits at once, and
    # b fetched for a placement the queen had already forgotten)
    assert set(swarm.service.loading[MODEL].asked) == {swarm.workers["b"].key}
    assert "sending the fetch failed" in swarm.service.loading[MODEL].failed[
        swarm.workers["broken"].key]
    swarm.holds(swarm.workers["b"], MODEL)
    await asyncio.wait_for(task, WAIT)
    assert swarm.service.loading == {}


async def test_a_fetch_no_worker_can_be_sent_fails_the_request(swarm: Swarm):
    swarm.add("broken", broken=True)
    swarm.add("also-broken", broken=True)
    with pytest.raises(WorkerFailed) as caught:
        await swarm.service.prepare(MODEL)
    assert caught.value.code == "fetch_failed"
    assert "2 tried" in caught.value.message
    assert swarm.service.loading == {}


async def test_a_stalled_fetch_is_moved_after_fetch_stall_s(swarm: Swarm):
    swarm.add("a")
    swarm.add("b")
    with pytest.raises(ModelLoading):
        await swarm.service.prepare(BIG)
    first, _ = await swarm.next_frame()
    worker = swarm.workers[first]
    swarm.clock.now += 100
    swarm.report(worker, downloads=[DownloadProgress(name=BIG, downloaded_bytes=1 * MB)])
    swarm.clock.now += 100  # 200 s since the fetch, 100 since its progress
    swarm.service.check_stalls()
    assert swarm.no_frame()
    swarm.report(worker, downloads=[DownloadProgress(name=BIG, downloaded_bytes=1 * MB)])
    swarm.clock.now += 21  # the same bytes again are no progress: 121 s without any
    swarm.service.check_stalls()
    second, fetch = await swarm.next_frame()
    assert second != first
    assert fetch.name == BIG
    assert "stalled" in swarm.service.loading[BIG].failed[worker.key]


# --- refusals ----------------------------------------------------------------------------


async def test_no_worker_fits(swarm: Swarm):
    swarm.add("a", room_mb=500, memory_mb=8000)
    swarm.add("b", room_mb=3000, memory_mb=2000)
    with pytest.raises(NoCapacity) as caught:
        await swarm.service.prepare(BIG)
    error = caught.value
    assert (error.status_code, error.code) == (503, "no_worker_fits")
    assert "4,096 MB of disk" in error.message
    assert "3,000 MB of room" in error.message
    assert "8,000 MB memory budget" in error.message
    assert "2 workers" in error.message
    assert swarm.all_fetches() == []
    assert swarm.service.loading == {}


async def test_no_taker_at_all_leaves_the_404_to_the_caller(swarm: Swarm):
    swarm.add("legacy", legacy=True)
    swarm.add("no-fetch", fetch=False)
    await swarm.service.prepare(MODEL)  # returns: nobody to place it on
    await swarm.service.prepare("not a hub name")
    assert swarm.reader.listings == 0
    assert swarm.all_fetches() == []


@pytest.mark.parametrize(("kind", "status", "code", "kind_of_error"), [
    ("not_found", 404, "model_not_found", ModelNotFound),
    ("gated", 403, "model_gated", ModelForbidden),
    ("ambiguous", 400, "model_ambiguous", InvalidRequest),
    ("no_match", 400, "model_file_not_found", InvalidRequest),
    ("unreachable", 503, "hub_unreachable", NoCapacity),
    ("unpinned", 400, "model_unusable", InvalidRequest),
    ("invalid", 400, "model_unusable", InvalidRequest),
])
def test_refusal_maps_each_kind(kind: str, status: int, code: str,
                                kind_of_error: type[ApiError]):
    candidates = ["a-Q4_K_M.gguf", "b-Q4_K_M.gguf"] if kind in ("ambiguous", "no_match") else None
    error = refusal("org/x:Q4_K_M", ModelUnverified("why", lasting=kind != "unreachable",
                                                    kind=kind, candidates=candidates))
    assert isinstance(error, kind_of_error)
    assert (error.status_code, error.code) == (status, code)
    assert "org/x:Q4_K_M" in error.message
    if candidates:
        assert error.extra["candidates"] == candidates
        assert "a-Q4_K_M.gguf, b-Q4_K_M.gguf" in error.message
    if kind == "unreachable":
        assert error.headers["Retry-After"] == "30"


def test_refusal_lists_at_most_twenty_candidates():
    many = [f"m-{i}-Q4_K_M.gguf" for i in range(45)]
    error = refusal("org/x:Q4_K_M", ModelUnverified("why", lasting=True, kind="ambiguous",
                                                    candidates=many))
    assert "(and 25 more)" in error.message
    assert "m-20-Q4_K_M.gguf" not in error.message
    assert error.extra["candidates"] == many  # the body keeps them all


async def test_hub_refusals_through_prepare(swarm: Swarm):
    swarm.add("a")
    swarm.reader.add("org/two-GGUF:Q4_K_M", 100 * MB, "other-Q4_K_M-v2.gguf")
    swarm.reader.errors["org/gated-GGUF"] = ModelUnverified(
        "gated", lasting=True, kind="gated")
    swarm.reader.errors["org/down-GGUF"] = ModelUnverified("cannot reach", lasting=False)
    cases = {
        "org/missing-GGUF:Q4_K_M": (404, "model_not_found"),
        "org/gated-GGUF:Q4_K_M": (403, "model_gated"),
        "org/two-GGUF:Q4_K_M": (400, "model_ambiguous"),
        "org/small-GGUF:Q8_0": (400, "model_file_not_found"),
        "org/down-GGUF:Q4_K_M": (503, "hub_unreachable"),
    }
    for name, (status, code) in cases.items():
        with pytest.raises(ApiError) as caught:
            await swarm.service.prepare(name)
        assert (caught.value.status_code, caught.value.code) == (status, code), name
    with pytest.raises(InvalidRequest) as caught:
        await swarm.service.prepare("org/two-GGUF:Q4_K_M")
    assert sorted(caught.value.extra["candidates"]) == [  # type: ignore[arg-type]
        "model-Q4_K_M.gguf", "other-Q4_K_M-v2.gguf"]
    assert swarm.all_fetches() == []


async def test_the_deny_list_gives_403_without_asking_the_hub(header: bytes):
    swarm = Swarm(header, Settings(model_deny=["ORG/*"], model_allow=["*"]))
    swarm.add("a")
    with pytest.raises(ModelForbidden) as caught:
        await swarm.service.prepare(MODEL)
    assert caught.value.status_code == 403
    assert "deny-list" in caught.value.message
    assert swarm.reader.listings == 0
    assert swarm.all_fetches() == []


async def test_the_allow_list_gives_403_to_others(header: bytes):
    swarm = Swarm(header, Settings(model_allow=["trusted/*"]))
    swarm.add("a")
    with pytest.raises(ModelForbidden) as caught:
        await swarm.service.prepare(MODEL)
    assert "allow-list" in caught.value.message


async def test_max_model_gb(header: bytes):
    swarm = Swarm(header, Settings(max_model_gb=1.0))
    swarm.add("a")
    with pytest.raises(InvalidRequest) as caught:
        await swarm.service.prepare(BIG)
    assert (caught.value.status_code, caught.value.code) == (400, "model_too_large")
    assert "4.3 GB" in caught.value.message
    assert "up to 1 GB" in caught.value.message
    assert swarm.all_fetches() == []
    # A smaller one still goes.
    task = asyncio.create_task(swarm.service.prepare(MODEL))
    name, _ = await swarm.next_frame()
    swarm.holds(swarm.workers[name], MODEL)
    await asyncio.wait_for(task, WAIT)


async def test_placements_per_hour_stops_a_client_naming_many_real_models(header: bytes):
    swarm = Swarm(header, Settings(placements_per_hour=3, model_wait_s=0))
    for i in range(5):
        swarm.add(f"w{i}")
    names = [f"org/model{i}-GGUF:Q4_K_M" for i in range(10)]
    for name in names:
        swarm.reader.add(name, 100 * MB)
    answers: list[ApiError] = []
    for name in names:
        with pytest.raises(ApiError) as caught:
            await swarm.service.prepare(name)
        answers.append(caught.value)
    assert [a.code for a in answers[:3]] == ["model_loading"] * 3
    for limited in answers[3:]:
        assert isinstance(limited, RateLimited)
        assert (limited.status_code, limited.code) == (429, "placement_limit")
        assert 3500 < int(limited.headers["Retry-After"]) <= 3601
    assert len(swarm.all_fetches()) == 3
    # An hour later it places again.
    swarm.clock.now += 3601
    with pytest.raises(ModelLoading):
        await swarm.service.prepare(names[5])
    assert len(swarm.all_fetches()) == 4


async def test_asking_again_for_a_placed_model_spends_no_placement(header: bytes):
    swarm = Swarm(header, Settings(placements_per_hour=1, model_wait_s=0))
    swarm.add("a")
    for _ in range(5):
        with pytest.raises(ModelLoading):
            await swarm.service.prepare(MODEL)
    assert len(swarm.all_fetches()) == 1


# --- demand ------------------------------------------------------------------------------


async def test_tell_demand_sends_one_frame_to_each_v1_worker(swarm: Swarm):
    v1 = [swarm.add("a"), swarm.add("b", fetch=False)]
    swarm.add("legacy", legacy=True)
    with pytest.raises(ModelLoading):
        await swarm.service.prepare(BIG)
    swarm.service.started(MODEL, 0.0)
    await swarm.service.tell_demand()
    for worker in v1:
        demands = [f for f in swarm.connections[worker.public_id].frames
                   if isinstance(f, Demand)]
        assert len(demands) == 1
    assert swarm.connections["legacy"].frames == []
    demand = swarm.service.demand
    rows = {row.name: row for row in demand.models}
    big = rows[BIG]
    assert big.unmet_per_min > 0
    assert big.loading == 1
    assert big.holders == 0
    facts = swarm.catalog.pin(BIG)
    assert facts is not None
    assert big.sha256 == facts.sha256
    assert big.revision == facts.commit
    assert big.size_bytes == 4 * GB
    assert big.memory_mb is not None
    assert big.memory_mb >= 4096
    assert big.earn_msat_per_1k_tokens == 7
    assert rows[MODEL].sha256 is None  # asked for, but never resolved: not pinned
    sent = swarm.connections["a"].frames[-1]
    assert json.loads(sent.model_dump_json()) == json.loads(demand.model_dump_json())


async def test_a_broken_socket_does_not_stop_the_demand(swarm: Swarm):
    swarm.add("broken", broken=True)
    swarm.add("b")
    await swarm.service.tell_demand()
    assert len(swarm.connections["b"].frames) == 1


async def placed(swarm: Swarm, model: str, holder: Worker) -> None:
    """``model`` resolved, pinned and held by ``holder``."""
    task = asyncio.create_task(swarm.service.prepare(model))
    name, _ = await swarm.next_frame()
    assert name == holder.public_id
    swarm.holds(holder, model)
    await asyncio.wait_for(task, WAIT)


async def test_add_copies_places_another_copy_only_under_unmet_demand(swarm: Swarm):
    first = swarm.add("first", room_mb=900_000)
    swarm.add("second")
    await placed(swarm, MODEL, first)
    # Demand met at once: no copy.
    swarm.service.started(MODEL, 0.0)
    await swarm.service.tell_demand()
    await swarm.service.add_copies()
    assert len(swarm.all_fetches()) == 1
    # Requests that waited for a busy holder: one more copy, on the other worker.
    swarm.service.started(MODEL, 3.0)
    await swarm.service.tell_demand()
    await swarm.service.add_copies()
    name, fetch = await swarm.next_frame()
    assert name == "second"
    assert isinstance(fetch, Fetch)
    assert fetch.name == MODEL
    # While that copy loads, no third one.
    await swarm.service.tell_demand()
    await swarm.service.add_copies()
    assert len(swarm.all_fetches()) == 2
    swarm.holds(swarm.workers["second"], MODEL)
    assert MODEL not in swarm.service.loading


async def test_add_copies_stops_at_max_copies_per_model(header: bytes):
    swarm = Swarm(header, Settings(max_copies_per_model=1))
    first = swarm.add("first", room_mb=900_000)
    swarm.add("second")
    await placed(swarm, MODEL, first)
    swarm.service.started(MODEL, 10.0)
    await swarm.service.tell_demand()
    await swarm.service.add_copies()
    assert len(swarm.all_fetches()) == 1


async def test_add_copies_does_nothing_when_placement_is_off(header: bytes):
    swarm = Swarm(header)
    first = swarm.add("first", room_mb=900_000)
    swarm.add("second")
    await placed(swarm, MODEL, first)
    swarm.settings.on_demand = False
    swarm.service.started(MODEL, 10.0)
    await swarm.service.tell_demand()
    await swarm.service.add_copies()
    assert len(swarm.all_fetches()) == 1


# --- hostile and paused workers ----------------------------------------------------------


async def test_a_fetch_failed_for_a_model_never_asked_for_changes_nothing(swarm: Swarm):
    swarm.add("a")
    hostile = swarm.add("hostile")
    with pytest.raises(ModelLoading):
        await swarm.service.prepare(BIG)
    name, _ = await swarm.next_frame()
    other = "a" if name == "hostile" else "hostile"
    loading = swarm.service.loading[BIG]
    before = (dict(loading.asked), dict(loading.failed))
    liar = swarm.workers[other]
    swarm.service.fetch_failed(liar, FetchFailed(name=BIG, code="disk_full"))
    swarm.service.fetch_failed(hostile, FetchFailed(name="org/never-GGUF:Q4", code="memory"))
    swarm.service.fetch_failed(hostile, FetchFailed(name=MODEL, code="memory"))
    assert (dict(loading.asked), dict(loading.failed)) == before
    assert swarm.service.loading == {BIG: loading}
    await asyncio.sleep(0)  # a retry, had one been spawned, would have sent by now
    assert swarm.no_frame()


async def test_a_paused_worker_leaves_routing_and_comes_back(swarm: Swarm):
    worker = swarm.add("a", models=[ModelDescriptor(name=MODEL, loaded=True)])
    assert swarm.registry.candidates(MODEL) == [worker]
    assert worker in swarm.registry.takers()
    swarm.report(worker, paused="on battery")
    assert worker.paused == "on battery"
    assert swarm.registry.candidates(MODEL) == []
    assert worker not in swarm.registry.takers()
    await swarm.service.prepare(BIG)  # no taker left: the caller's 404, no fetch
    assert swarm.all_fetches() == []
    swarm.report(worker, paused="the GPU is in use")  # another reason: still out
    assert swarm.registry.candidates(MODEL) == []
    swarm.report(worker)
    assert worker.paused is None
    assert swarm.registry.candidates(MODEL) == [worker]
    assert worker in swarm.registry.takers()


async def test_placements_report(swarm: Swarm):
    worker = swarm.add("a")
    with pytest.raises(ModelLoading):
        await swarm.service.prepare(BIG)
    swarm.clock.now += 12
    (row,) = swarm.service.placements()
    assert row["model"] == BIG
    assert row["worker"] == "a"
    assert row["size_bytes"] == 4 * GB
    assert row["downloaded_bytes"] == 0
    assert row["since_s"] == 12.0
    assert row["failed"] == {}
    assert swarm.service.fits(worker, BIG) is None
    assert swarm.service.fits(worker, "org/unknown:Q4") == "not resolved"


async def test_a_placement_no_worker_takes_spends_no_placement(header: bytes):
    """Names too big for every worker must not use up the hour's placements."""
    swarm = Swarm(header, Settings(placements_per_hour=2, model_wait_s=0))
    swarm.add("a", room_mb=1000)
    for _ in range(5):
        with pytest.raises(NoCapacity) as caught:
            await swarm.service.prepare(BIG)
        assert caught.value.code == "no_worker_fits"
    with pytest.raises(ModelLoading):
        await swarm.service.prepare(MODEL)
    assert len(swarm.all_fetches()) == 1
