"""Choosing a worker for a job: a pure function of the request and a snapshot of the swarm.

Workers are ranked by tier first: the model already loaded in memory, then cached on disk, then
able to fetch it on demand (legacy workers). Within a tier, a worker with a free job slot comes
before a busy one, and a better speed record (an EMA of seconds per completion token for that
worker and model, weighed by its audit standing: ``trust``) before a worse one. A new worker
whose answers wait for audits beyond what audits can cover ranks as busy (``uncovered``). A
small random factor on the speed spreads load between equals. No I/O happens here; the registry
hands in its workers' directory entries (``swarm.worker.Worker``, whose free slots read the
registry's leases), which satisfy ``WorkerView``, and the swarm stats hand in the speeds
(``stats/ema.py``).
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Collection, Iterable, Mapping
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


def rank(
    model: str,
    workers: Iterable[W],
    speeds: Mapping[str, float],
    rng: random.Random,
    *,
    exclude: Collection[str] = (),
    jitter: float = 0.1,
) -> list[W]:
    """Workers able to serve ``model``, best first.

    ``speeds`` maps a worker key to its seconds-per-token EMA for this model. A worker with no
    record yet is scored at the median of the known ones, so newcomers get their share of work.
    """
    capable: list[tuple[int, int, float, W]] = []
    unknown: float | None = None
    for worker in workers:
        if worker.key in exclude:
            continue
        worker_tier = tier(worker, model)
        if worker_tier is None:
            continue
        busy = 0 if worker.free_slots > 0 and not worker.uncovered else 1
        speed = speeds.get(worker.key)
        if speed is None:
            if unknown is None:  # computed once, and only when a newcomer needs it
                unknown = statistics.median(speeds.values()) if speeds else 1.0
            speed = unknown
        score = speed * worker.trust * (1.0 + jitter * rng.random())
        capable.append((worker_tier, busy, score, worker))
    capable.sort(key=lambda entry: entry[:3])
    return [entry[3] for entry in capable]
