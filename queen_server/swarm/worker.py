"""A connected worker as the rest of the queen reads it: its directory entry, and the connection
the swarm writes to it through.

``Worker`` is facts only: who the worker is, what it holds and how many jobs it takes, as its
hello (or legacy registration) and later status messages said. Routing, the dispatcher, the
stats and the pages read it. It holds no socket and no protocol state (``swarm.link`` has those),
and it does not own its leases: the registry does, and shows each registered worker a read-only
view of its own (``jobs``) so that ``free_slots`` costs routing no lookup.

``Connection`` is what the swarm needs from whatever holds a worker's connection: send a job,
send a cancel, close. The websocket edge implements it today; a queen replica holding the
socket in another process could tomorrow.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any, Protocol

from queen_server.swarm.jobs import JobHandle
from shared_schema import DownloadProgress, Hello, ModelDescriptor, Status
from shared_schema.capabilities import FETCH
from shared_schema.training import AdapterRef

CAPABILITY_FETCH = "fetch_models"
MAX_RTT_S = 60.0  # a longer round trip is counted as this (a worker that stalls its pongs)

NO_LEASES: Mapping[str, JobHandle] = MappingProxyType({})


class Connection(Protocol):
    """Whatever holds a worker's connection. Every method may raise if the connection is gone."""

    async def send_job(
        self,
        job_id: str,
        openai_url: str,
        openai_req: dict[str, Any],
        continuation: str | None = None,
        cache_scope: str | None = None,
        adapter: AdapterRef | None = None,
    ) -> None:
        """Give the worker a job (``cache_scope``: the caller's prompt-cache scope, for the
        job frame; None: no reuse of another job's cache; ``adapter``: a fine-tuned model's
        adapter, ``Job.adapter``)."""
        ...

    async def send_cancel(self, job_id: str, reason: str) -> None: ...

    async def send_frame(self, frame: str) -> None:
        """A control message already encoded (a ``fetch``, a ``demand``)."""
        ...

    async def send_bytes(self, frame: bytes) -> None:
        """A binary frame (a model group's relayed data, issue 19)."""
        ...

    async def close(self, code: int, reason: str) -> None: ...


class Worker:
    """A worker's directory entry: what routing and the stats pages read.

    A legacy worker (from before protocol v1) takes one job at a time, registers no models and
    is assumed able to fetch whatever it is asked for, so it ranks in the lowest routing tier
    for every model; it has no key of its own, so nothing is credited to it.
    """

    __slots__ = (
        "cached",
        "capabilities",
        "closed",
        "connected_at",
        "device_free_mb",
        "downloads",
        "flagged",
        "gpus",
        "group_family",
        "held_by",
        "jobs",
        "key",
        "lan_hint",
        "legacy",
        "llama_build",
        "ln_url",
        "loaded",
        "max_jobs",
        "memory_budget_mb",
        "model_room_mb",
        "models",
        "paused",
        "peer_host",
        "public_id",
        "reserved",
        "rtt_ms",
        "session_id",
        "swarm_models",
        "trust",
        "uncovered",
        "vram_free_mb",
        "vram_mb",
        "worker_version",
    )

    def __init__(
        self,
        *,
        key: str,
        public_id: str,
        session_id: str,
        max_jobs: int = 1,
        models: Iterable[ModelDescriptor] = (),
        capabilities: Iterable[str] = (),
        worker_version: str = "",
        ln_url: str | None = None,
        gpus: Iterable[str] = (),
        vram_mb: int = 0,
        legacy: bool = False,
        connected_at: float | None = None,
    ) -> None:
        self.key = key
        self.public_id = public_id
        self.session_id = session_id
        self.legacy = legacy
        self.max_jobs = 1 if legacy else max_jobs
        self.capabilities = frozenset(capabilities)
        self.worker_version = worker_version
        self.ln_url = ln_url
        self.gpus = list(gpus)
        self.vram_mb = vram_mb
        self.connected_at = time.time() if connected_at is None else connected_at
        # Set by the registry: True once the worker has left it (disconnected, replaced, silent).
        self.closed = False
        # Set by the audit service (issue 16): a flagged worker is in no routing index; ``trust``
        # weighs its speed score in routing (below 1: audited good standing); an ``uncovered``
        # worker (new, with more answers waiting for audits than audits can cover) ranks with the
        # busy ones, so it gets real traffic only as fast as its answers can be checked.
        self.flagged = False
        self.trust = 1.0
        self.uncovered = False
        # The worker's leases, by job id: a read-only view the registry sets when it adds the
        # worker (``Registry.add``); only the registry writes the mapping behind it.
        self.jobs: Mapping[str, JobHandle] = NO_LEASES
        # Slots the registry handed to waiting jobs that have not leased them yet.
        self.reserved = 0
        # What placing a model on it needs (issue 17), from its hello and statuses: claims, used
        # only to choose whom to ask (a worker that lied just fails its fetch).
        self.memory_budget_mb: int | None = None
        self.model_room_mb: int | None = None
        self.vram_free_mb: int | None = None
        self.swarm_models = False
        # Model groups (issue 19), from its hello: its llama.cpp build, its LAN hint, and the
        # address this queen sees it at (``lan`` joins the two; a claim alone never makes one).
        self.llama_build: str | None = None
        self.lan_hint: str | None = None
        self.peer_host: str | None = None
        # Its owner's family of machines (issue 34): grouped only with the same family.
        self.group_family: str | None = None
        # The memory of each device it gives a group, MB, in its device order (a claim the
        # planner clamps), from its hello and statuses; None from older workers.
        self.device_free_mb: tuple[int, ...] | None = None
        # The queen's own measure of its round trip to the worker (ms; None until measured):
        # the handshake, then each heartbeat's ping and pong (``note_rtt``). Groups are planned
        # by it (a relayed member's every token crosses the queen twice).
        self.rtt_ms: float | None = None
        self.paused: str | None = None  # why its owner paused it; in no routing index then
        self.held_by: str | None = None  # the group it serves as a member; no routing either
        self.downloads: dict[str, DownloadProgress] = {}
        self.models: dict[str, ModelDescriptor] = {}
        self.loaded: frozenset[str] = frozenset()
        self.cached: frozenset[str] = frozenset()
        self.set_models(models)

    def __repr__(self) -> str:
        kind = "LegacyWorker" if self.legacy else "Worker"
        return f"<{kind} {self.public_id} jobs={len(self.jobs)}/{self.max_jobs}>"

    @property
    def can_fetch(self) -> bool:
        return self.legacy or CAPABILITY_FETCH in self.capabilities

    @property
    def takes_fetch(self) -> bool:
        """Whether the queen may place a model on it (a ``fetch`` command, issue 17)."""
        return FETCH in self.capabilities and not self.legacy

    @property
    def lan(self) -> str | None:
        """Its LAN as model groups compare them (issue 19): the hint it sent joined to the
        address this queen sees, so a worker can only share a LAN with workers behind the same
        public address, whatever it claims. None without both."""
        if not self.lan_hint or not self.peer_host or self.legacy:
            return None
        joined = f"apiary-lan|{self.peer_host}|{self.lan_hint}".encode()
        return hashlib.sha256(joined).hexdigest()[:16]

    def note_rtt(self, seconds: float) -> None:
        """One round trip measured by the queen's clock: kept as a moving average (the
        newest weighing a third), bounded to [0, ``MAX_RTT_S``]."""
        ms = min(max(0.0, seconds), MAX_RTT_S) * 1000.0
        self.rtt_ms = ms if self.rtt_ms is None else self.rtt_ms + (ms - self.rtt_ms) / 3

    @property
    def earnings_key(self) -> str | None:
        """The key a worker's earnings are credited to (legacy workers have none)."""
        return None if self.legacy else self.key

    @property
    def free_slots(self) -> int:
        return self.max_jobs - len(self.jobs) - self.reserved

    @property
    def active_jobs(self) -> int:
        """Jobs it runs now, and slots handed to waiting jobs: a new job is one more."""
        return len(self.jobs) + self.reserved

    @property
    def group_free_mb(self) -> tuple[float, ...]:
        """Its memory per device as a model group's planner sees it: what it said of each
        device it gives a group (``device_free_mb``), else, from an older worker, its pool's
        budget as one device."""
        if self.device_free_mb:
            return tuple(float(mb) for mb in self.device_free_mb)
        return (float(self.memory_budget_mb or 0),)

    def note_hello(self, hello: Hello) -> None:
        """What a hello says beyond who it is: for placing models (issue 17) and for groups
        (issue 19). Claims, used only to choose whom to ask."""
        self.memory_budget_mb = hello.memory_budget_mb
        self.model_room_mb = hello.model_room_mb
        self.swarm_models = hello.swarm_models
        self.llama_build = hello.llama_build
        self.lan_hint = hello.lan_hint
        self.group_family = hello.group_family
        self.device_free_mb = (tuple(hello.device_free_mb) if hello.device_free_mb is not None
                               else None)
        free = [gpu.memory_free_mb for gpu in hello.nv_gpus if gpu.memory_free_mb is not None]
        self.vram_free_mb = sum(free) if free else None

    def note_status(self, status: Status) -> None:
        """What a status says for placing models and groups: room, free VRAM, each group
        device's memory, downloads under way."""
        if status.device_free_mb is not None:
            self.device_free_mb = tuple(status.device_free_mb)
        if status.model_room_mb is not None:
            self.model_room_mb = status.model_room_mb
        if status.vram_free_mb is not None:
            self.vram_free_mb = status.vram_free_mb
        self.downloads = {d.name: d for d in status.downloads}

    def set_models(self, models: Iterable[ModelDescriptor]) -> None:
        """Replace the worker's holdings (the registry re-indexes it: ``Registry.apply_status``)."""
        self.models = {model.name: model for model in models}
        self.loaded = frozenset(name for name, model in self.models.items() if model.loaded)
        self.cached = frozenset(self.models)
