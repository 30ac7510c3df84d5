"""The placement service's test harness: a real ``Registry`` and ``ModelCatalog`` over a fake
``FileReader`` serving a real GGUF header, real ``Worker``s on fake connections that record the
frames the queen sends, and an injected clock."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from queen_server.catalog import ModelCatalog
from queen_server.catalog.facts import RemoteFile, RepoFiles
from queen_server.errors import (
    ModelUnverified,
)
from queen_server.placement.service import PlacementService
from queen_server.swarm.registry import Registry
from queen_server.swarm.worker import Worker
from shared_schema import (
    DownloadProgress,
    Fetch,
    ModelDescriptor,
    Status,
    decode,
)
from shared_schema.capabilities import FETCH, IMAGE
from shared_schema.fitting import MB

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
    placements_per_key_per_hour: int = 10
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
        self.binary: list[bytes] = []  # relayed data frames (model groups)
        self.sent = sent
        self.broken = broken

    async def send_frame(self, frame: str) -> None:
        if self.broken:
            raise ConnectionResetError("the socket is gone")
        message = decode(frame)
        self.frames.append(message)
        if isinstance(message, Fetch):  # the queue is of fetches; demands stay in ``frames``
            self.sent.put_nowait((self.key, message))

    async def send_bytes(self, frame: bytes) -> None:
        if self.broken:
            raise ConnectionResetError("the socket is gone")
        self.binary.append(frame)

    async def send_job(self, job_id: str, openai_url: str, openai_req: dict[str, Any],
                       continuation: str | None = None, cache_scope: str | None = None) -> None:
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
            models: Iterable[ModelDescriptor] = (), broken: bool = False,
            images: bool = False) -> Worker:
        key = hashlib.sha256(name.encode()).hexdigest()
        capabilities = ([FETCH] if fetch else []) + ([IMAGE] if images else [])
        worker = Worker(key=key, public_id=name, session_id="s", legacy=legacy,
                        capabilities=capabilities, models=models)
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
        self.registry.apply_status(worker, models=models, status=status)
        self.service.on_status(worker)

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



async def settle(task: asyncio.Task[Any]) -> None:
    """Let a task run until it waits (on the queen's events), without sleeping a fixed time."""
    for _ in range(50):
        await asyncio.sleep(0)
        if task.done():
            return
