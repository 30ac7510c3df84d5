"""The admission queue: jobs waiting for a worker, per model, handed a slot the moment one frees.

Before this, every waiting job slept on one shared event: each released lease woke them all,
each re-ranked the swarm, one won, the rest slept again, and a request arriving just then could
take the slot ahead of jobs that had waited longer. Measured with 2 one-second workers and 300
clients of 3 s patience, only 17 % of the answers served reached a client still waiting.

Now a released slot is handed straight to one waiter (``pop_for``: O(models the worker holds)
plus the waiters it skips), and nobody else wakes. The order:

* **Per model, fair across callers.** Each model's waiters are grouped by caller (an API key,
  an address), and callers take turns: one key with a hundred jobs waiting does not stand in
  front of another key's one.
* **FIFO while the queue drains, LIFO while it stands (adaptive LIFO).** A model's queue is
  *congested* when it has not been empty for ``congestion_s`` (CoDel's signal: a standing
  queue, not a burst). Then each caller's newest waiter goes first. Clients give up; under
  overload the oldest waiters are the ones about to leave, so serving them first spends the
  swarm on answers nobody reads (the goodput benchmark: ``bench/admission.py``). The newest
  waiter has its whole patience ahead of it. Once the queue empties, order is FIFO again.
* **Shed early.** ``expected_wait_s`` is the waiters ahead over the model's measured service
  rate (its free-able slots over the mean time a job holds one). A request whose expected wait
  is past the queue timeout is refused at once with a ``Retry-After`` from that estimate
  (``Dispatcher``), instead of waiting out the timeout and failing anyway.

A waiter whose client leaves is cancelled in O(1) (``cancel``; it is skipped when its turn
comes and never dispatched). Pure bookkeeping: no asyncio, no clock (times are passed in).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from queen_server.swarm.worker import Worker

CONGESTION_S = 1.0  # a queue not empty for this long is standing: serve newest first
MAX_SKIPS = 64  # waiters looked at (and left in place) for one slot before giving up
RATE_ALPHA = 0.1  # the weight of one job's duration in a model's mean hold time


@dataclass(slots=True, eq=False)
class Waiter:
    """One job waiting for a worker. ``accept`` says whether a worker will do for it (the
    workers it already tried, capabilities, a twin's file); ``token`` is what the waiting side
    keeps (an asyncio future, say): the queue never looks at it."""

    model: str
    caller: str
    since: float
    accept: Callable[[Worker], bool] | None = None
    token: Any = None
    cancelled: bool = False
    worker: Worker | None = None  # set when a slot was handed to it


@dataclass(slots=True)
class _ModelQueue:
    callers: OrderedDict[str, deque[Waiter]] = field(default_factory=OrderedDict)
    size: int = 0  # live waiters (cancelled ones are not counted)
    empty_since: float | None = 0.0  # when it last became empty; None while it is not
    busy_since: float = 0.0  # when it last stopped being empty
    hold_s: float | None = None  # mean seconds a job of this model holds a slot


class WaitQueue:
    def __init__(self, congestion_s: float = CONGESTION_S) -> None:
        self.congestion_s = congestion_s
        self._models: dict[str, _ModelQueue] = {}
        self._size = 0

    def __len__(self) -> int:
        """Live waiters, every model."""
        return self._size

    def waiting(self, model: str) -> int:
        queue = self._models.get(model)
        return queue.size if queue is not None else 0

    def models(self) -> Iterable[str]:
        """Models with live waiters."""
        return [name for name, queue in self._models.items() if queue.size]

    def push(self, waiter: Waiter) -> None:
        queue = self._models.get(waiter.model)
        if queue is None:
            queue = self._models[waiter.model] = _ModelQueue()
        if queue.size == 0:
            queue.busy_since = waiter.since
            queue.empty_since = None
        lane = queue.callers.get(waiter.caller)
        if lane is None:
            lane = queue.callers[waiter.caller] = deque()
        lane.append(waiter)
        queue.size += 1
        self._size += 1

    def cancel(self, waiter: Waiter, now: float = 0.0) -> None:
        """The waiter gave up (its client left, its wait timed out): it is never handed a slot.
        Its entry is dropped when its lane reaches it."""
        if waiter.cancelled or waiter.worker is not None:
            return
        waiter.cancelled = True
        self._left(waiter.model, now)

    def _left(self, model: str, now: float) -> None:
        queue = self._models[model]
        queue.size -= 1
        self._size -= 1
        if queue.size == 0:
            queue.empty_since = now
            queue.callers.clear()  # only cancelled entries were left

    def congested(self, model: str, now: float) -> bool:
        queue = self._models.get(model)
        return (queue is not None and queue.size > 0
                and now - queue.busy_since >= self.congestion_s)

    def pop_for(self, worker: Worker, models: Iterable[str], now: float) -> Waiter | None:
        """The waiter a free slot of ``worker`` goes to, among waiters for ``models`` (those
        the worker can serve) that accept it; the one whose model's queue has waited longest.
        The waiter is out of the queue, with ``worker`` set. None: nobody wants it."""
        best: _ModelQueue | None = None
        best_name = ""
        for name in models:
            queue = self._models.get(name)
            if queue is not None and queue.size and (best is None
                                                     or queue.busy_since < best.busy_since):
                best, best_name = queue, name
        if best is None:
            return None
        waiter = self._take(best, worker, now)
        if waiter is None:  # nobody in that queue takes this worker: try the others in turn
            for name in models:
                queue = self._models.get(name)
                if name != best_name and queue is not None and queue.size:
                    waiter = self._take(queue, worker, now)
                    if waiter is not None:
                        break
        return waiter

    def _take(self, queue: _ModelQueue, worker: Worker, now: float) -> Waiter | None:
        lifo = now - queue.busy_since >= self.congestion_s
        skipped = 0
        for caller in list(queue.callers):
            lane = queue.callers[caller]
            chosen = self._from_lane(lane, worker, lifo, skipped)
            if isinstance(chosen, int):
                skipped = chosen
                if not lane:
                    del queue.callers[caller]
                if skipped >= MAX_SKIPS:
                    return None
                continue
            if lane:
                queue.callers.move_to_end(caller)  # its turn is over: the next caller's
            else:
                del queue.callers[caller]
            chosen.worker = worker
            self._left(chosen.model, now)
            return chosen
        return None

    @staticmethod
    def _from_lane(lane: deque[Waiter], worker: Worker, lifo: bool,
                   skipped: int) -> Waiter | int:
        """Take the lane's first acceptable live waiter (newest first under ``lifo``), dropping
        cancelled ones on the way; or the number of waiters skipped so far."""
        pop = lane.pop if lifo else lane.popleft
        kept: list[Waiter] = []
        found: Waiter | None = None
        while lane and skipped < MAX_SKIPS:
            waiter = pop()
            if waiter.cancelled:
                continue
            if waiter.accept is None or waiter.accept(worker):
                found = waiter
                break
            kept.append(waiter)
            skipped += 1
        if lifo:
            lane.extend(reversed(kept))
        else:
            lane.extendleft(reversed(kept))
        return found if found is not None else skipped

    def take_all(self, model: str, now: float) -> list[Waiter]:
        """Every live waiter of ``model``, out of the queue (the model lost its last worker:
        they must look again and fail rather than wait out their timeout)."""
        queue = self._models.get(model)
        if queue is None:
            return []
        waiters = [waiter for lane in queue.callers.values() for waiter in lane
                   if not waiter.cancelled]
        for waiter in waiters:
            waiter.cancelled = True
            self._left(model, now)
        return waiters

    # --- the service rate, for shedding --------------------------------------------------------

    def served(self, model: str, held_s: float) -> None:
        """A job of ``model`` gave its slot back after ``held_s``: the mean hold time."""
        queue = self._models.get(model)
        if queue is None:
            queue = self._models[model] = _ModelQueue()
        if held_s >= 0:
            queue.hold_s = (held_s if queue.hold_s is None
                            else queue.hold_s + RATE_ALPHA * (held_s - queue.hold_s))

    def expected_wait_s(self, model: str, slots: int) -> float | None:
        """How long a job joining ``model``'s queue now would wait: the waiters ahead of it
        (and itself) over ``slots`` slots freeing every mean hold time. None before any job
        of the model has finished, or with no slots (nothing to go on: nobody is shed)."""
        queue = self._models.get(model)
        if queue is None or queue.hold_s is None or slots <= 0:
            return None
        return (queue.size + 1) * queue.hold_s / slots

    def forget(self, model: str) -> None:
        """Drop an empty model's record (the registry lost the model)."""
        queue = self._models.get(model)
        if queue is not None and queue.size == 0:
            del self._models[model]
