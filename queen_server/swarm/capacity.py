"""Free capacity, indexed: which workers could take a job of a model right now, found without
looking at the rest of the swarm.

``routing.rank`` orders every candidate on every request: tier (loaded, cached, fetch), then a
free slot before a busy one (an ``uncovered`` worker counts as busy), then the speed score
(seconds per token times ``trust``, with a little jitter). At 2,000 workers that scoring took
three quarters of the queen's CPU. ``FreeIndex`` keeps the same order as a structure instead:
per model, one group per (tier, covered) in rank's order, and in each group the workers *with
a free slot* in buckets by speed class (``BUCKET_RATIO`` apart, the jitter's width). Choosing
walks the groups in order and takes the best bucket that has an acceptable worker; within it,
a small bucket (``FULL_LOOK`` or fewer) is compared whole on the full jittered score, a larger
one by two random choices compared on it. So a decision costs O(1) in the number of workers
(plus a scan of one bucket only when a filter refuses most of it), and for small swarms it is
rank's own first choice (the tests check the two agree).

A worker not proven by the audits sits in the uncovered group of a model no audit can check
(``unaudited``, ``routing.unproven_for``). A worker's place is recomputed whenever its free
slots or standing change (``refresh``, called
by the registry on every lease, release and status): that is when its score can have changed,
since its speed record moves when its jobs end. Legacy workers that fetch any model sit in one
group of their own, after every model's holders, as rank's lowest tier.

No I/O and no clock: the registry calls it, the dispatcher reads it.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from queen_server.swarm.routing import unproven_for
from queen_server.swarm.worker import Worker

T = TypeVar("T")

BUCKET_RATIO = 1.1  # neighbouring speed classes differ by 10%: routing's jitter
FULL_LOOK = 8  # a bucket this small is compared whole
SAMPLES = 2  # otherwise: the best of this many random picks ("two random choices")
MAX_DRAWS = 8  # random draws before a filter that refuses them makes us scan the bucket
_LOG_RATIO = math.log(BUCKET_RATIO)
_FLOOR_BUCKET = -10_000

Score = Callable[[Worker, str], float]  # seconds per token times trust, lower is better


def speed_class(score: float) -> int:
    """The bucket of a score: equal within ``BUCKET_RATIO``, ordered like the scores."""
    if score <= 0 or not math.isfinite(score):
        return _FLOOR_BUCKET if score <= 0 else -_FLOOR_BUCKET
    return math.floor(math.log(score) / _LOG_RATIO)


class RandomSet(Generic[T]):
    """A set with O(1) add, discard and uniform random pick."""

    __slots__ = ("_items", "_where")

    def __init__(self) -> None:
        self._items: list[T] = []
        self._where: dict[T, int] = {}

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[T]:
        return iter(self._items)

    def __contains__(self, item: object) -> bool:
        return item in self._where

    def add(self, item: T) -> None:
        if item not in self._where:
            self._where[item] = len(self._items)
            self._items.append(item)

    def discard(self, item: T) -> None:
        index = self._where.pop(item, None)
        if index is None:
            return
        last = self._items.pop()
        if index < len(self._items):
            self._items[index] = last
            self._where[last] = index

    def pick(self, rng: random.Random) -> T:
        return self._items[rng.randrange(len(self._items))]


class _Group:
    """Free workers of one model in one (tier, covered) group, by speed class."""

    __slots__ = ("buckets", "order")

    def __init__(self) -> None:
        self.buckets: dict[int, RandomSet[Worker]] = {}
        self.order: list[int] = []  # the non-empty speed classes, best (lowest) first

    def add(self, worker: Worker, bucket: int) -> None:
        members = self.buckets.get(bucket)
        if members is None:
            members = self.buckets[bucket] = RandomSet()
            _insort(self.order, bucket)
        members.add(worker)

    def discard(self, worker: Worker, bucket: int) -> None:
        members = self.buckets.get(bucket)
        if members is None:
            return
        members.discard(worker)
        if not members:
            del self.buckets[bucket]
            self.order.remove(bucket)

    def __bool__(self) -> bool:
        return bool(self.order)

    def __len__(self) -> int:
        return sum(len(members) for members in self.buckets.values())


def _insort(order: list[int], value: int) -> None:
    lo, hi = 0, len(order)
    while lo < hi:
        mid = (lo + hi) // 2
        if order[mid] < value:
            lo = mid + 1
        else:
            hi = mid
    order.insert(lo, value)


_GROUPS = 4  # (loaded, covered), (loaded, uncovered), (cached, covered), (cached, uncovered)
_FETCH = ""  # the model name under which fetch-anything (legacy) workers are grouped


class FreeIndex:
    """The workers with a free slot, per model, in routing's order (see the module doc)."""

    def __init__(self, score: Score | None = None, rng: random.Random | None = None,
                 jitter: float = 0.1) -> None:
        self.score: Score = score or (lambda worker, _model: worker.trust)
        self.rng = rng or random.Random()
        self.jitter = jitter
        # Whether no audit can check a model's answers (the catalog could not pin it): a worker
        # the audits have not proven counts as uncovered for it (``routing.unproven_for``).
        self.unaudited: Callable[[str], bool] | None = None
        self._models: dict[str, list[_Group]] = {}
        # Where each indexed worker is: (model, group number, speed class) per model it holds.
        self._places: dict[Worker, list[tuple[str, int, int]]] = {}

    def __contains__(self, worker: object) -> bool:
        return worker in self._places

    def __len__(self) -> int:
        """Workers indexed as free."""
        return len(self._places)

    def refresh(self, worker: Worker, routable: bool) -> None:
        """Put ``worker`` where its free slots, holdings, standing and score say: nowhere when
        it is not ``routable`` (flagged, paused, an auditor, gone) or has no free slot."""
        self.drop(worker)
        if not routable or worker.free_slots <= 0:
            return
        covered = 0 if not worker.uncovered else 1
        places: list[tuple[str, int, int]] = []
        for name in worker.cached:
            uncovered = 1 if unproven_for(worker, name, self.unaudited) else 0
            group = (0 if name in worker.loaded else 2) + uncovered
            bucket = speed_class(self.score(worker, name))
            self._group(name, group).add(worker, bucket)
            places.append((name, group, bucket))
        if worker.can_fetch:
            group = 2 + covered  # one bucket: fetchers are compared on the full score
            self._group(_FETCH, group).add(worker, 0)
            places.append((_FETCH, group, 0))
        if places:
            self._places[worker] = places

    def drop(self, worker: Worker) -> None:
        places = self._places.pop(worker, None)
        if places is None:
            return
        for name, group_number, bucket in places:
            groups = self._models[name]
            groups[group_number].discard(worker, bucket)
            if not any(groups):
                del self._models[name]

    def _group(self, name: str, number: int) -> _Group:
        groups = self._models.get(name)
        if groups is None:
            groups = self._models[name] = [_Group() for _ in range(_GROUPS)]
        return groups[number]

    def free_for(self, model: str) -> int:
        """Free workers that hold ``model`` (for pages and tests: O(buckets))."""
        groups = self._models.get(model)
        return sum(len(group) for group in groups) if groups else 0

    def choose(self, model: str, accept: Callable[[Worker], bool] | None = None,
               prefer: Worker | None = None) -> Worker | None:
        """The worker routing would give a job of ``model`` now, among those ``accept`` allows
        (None: any), or None when no free worker is acceptable. ``prefer``: a worker that
        comes first within its group when it is free here for ``model`` and acceptable (it
        holds the conversation's prefix: ``routing.rank``'s ``prefer``)."""
        preferred = self._group_of(prefer, model) if prefer is not None else None
        for name in (model, _FETCH):
            groups = self._models.get(name)
            if groups is None:
                continue
            for number, group in enumerate(groups):
                if number == preferred and name == model and (accept is None or accept(prefer)):
                    return prefer
                for bucket in group.order:
                    chosen = self._best(group.buckets[bucket], model, accept)
                    if chosen is not None:
                        return chosen
        return None

    def _group_of(self, worker: Worker, model: str) -> int | None:
        """The group number ``worker`` is free in for ``model`` (a holder's, not a fetcher's),
        or None when it is not free for it. O(models it holds)."""
        for name, number, _bucket in self._places.get(worker, ()):
            if name == model:
                return number
        return None

    def _best(self, members: RandomSet[Worker], model: str,
              accept: Callable[[Worker], bool] | None) -> Worker | None:
        if len(members) <= FULL_LOOK:
            pool: list[Worker] | set[Worker] = [worker for worker in members
                                                if accept is None or accept(worker)]
        else:
            pool = set()
            for _ in range(MAX_DRAWS):
                worker = members.pick(self.rng)
                if accept is None or accept(worker):
                    pool.add(worker)
                    if len(pool) >= SAMPLES:
                        break
            if not pool:  # the filter refuses what we drew: look at the whole bucket
                pool = [worker for worker in members if accept is None or accept(worker)]
        if not pool:
            return None
        if len(pool) == 1:
            return next(iter(pool))
        return min(pool, key=lambda worker: self._jittered(worker, model))

    def _jittered(self, worker: Worker, model: str) -> float:
        return self.score(worker, model) * (1.0 + self.jitter * self.rng.random())
