"""Let the swarm choose this worker's models (issue 17, opt-in ``swarm_models``): from the
queen's ``Demand``, pull the model most worth serving that fits, and evict the least recently
used models nobody asks for to make room, never beyond the disk quota.

``choose`` decides, as a pure function of the demand, the models held and the room (tested
with plain numbers); ``SwarmChooser`` runs its decisions on a ``WorkerService``: it listens to
the demand the queen sends, pulls in a thread (one pull at a time, the commit and sha256 the
queen pinned, so the queen routes to the copy) and sends a status at once so the queen knows.
Headless workers opt in with the same setting; the desktop app uses the same code.

The ranking (``worth``) is shared with the app's "In demand" list, so the model the swarm would
pull is the one the list shows first.

The room it plans with is the store's (``ModelStore.room_bytes``): the quota and the free disk
less its headroom (issue 34), so the swarm never fills the volunteer's disk; a pull is checked
again before anything is asked of the hub (``check_room``) and while it downloads.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from desktop_worker.engine.pool import ModelPool
from desktop_worker.errors import DownloadCancelled
from desktop_worker.settings import WorkerSettings
from desktop_worker.store import ModelStore
from shared_schema import Demand, ModelDemand

__all__ = ["Choice", "Held", "SwarmChooser", "choose", "is_wanted", "worth"]

log = logging.getLogger(__name__)

MB = 1 << 20
# Requests per minute, per worker serving a model, that keep one worker about busy (a request
# every ten seconds): past it, more demand does not raise one worker's earnings.
BUSY_REQUESTS_PER_MIN = 6.0
# A model whose pull failed is not tried again for this long (the hub refused, a mismatch).
RETRY_AFTER_S = 1800.0


@dataclass(frozen=True)
class Held:
    """A model in the store, as the choice needs it."""

    name: str
    size_bytes: int
    last_used: float
    loaded: bool = False
    sha256: str | None = None


@dataclass(frozen=True)
class Choice:
    pull: list[str] = field(default_factory=list)
    evict: list[str] = field(default_factory=list)
    why: str = ""


def is_wanted(d: ModelDemand) -> bool:
    """Someone asks for it now: requests, unmet requests or a queue."""
    return d.requests_per_min > 0 or d.unmet_per_min > 0 or d.queued > 0


def share(d: ModelDemand) -> float:
    """How busy one more worker serving ``d`` would be, 0 to 1: the demand left per worker that
    would serve it (those that hold it, those loading it, and this one), against what keeps a
    worker busy. Unmet and queued requests count in full: nobody serves them now."""
    servers = d.holders + d.loading + 1
    per_worker = d.requests_per_min / servers + d.unmet_per_min + d.queued
    return min(1.0, per_worker / BUSY_REQUESTS_PER_MIN)


def worth(d: ModelDemand) -> float:
    """The ranking of in-demand models, higher first: pay per token times this worker's speed
    on it (token rate is memory-bandwidth bound, so about inversely proportional to the file's
    bytes; the measured speed itself is the same factor for every model and drops out) times
    how busy it would keep the worker. Unpaid models (a queen that does not pay) rank by demand
    and size alone, so a free swarm still spreads its models."""
    size_gb = max(d.size_bytes or 0, MB) / (1 << 30)
    pay = d.earn_msat_per_1k_tokens if d.earn_msat_per_1k_tokens > 0 else 1e-3
    return pay / size_gb * share(d)


def _matches(d: ModelDemand, held: Held) -> bool:
    """The held copy is the file the queen pinned (or nothing is pinned to compare)."""
    return d.sha256 is None or held.sha256 is None or d.sha256 == held.sha256


def choose(
    demand: Demand,
    held: Sequence[Held],
    *,
    room_bytes: int,
    fits: Callable[[ModelDemand], bool],
    skip: Collection[str] = frozenset(),
    busy: bool = False,
) -> Choice:
    """What to pull (at most one) and what to evict for it.

    Candidates: models someone asks for that nobody serves well enough (unmet or queued
    requests, or no holder at all), that fit this machine's memory (``fits``), of known size,
    not held (or held as another file than the one pinned), and not in ``skip`` (recent
    failures). The best (``worth``) that fits the room is pulled. ``room_bytes`` is the room
    without evicting anything (the free disk and what the quota leaves, the smaller); evicting
    a model adds its size to both, so to the room. Models that may be evicted: not loaded and
    not in demand, least recently used first, only as many as needed. Nothing while ``busy``
    (a pull under way)."""
    if busy:
        return Choice(why="a pull is under way")
    by_name = {h.name: h for h in held}
    asked = {d.name for d in demand.models if is_wanted(d)}
    candidates = [
        d for d in demand.models
        if d.kind == "text"  # image models are the queen's to place (a fetch of kind image)
        and is_wanted(d) and (d.unmet_per_min > 0 or d.queued > 0 or d.holders == 0)
        and d.size_bytes is not None and d.name not in skip
        and (d.name not in by_name or not _matches(d, by_name[d.name]))
        and fits(d)
    ]
    if not candidates:
        return Choice(why="nothing in demand that fits and is not here already")
    evictable = sorted((h for h in held if not h.loaded and h.name not in asked),
                       key=lambda h: h.last_used)
    for d in sorted(candidates, key=worth, reverse=True):
        need = d.size_bytes or 0
        replaced = by_name.get(d.name)
        freed_by_replace = replaced.size_bytes if replaced is not None else 0
        victims: list[Held] = []
        freed = freed_by_replace
        while need > room_bytes + freed:
            spare = [h for h in evictable if h not in victims and h.name != d.name]
            if not spare:
                break
            victims.append(spare[0])
            freed += spare[0].size_bytes
        if need <= room_bytes + freed:
            return Choice([d.name], [v.name for v in victims],
                          f"{d.name}: {d.requests_per_min:g} requests/min, "
                          f"{d.holders} serving it")
    return Choice(why="what is in demand does not fit the disk or the quota")


class _Link(Protocol):
    def send_status_now(self) -> None: ...


class WorkerLike(Protocol):
    """What the chooser uses of a ``WorkerService`` (named here, not imported: the service
    builds the chooser)."""

    settings: WorkerSettings
    paused: str | None
    store: ModelStore
    pool: ModelPool
    link: _Link
    demand_listeners: list[Callable[[Demand], None]]

    def free_vram_mb(self) -> int | None: ...


class SwarmChooser:
    """Follows the queen's demand on a ``WorkerService`` when its owner lets the swarm choose
    (``settings.swarm_models``, read at each demand so the switch takes effect at once)."""

    def __init__(self, service: WorkerLike, *, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self.service = service
        self.clock = clock
        self.task: asyncio.Task[None] | None = None
        self.failed: dict[str, float] = {}  # name -> when its pull failed
        self.last: Choice | None = None
        self._cancel = threading.Event()  # set by ``close``: a pull under way stops
        service.demand_listeners.append(self.on_demand)

    async def close(self) -> None:
        """Stop a pull under way (its partial download stays, to resume) and wait for it."""
        self._cancel.set()
        if self.task is not None and not self.task.done():
            await asyncio.wait([self.task], timeout=10)

    def on_demand(self, demand: Demand) -> None:
        if not self.service.settings.swarm_models or self.service.paused:
            return
        if self.task is not None and not self.task.done():
            return  # one pull at a time; the next demand message decides again
        self.task = asyncio.get_running_loop().create_task(self.follow(demand))

    def fits(self, d: ModelDemand) -> bool:
        """The queen's memory figure against this worker's memory budget (and the usable VRAM
        when it has a GPU: a model spilling to the CPU earns too slowly to choose it). A model
        without a memory figure is not chosen: it cannot be judged."""
        if d.memory_mb is None:
            return False
        if d.memory_mb > self.service.pool.budget_mb:
            return False
        vram = self.service.free_vram_mb()
        return vram is None or vram <= 0 or d.memory_mb <= vram

    def decide(self, demand: Demand) -> Choice:
        store = self.service.store
        loaded = set(self.service.pool.loaded())
        held = [Held(m.name, m.size_bytes, m.last_used, m.name in loaded, m.sha256)
                for m in store.list()]
        now = self.clock()
        skip = {name for name, at in self.failed.items() if now - at < RETRY_AFTER_S}
        return choose(demand, held, room_bytes=store.room_bytes(loaded, evict=False),
                      fits=self.fits, skip=skip)

    async def follow(self, demand: Demand) -> None:
        try:
            choice = await asyncio.to_thread(self.decide, demand)
            self.last = choice
            if not choice.pull:
                log.debug("swarm choice: nothing to pull (%s)", choice.why)
                return
            if await asyncio.to_thread(self._apply, demand, choice):
                self.service.link.send_status_now()  # on the loop: the link's event is not
        except Exception:  # thread-safe  # a choice must never take the worker down
            log.exception("following the swarm's demand failed")

    def _apply(self, demand: Demand, choice: Choice) -> bool:
        """Evict, then pull (in a thread); whether a model was added."""
        store, pool = self.service.store, self.service.pool
        for name in choice.evict:
            if name in pool.loaded():
                log.info("swarm choice: %s is loaded now; not evicting it", name)
                continue
            log.info("swarm choice: evicting %s (least recently used, not in demand)", name)
            store.remove(name)
        wanted = {d.name: d for d in demand.models}
        added = False
        for name in choice.pull:
            d = wanted[name]
            log.info("swarm choice: pulling %s (%s)", name, choice.why)
            keep = {m.name for m in store.list()} - {name}
            try:
                if d.size_bytes is not None:
                    store.check_room(name, d.size_bytes, protect=keep, evict=True)
                store.pull(name, cancel=self._cancel, protect=keep, revision=d.revision,
                           expect_sha256=d.sha256, evict=True)
            except DownloadCancelled:
                log.info("swarm choice: the pull of %s stopped (the worker is stopping)", name)
                return added
            except Exception as exc:
                self.failed[name] = self.clock()
                log.warning("swarm choice: could not pull %s: %s", name, exc)
                continue
            self.failed.pop(name, None)
            log.info("swarm choice: %s is here; the queen is told", name)
            added = True
        return added
