"""Choosing a worker for a job: a pure function of the request and a snapshot of the swarm.

Workers are ranked by tier first: the model already loaded in memory, then cached on disk, then
able to fetch it on demand (legacy workers). Within a tier, a worker with a free job slot comes
before a busy one, the worker that served the conversation's last turn (``prefer``: it holds the
conversation's prefix in its cache, issue 36) before the others when it has a free slot, and a
better speed record before a worse one. The speed is what a new stream would get there: the
worker's seconds per completion token at the load it would run with the new job
(``speed_at(key, jobs)``: the queen's own measurements per load bucket, ``stats/load.py``; a
batched worker running k streams gives each less than one alone), weighed by its audit standing
(``trust``). A new worker whose answers wait for audits beyond what audits can cover ranks as
busy (``uncovered``), and so does a worker not proven by the audits for a model no audit can
check (``unproven_for``). A small random factor on the speed spreads load between equals. No I/O
happens here; the registry hands in its workers' directory entries (``swarm.worker.Worker``,
whose free slots read the registry's leases), which satisfy ``WorkerView``, and the swarm stats
hand in the speeds (``stats/ema.py``, ``stats/load.py``).

The dispatcher does not call ``rank`` per request: ``capacity.FreeIndex`` keeps the same order
as a structure (its tests check the two agree).
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Protocol, TypeVar

TIER_LOADED = 0
TIER_CACHED = 1
TIER_FETCH = 2


class WorkerView(Protocol):
    """What routing needs to know about a worker."""

    @property
    def key(self) -> str: ...
    @property
    def loaded(self) -> Collection[str]: ...
    @property
    def cached(self) -> Collection[str]: ...
    @property
    def can_fetch(self) -> bool: ...
    @property
    def free_slots(self) -> int: ...
    @property
    def active_jobs(self) -> int:
        """Jobs it runs now (and slots handed to waiting jobs): a new job would be one more."""
        ...
    @property
    def trust(self) -> float:
        """A factor on the speed score: below 1 for audited good standing (issue 16)."""
        ...
    @property
    def uncovered(self) -> bool:
        """More of its answers wait for audits than audits can cover: rank it as busy."""
        ...


W = TypeVar("W", bound=WorkerView)


def tier(worker: WorkerView, model: str) -> int | None:
    """The worker's tier for this model, or None if it cannot serve it."""
    if model in worker.loaded:
        return TIER_LOADED
    if model in worker.cached:
        return TIER_CACHED
    if worker.can_fetch:
        return TIER_FETCH
    return None


def unproven_for(worker: WorkerView, model: str,
                 unaudited: Callable[[str], bool] | None = None) -> bool:
    """Whether ``worker`` ranks with the busy ones for ``model``: more of its answers wait for
    audits than audits can cover (``uncovered``), or no audit can check answers of ``model`` at
    all (``unaudited(model)``: the queen could not pin its file, issue 39) and the worker is not
    proven by the audits (``trust`` 1: not in good standing, not a trusted auditor). So
    answers nobody can check go first to workers the audits have proven, and to a newcomer
    only when none of those is free: the lower tier of an unverifiable model."""
    if worker.uncovered:
        return True
    return unaudited is not None and worker.trust >= 1.0 and unaudited(model)


def rank(
    model: str,
    workers: Iterable[W],
    speeds: Mapping[str, float],
    rng: random.Random,
    *,
    exclude: Collection[str] = (),
    jitter: float = 0.1,
    prefer: str | None = None,
    speed_at: Callable[[str, int], float | None] | None = None,
    unaudited: Callable[[str], bool] | None = None,
) -> list[W]:
    """Workers able to serve ``model``, best first.

    ``speeds`` maps a worker key to its unloaded seconds-per-token record for this model's size
    class. ``speed_at(key, jobs)``: the seconds per token a new stream gets on that worker as
    its ``jobs``-th job at once (None: no record); without it, ``speeds`` as they are. A worker
    with no record yet is scored at the median of the known ones, shared among its streams, so
    newcomers get their share of work. ``prefer``: the key of the worker that holds the
    conversation's prefix, first within its tier when it has a free slot. ``unaudited(model)``:
    whether no audit can check the model's answers (``unproven_for``).
    """
    capable: list[tuple[int, int, int, float, W]] = []
    unknown: float | None = None
    for worker in workers:
        key = worker.key
        if key in exclude:
            continue
        worker_tier = tier(worker, model)
        if worker_tier is None:
            continue
        free = worker.free_slots > 0
        busy = 0 if free and not unproven_for(worker, model, unaudited) else 1
        jobs = worker.active_jobs + 1
        speed = speed_at(key, jobs) if speed_at is not None else speeds.get(key)
        if speed is None:
            if unknown is None:  # computed once, and only when a newcomer needs it
                unknown = statistics.median(speeds.values()) if speeds else 1.0
            speed = unknown * jobs
        score = speed * worker.trust * (1.0 + jitter * rng.random())
        capable.append((worker_tier, busy, 0 if free and key == prefer else 1, score, worker))
    capable.sort(key=lambda entry: entry[:4])
    return [entry[4] for entry in capable]
