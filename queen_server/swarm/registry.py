"""The queen's live registry of connected workers, indexed by key and by model, and their leases.

It owns leases: a job is leased to a worker from the moment its frame is sent until it ends,
the whole stream included, and a worker never holds more leases than its ``max_jobs``. Leases
are kept here, by job id, and per worker (each worker's ``jobs`` is a read-only view of its
own), so that a lease is released by its job id alone and a worker's free slots cost nothing to
read. Waiters for capacity are woken whenever a lease is released or the swarm changes.

A worker is registered with the ``Connection`` that holds it; the registry closes it on shutdown
and hands back the older one when a newer session of the same key replaces it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Iterator, Mapping
from types import MappingProxyType

from queen_server.swarm.jobs import JobHandle, WorkerLost
from queen_server.swarm.worker import NO_LEASES, Connection, Worker
from shared_schema import ModelDescriptor, Status
from shared_schema.capabilities import AUDITOR as CAPABILITY_AUDITOR

log = logging.getLogger(__name__)


class Registry:
    def __init__(self) -> None:
        self._workers: dict[str, Worker] = {}
        self._connections: dict[str, Connection] = {}
        self._by_model: dict[str, set[Worker]] = {}
        self._fetchers: set[Worker] = set()
        self._takers: set[Worker] = set()  # workers the queen may place models on (issue 17)
        self._leases: dict[str, JobHandle] = {}  # every lease, by job id
        self._held: dict[str, dict[str, JobHandle]] = {}  # worker key -> its leases, by job id
        self._changed = asyncio.Event()
        self._waiting = 0

    # --- membership ---------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._workers)

    def __iter__(self) -> Iterator[Worker]:
        return iter(list(self._workers.values()))

    def get(self, key: str) -> Worker | None:
        return self._workers.get(key)

    def connection(self, key: str) -> Connection | None:
        """The connection that holds the registered worker of ``key``."""
        return self._connections.get(key)

    def add(self, worker: Worker, connection: Connection) -> Connection | None:
        """Register a worker and its connection. A registered worker of the same key is removed
        first (its jobs lost); its connection is returned, for the caller to close."""
        older = self._workers.get(worker.key)
        older_connection = None
        if older is not None:
            older_connection = self._connections.get(worker.key)
            self.remove(older, "replaced by a newer session of the same key")
        held: dict[str, JobHandle] = {}
        self._workers[worker.key] = worker
        self._connections[worker.key] = connection
        self._held[worker.key] = held
        worker.jobs = MappingProxyType(held)
        self._index(worker)
        self._notify()
        return older_connection

    def remove(self, worker: Worker, reason: str) -> bool:
        """Take a worker out at once and fail its jobs. False if it was already gone."""
        if self._workers.get(worker.key) is not worker:
            return False
        del self._workers[worker.key]
        del self._connections[worker.key]
        held = self._held.pop(worker.key)
        self._unindex(worker)
        worker.closed = True
        worker.jobs = NO_LEASES
        handles = list(held.values())
        held.clear()
        for handle in handles:
            self._leases.pop(handle.id, None)
        for handle in handles:
            if not handle.finished:
                handle.feed(WorkerLost(reason))
        self._notify()
        log.info("worker %s left: %s", worker.public_id, reason)
        return True

    def apply_status(
        self,
        worker: Worker,
        *,
        max_jobs: int | None = None,
        models: Iterable[ModelDescriptor] | None = None,
        status: Status | None = None,
    ) -> None:
        """What a worker's status message changed: its job slots, its holdings (re-indexed),
        and, from the whole ``status``, its room and downloads and whether it is paused."""
        if status is not None:
            worker.note_status(status)
            self.set_paused(worker, status.paused)
        if max_jobs is not None:
            worker.max_jobs = max_jobs
        if models is not None:
            worker.set_models(models)
            self.models_changed(worker)

    def models_changed(self, worker: Worker) -> None:
        """Re-index a worker after its model holdings changed."""
        if self._workers.get(worker.key) is not worker:
            return
        self._unindex(worker)
        self._index(worker)
        self._notify()

    def set_flagged(self, worker: Worker, flagged: bool) -> None:
        """Take a worker out of routing (audits flagged it) or put it back (an admin cleared
        the flag). It stays connected; its jobs in flight finish."""
        if worker.flagged == flagged:
            return
        worker.flagged = flagged
        self.models_changed(worker)

    def set_paused(self, worker: Worker, reason: str | None) -> None:
        """Its owner paused the worker (on battery, the GPU in use...) or resumed it: a paused
        worker is in no routing index; its jobs in flight finish or come back as retryable."""
        if worker.paused == reason:
            return
        was = worker.paused
        worker.paused = reason
        if bool(was) != bool(reason):
            self.models_changed(worker)

    def _index(self, worker: Worker) -> None:
        if worker.flagged or worker.paused or CAPABILITY_AUDITOR in worker.capabilities:
            return  # in no index: routing never sees it (an auditor only audits)
        for name in worker.cached:
            self._by_model.setdefault(name, set()).add(worker)
        if worker.can_fetch:
            self._fetchers.add(worker)
        if worker.takes_fetch:
            self._takers.add(worker)

    def _unindex(self, worker: Worker) -> None:
        for name, holders in list(self._by_model.items()):
            holders.discard(worker)
            if not holders:
                del self._by_model[name]
        self._fetchers.discard(worker)
        self._takers.discard(worker)

    # --- lookups for routing ------------------------------------------------------------------

    def holders(self, model: str) -> set[Worker]:
        return self._by_model.get(model, set())

    def candidates(self, model: str) -> list[Worker]:
        """Every worker that could serve ``model`` (holders and fetchers), in no order."""
        holders = self._by_model.get(model)
        if not self._fetchers:
            return list(holders) if holders else []
        return list((holders or set()) | self._fetchers)

    def takers(self) -> set[Worker]:
        """Workers in routing that take ``fetch`` commands (live; do not change it)."""
        return self._takers

    def model_names(self) -> list[str]:
        return sorted(self._by_model)

    # --- leases -------------------------------------------------------------------------------

    def lease(self, worker: Worker, handle: JobHandle) -> None:
        """Lease ``handle`` to a registered worker with a free slot (``RuntimeError`` if not)."""
        held = self._held.get(worker.key)
        if held is None or self._workers[worker.key] is not worker:
            raise RuntimeError(f"{worker!r} is not registered")
        if worker.max_jobs - len(held) <= 0:
            raise RuntimeError(f"{worker!r} has no free slot")
        held[handle.id] = handle
        self._leases[handle.id] = handle

    def release(self, job_id: str) -> None:
        """End a job's lease; releasing twice, or a job whose worker left, is harmless."""
        handle = self._leases.pop(job_id, None)
        if handle is None:
            return
        held = self._held.get(handle.worker_key)
        if held is not None:
            held.pop(job_id, None)
        self._notify()

    def is_leased(self, job_id: str) -> bool:
        return job_id in self._leases

    def leases_of(self, key: str) -> Mapping[str, JobHandle]:
        """The leases of the registered worker of ``key``, by job id (live; empty if none)."""
        return self._held.get(key, NO_LEASES)

    def free_slots(self, key: str) -> int:
        """How many more jobs the registered worker of ``key`` may take (0 if none is)."""
        worker = self._workers.get(key)
        if worker is None:
            return 0
        return worker.max_jobs - len(self._held[key])

    @property
    def leased(self) -> int:
        """Jobs leased across the swarm."""
        return len(self._leases)

    # --- waiting for capacity -----------------------------------------------------------------

    @property
    def waiting(self) -> int:
        return self._waiting

    async def wait_for_change(self, timeout_s: float) -> None:
        """Wait until a lease is released or the swarm changes, at most ``timeout_s``."""
        event = self._changed
        self._waiting += 1
        try:
            async with asyncio.timeout(timeout_s):
                await event.wait()
        except TimeoutError:
            pass
        finally:
            self._waiting -= 1

    def _notify(self) -> None:
        if self._waiting:
            self._changed.set()
            self._changed = asyncio.Event()

    async def close_all(self, code: int, reason: str) -> None:
        for worker in list(self._workers.values()):
            connection = self._connections[worker.key]
            self.remove(worker, reason)
            try:
                await connection.close(code, reason)
            except Exception:  # the socket may already be gone
                log.debug("closing %r failed", worker, exc_info=True)
