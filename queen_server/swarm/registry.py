"""The queen's live registry of connected workers: indexed by key and by model, with their leases,
their free capacity, and the jobs waiting for it.

It owns leases: a job is leased to a worker from the moment its frame is sent until it ends,
the whole stream included, and a worker never holds more leases (and reservations) than its
``max_jobs``. Leases are kept here, by job id, and per worker (each worker's ``jobs`` is a
read-only view of its own), so that a lease is released by its job id alone and a worker's free
slots cost nothing to read.

It keeps the routing structures current as leases, statuses and standings change: ``free``
(``capacity.FreeIndex``: the workers with a free slot, per model, in routing's order) and, per
model, the distinct *profiles* of the workers that hold it (legacy or not, capabilities, the
file's sha256) with their counts, so that "can anyone serve this?" is answered without a scan.

And it owns the admission queue (``queueing.WaitQueue``): a job that finds no free worker waits
in ``wait_for_worker``; the moment a slot frees (a release, a worker joining or resuming, more
``max_jobs``), the registry reserves it for one waiter and wakes only that one. Nobody else
wakes, and no later request can take the slot first.

A worker is registered with the ``Connection`` that holds it; the registry closes it on shutdown
and hands back the older one when a newer session of the same key replaces it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import MappingProxyType

from queen_server.swarm.capacity import FreeIndex
from queen_server.swarm.claims import FileClaim, FileClaims
from queen_server.swarm.jobs import JobHandle, WorkerLost
from queen_server.swarm.queueing import Waiter, WaitQueue
from queen_server.swarm.worker import NO_LEASES, Connection, Worker
from shared_schema import ModelDescriptor, Status
from shared_schema.capabilities import AUDITOR as CAPABILITY_AUDITOR

log = logging.getLogger(__name__)

# What a worker is, for "could anyone serve this request?": legacy or not, its capabilities, and
# the sha256 of the file it holds under the model's name. Few distinct ones exist in a swarm.
Profile = tuple[bool, frozenset[str], str | None]
_FETCHING = ""  # the profiles of fetch-anything (legacy) workers are kept under this name


def _always(_worker: Worker, _model: str) -> bool:
    return True


class Registry:
    def __init__(self, free: FreeIndex | None = None, queue: WaitQueue | None = None) -> None:
        self._workers: dict[str, Worker] = {}
        self._connections: dict[str, Connection] = {}
        self._by_model: dict[str, set[Worker]] = {}
        self._profiles: dict[str, Counter[Profile]] = {}  # model -> profiles of its holders
        self._slots: Counter[str] = Counter()  # model -> job slots of its holders
        # Issue 38: how many of a model's holders hold it as a diffusion model (kind "image"),
        # and which names each worker was counted for, to undo exactly that.
        self._image_holders: Counter[str] = Counter()
        self._image_held: dict[Worker, list[str]] = {}
        # What _index recorded per worker: (model, profile, slots, file claim), to undo
        # exactly that.
        self._indexed: dict[Worker, list[tuple[str, Profile, int, FileClaim | None]]] = {}
        # What the routable holders of each model say of its file (for pricing names the
        # queen cannot read: ``quoting``).
        self.claims = FileClaims()
        self._fetchers: set[Worker] = set()
        self._takers: set[Worker] = set()  # workers the queen may place models on (issue 17)
        self._leases: dict[str, JobHandle] = {}  # every lease, by job id
        self._held: dict[str, dict[str, JobHandle]] = {}  # worker key -> its leases, by job id
        self.free = FreeIndex() if free is None else free
        self.queue = WaitQueue() if queue is None else queue
        # Whether a worker serves a model it holds (model groups, issue 19: a model no single
        # worker can hold is served only by its group's head). Asked when a worker is indexed,
        # never per request; whoever changes its answer calls ``models_changed``.
        self.serves_model: Callable[[Worker, str], bool] = _always

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
        self._refresh(worker)
        return older_connection

    def remove(self, worker: Worker, reason: str) -> bool:
        """Take a worker out at once and fail its jobs. False if it was already gone."""
        if self._workers.get(worker.key) is not worker:
            return False
        del self._workers[worker.key]
        del self._connections[worker.key]
        held = self._held.pop(worker.key)
        gone = self._unindex(worker)
        self.free.drop(worker)
        worker.closed = True
        worker.jobs = NO_LEASES
        worker.reserved = 0
        handles = list(held.values())
        held.clear()
        for handle in handles:
            self._leases.pop(handle.id, None)
        for handle in handles:
            if not handle.finished:
                handle.feed(WorkerLost(reason))
        self._wake_lost(gone)
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
        changed = False
        if max_jobs is not None and max_jobs != worker.max_jobs:
            worker.max_jobs = max_jobs
            changed = True
        if models is not None:
            worker.set_models(models)
            changed = True
        if changed:
            self.models_changed(worker)

    def models_changed(self, worker: Worker) -> None:
        """Re-index a worker after its model holdings (or its slots, standing...) changed."""
        if self._workers.get(worker.key) is not worker:
            return
        gone = self._unindex(worker)
        self._index(worker)
        self._refresh(worker)
        self._wake_lost(gone)

    def set_flagged(self, worker: Worker, flagged: bool) -> None:
        """Take a worker out of routing (audits flagged it) or put it back (an admin cleared
        the flag). It stays connected; its jobs in flight finish."""
        if worker.flagged == flagged:
            return
        worker.flagged = flagged
        self.models_changed(worker)

    def set_standing(self, worker: Worker, *, trust: float, uncovered: bool) -> None:
        """The audits' weight on its speed score, and whether it ranks as busy (issue 16)."""
        if worker.trust == trust and worker.uncovered == uncovered:
            return
        worker.trust = trust
        worker.uncovered = uncovered
        self._refresh(worker)

    def set_paused(self, worker: Worker, reason: str | None) -> None:
        """Its owner paused the worker (on battery, the GPU in use...) or resumed it: a paused
        worker is in no routing index; its jobs in flight finish or come back as retryable."""
        if worker.paused == reason:
            return
        was = worker.paused
        worker.paused = reason
        if bool(was) != bool(reason):
            self.models_changed(worker)

    def set_held(self, worker: Worker, group: str | None) -> None:
        """A group holds the worker (it serves its devices to the group's head: issue 19) or
        let it go: a held worker is in no routing index, as a paused one."""
        if worker.held_by == group:
            return
        was = worker.held_by
        worker.held_by = group
        if bool(was) != bool(group):
            self.models_changed(worker)

    @staticmethod
    def routable(worker: Worker) -> bool:
        """Whether routing may give it jobs: not flagged, not paused, not held by a group, not
        an auditor, here."""
        return not (worker.flagged or worker.paused or worker.held_by or worker.closed
                    or CAPABILITY_AUDITOR in worker.capabilities)

    def _index(self, worker: Worker) -> None:
        if not self.routable(worker):
            return  # in no index: routing never sees it (an auditor only audits)
        entries: list[tuple[str, Profile, int, FileClaim | None]] = []
        serves = self.serves_model
        for name in worker.cached:
            if not serves(worker, name):
                continue
            self._by_model.setdefault(name, set()).add(worker)
            held = worker.models.get(name)
            profile = (worker.legacy, worker.capabilities, held.sha256 if held else None)
            self._profiles.setdefault(name, Counter())[profile] += 1
            self._slots[name] += worker.max_jobs
            if held is not None and held.kind == "image":
                self._image_holders[name] += 1
                self._image_held.setdefault(worker, []).append(name)
            claim: FileClaim = (held.sha256, held.size_bytes) if held else (None, 0)
            self.claims.add(name, claim)
            entries.append((name, profile, worker.max_jobs, claim))
        if worker.can_fetch:
            self._fetchers.add(worker)
            profile = (worker.legacy, worker.capabilities, None)
            self._profiles.setdefault(_FETCHING, Counter())[profile] += 1
            entries.append((_FETCHING, profile, 0, None))
        if worker.takes_fetch:
            self._takers.add(worker)
        if entries:
            self._indexed[worker] = entries

    def _unindex(self, worker: Worker) -> list[str]:
        """Take the worker out of the model indexes: the models left with no holder."""
        gone: list[str] = []
        for name in self._image_held.pop(worker, ()):
            self._image_holders[name] -= 1
            if self._image_holders[name] <= 0:
                del self._image_holders[name]
        for name, profile, slots, claim in self._indexed.pop(worker, ()):
            if claim is not None:
                self.claims.remove(name, claim)
            profiles = self._profiles[name]
            profiles[profile] -= 1
            if profiles[profile] <= 0:
                del profiles[profile]
            if name == _FETCHING:
                if not profiles:
                    del self._profiles[name]
                continue
            holders = self._by_model[name]
            holders.discard(worker)
            self._slots[name] -= slots
            if not holders:
                del self._by_model[name], self._profiles[name], self._slots[name]
                gone.append(name)
        self._fetchers.discard(worker)
        self._takers.discard(worker)
        return gone

    # --- lookups for routing ------------------------------------------------------------------

    def holders(self, model: str) -> set[Worker]:
        return self._by_model.get(model, set())

    def serves(self, model: str) -> bool:
        """Whether any routable worker holds ``model`` or fetches any model. O(1)."""
        return model in self._by_model or bool(self._fetchers)

    def image_holders(self, model: str) -> int:
        """How many routable workers hold ``model`` as a diffusion model (issue 38). O(1)."""
        return self._image_holders.get(model, 0)

    def holder_count(self, model: str) -> int:
        return len(self._by_model.get(model, ()))

    def profiles(self, model: str) -> list[Profile]:
        """The distinct (legacy, capabilities, sha256) of the routable workers that could serve
        ``model``: its holders and the fetchers. O(profiles), not O(workers)."""
        found = list(self._profiles.get(model, ()))
        if self._fetchers:
            found.extend(self._profiles.get(_FETCHING, ()))
        return found

    def slots(self, model: str) -> int:
        """Job slots of the routable workers holding ``model``."""
        return self._slots.get(model, 0)

    def candidates(self, model: str) -> list[Worker]:
        """Every worker that could serve ``model`` (holders and fetchers), in no order. O(N):
        for pages and tests; routing uses ``free`` and ``profiles``."""
        holders = self._by_model.get(model)
        if not self._fetchers:
            return list(holders) if holders else []
        return list((holders or set()) | self._fetchers)

    def fetchers(self) -> set[Worker]:
        """Routable workers that fetch any model they are asked for (legacy; live)."""
        return self._fetchers

    def takers(self) -> set[Worker]:
        """Workers in routing that take ``fetch`` commands (live; do not change it)."""
        return self._takers

    def model_names(self) -> list[str]:
        return sorted(self._by_model)

    # --- leases -------------------------------------------------------------------------------

    def lease(self, worker: Worker, handle: JobHandle, *, reserved: bool = False) -> None:
        """Lease ``handle`` to a registered worker with a free slot (``RuntimeError`` if not);
        ``reserved``: the slot was reserved for this job (``wait_for_worker`` handed it)."""
        held = self._held.get(worker.key)
        if held is None or self._workers[worker.key] is not worker:
            raise RuntimeError(f"{worker!r} is not registered")
        if reserved and worker.reserved > 0:
            worker.reserved -= 1
        elif worker.free_slots <= 0:
            raise RuntimeError(f"{worker!r} has no free slot")
        held[handle.id] = handle
        self._leases[handle.id] = handle
        self._refresh(worker)

    def release(self, job_id: str) -> None:
        """End a job's lease; releasing twice, or a job whose worker left, is harmless."""
        handle = self._leases.pop(job_id, None)
        if handle is None:
            return
        held = self._held.get(handle.worker_key)
        if held is None:
            return
        held.pop(job_id, None)
        self.queue.served(handle.model, time.monotonic() - handle.started_at)
        worker = self._workers.get(handle.worker_key)
        if worker is not None:
            self._refresh(worker)

    def unreserve(self, worker: Worker) -> None:
        """Give back a slot reserved for a waiter that did not use it."""
        if worker.reserved > 0:
            worker.reserved -= 1
            if not worker.closed:
                self._refresh(worker)

    def is_leased(self, job_id: str) -> bool:
        return job_id in self._leases

    def leases_of(self, key: str) -> Mapping[str, JobHandle]:
        """The leases of the registered worker of ``key``, by job id (live; empty if none)."""
        return self._held.get(key, NO_LEASES)

    def free_slots(self, key: str) -> int:
        """How many more jobs the registered worker of ``key`` may take (0 if none is)."""
        worker = self._workers.get(key)
        return worker.free_slots if worker is not None else 0

    @property
    def leased(self) -> int:
        """Jobs leased across the swarm."""
        return len(self._leases)

    # --- free capacity and the jobs waiting for it ---------------------------------------------

    def _refresh(self, worker: Worker) -> None:
        """Re-place the worker in the free index, and hand its free slots to waiters first."""
        routable = self.routable(worker)
        if routable and worker.free_slots > 0 and len(self.queue):
            models = (self.queue.models() if worker.can_fetch
                      else [name for name in worker.cached if self.queue.waiting(name)])
            if models:
                self._hand_over(worker, models)
        self.free.refresh(worker, routable)

    def _hand_over(self, worker: Worker, models: list[str]) -> None:
        now = time.monotonic()
        while worker.free_slots > 0:
            waiter = self.queue.pop_for(worker, models, now)
            if waiter is None:
                return
            worker.reserved += 1
            future: asyncio.Future[Worker | None] = waiter.token
            if future.done():  # its wait ended this very turn: give the slot back
                worker.reserved -= 1
                continue
            future.set_result(worker)

    def _wake_lost(self, models: list[str]) -> None:
        """Models that lost their last holder: their waiters look again (and fail at once if
        nobody else can serve them) rather than wait out their timeout."""
        if not models or not len(self.queue) or self._fetchers:
            return
        now = time.monotonic()
        for name in models:
            for waiter in self.queue.take_all(name, now):
                if not waiter.token.done():
                    waiter.token.set_result(None)
            self.queue.forget(name)

    @property
    def waiting(self) -> int:
        """Jobs waiting for a worker, every model."""
        return len(self.queue)

    def choose(self, model: str, accept: Callable[[Worker], bool] | None = None,
               prefer: str | None = None) -> Worker | None:
        """The free worker routing gives a job of ``model`` now (``FreeIndex.choose``; the
        worker of key ``prefer`` first within its group, when it is registered and free). Jobs
        already waiting come first without a check here: a slot that frees is handed to them
        at once, so a free worker is one that no waiting job would take."""
        preferred = self._workers.get(prefer) if prefer is not None else None
        return self.free.choose(model, accept, preferred)

    async def wait_for_worker(self, model: str, caller: str, timeout_s: float,
                              accept: Callable[[Worker], bool] | None = None) -> Worker | None:
        """Queue for a free slot of a worker of ``model`` that ``accept`` takes, at most
        ``timeout_s``: the worker, with one slot reserved for the caller (lease it with
        ``reserved=True``, or ``unreserve`` it); None when the model lost its workers (look
        again). ``TimeoutError`` past the timeout; cancelling the wait leaves the queue at once."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Worker | None] = loop.create_future()
        waiter = Waiter(model, caller, time.monotonic(), accept, future)
        self.queue.push(waiter)
        try:
            async with asyncio.timeout(timeout_s):
                return await future
        except BaseException:
            self.queue.cancel(waiter, time.monotonic())
            if future.done() and not future.cancelled() and (worker := future.result()):
                self.unreserve(worker)  # handed over as the wait ended: not used
            raise

    async def close_all(self, code: int, reason: str) -> None:
        for worker in list(self._workers.values()):
            connection = self._connections[worker.key]
            self.remove(worker, reason)
            try:
                await connection.close(code, reason)
            except Exception:  # the socket may already be gone
                log.debug("closing %r failed", worker, exc_info=True)
