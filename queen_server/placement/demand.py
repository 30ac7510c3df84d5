"""Demand per model: requests per minute, the ones no worker could take at once, the requests
waiting now, and how long requests waited. O(1) per request, bounded memory.

Counts sit in one-minute buckets over a window (5 minutes by default); a model not asked for in
a window is forgotten. Only models the queen knows exist are counted (held by a worker, or
resolved on the hub), so a client naming made-up models cannot grow the book; past
``max_models`` the least recently asked is dropped.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["DemandBook", "DemandRow"]


@dataclass(slots=True)
class _Bucket:
    minute: int
    requests: int = 0
    unmet: int = 0
    wait_s: float = 0.0
    waits: int = 0


@dataclass(slots=True)
class _Model:
    buckets: deque[_Bucket] = field(default_factory=deque)
    queued: int = 0


@dataclass(frozen=True, slots=True)
class DemandRow:
    name: str
    requests_per_min: float
    unmet_per_min: float
    queued: int
    mean_wait_s: float


class DemandBook:
    def __init__(self, *, window_s: float = 300.0, max_models: int = 1000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.minutes = max(1, int(window_s // 60))
        self.max_models = max_models
        self.clock = clock
        self._models: OrderedDict[str, _Model] = OrderedDict()

    def asked(self, model: str, *, met: bool) -> None:
        """One request for ``model``; ``met``: a worker held it (else it waits for a fetch)."""
        bucket = self._bucket(model)
        bucket.requests += 1
        if not met:
            bucket.unmet += 1

    def waited(self, model: str, seconds: float) -> None:
        """A request for ``model`` reached a worker after ``seconds``."""
        bucket = self._bucket(model)
        bucket.wait_s += max(seconds, 0.0)
        bucket.waits += 1

    def queue(self, model: str, delta: int) -> None:
        """A request starts (+1) or stops (-1) waiting for ``model`` to be placed."""
        entry = self._entry(model)
        entry.queued = max(entry.queued + delta, 0)

    def rows(self) -> list[DemandRow]:
        """Every model asked for in the window, busiest first."""
        now_minute = int(self.clock() // 60)
        out = []
        for name, entry in list(self._models.items()):
            live = [b for b in entry.buckets if now_minute - b.minute < self.minutes]
            if not live and not entry.queued:
                del self._models[name]
                continue
            requests = sum(b.requests for b in live)
            waits = sum(b.waits for b in live)
            out.append(DemandRow(
                name=name,
                requests_per_min=requests / self.minutes,
                unmet_per_min=sum(b.unmet for b in live) / self.minutes,
                queued=entry.queued,
                mean_wait_s=sum(b.wait_s for b in live) / waits if waits else 0.0,
            ))
        out.sort(key=lambda r: (-(r.requests_per_min + r.queued), r.name))
        return out

    def _entry(self, model: str) -> _Model:
        entry = self._models.get(model)
        if entry is None:
            entry = self._models[model] = _Model()
            while len(self._models) > self.max_models:
                self._models.popitem(last=False)
        else:
            self._models.move_to_end(model)
        return entry

    def _bucket(self, model: str) -> _Bucket:
        entry = self._entry(model)
        minute = int(self.clock() // 60)
        buckets = entry.buckets
        if not buckets or buckets[-1].minute != minute:
            buckets.append(_Bucket(minute))
            while len(buckets) > self.minutes:
                buckets.popleft()
        return buckets[-1]
