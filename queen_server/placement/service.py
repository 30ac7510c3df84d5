"""Placing models on demand: what the queen does when a request names a model no worker holds.

``prepare(model)`` resolves the name on the hub (``catalog.resolve``: the pinned file, its size,
sha256 and shape; typed refusals for a name that cannot be served), checks the operator's lists
and size limit, picks a worker that fits (``planner.choose``) and sends it a ``fetch``. A request
then waits if the model will be ready within ``model_wait_s``, else it gets a 503
``model_loading`` with an ``estimated_time`` from the worker's reported download speed and a
``Retry-After``. Two requests for one model share one placement (one download). A worker that
fails a fetch (``fetch_failed``), leaves, or shows no progress for ``fetch_stall_s`` is replaced
by the next best, up to ``max_fetch_attempts``. A background loop sends every worker the
demand (``Demand``) each ``demand_interval_s`` and places one more copy of a model whose
requests keep finding every holder busy, up to ``max_copies_per_model``.

A model the group planner finds no single worker can hold (issue 19: by the operator's headroom
for groups) is fetched onto the worker that is to lead its group (``GroupHeads.head_to_fetch``:
trusted, with the ``rpc`` backend and room for the file):
a ``fetch`` with ``group`` set, which the worker downloads and checks but does not load. The
same waits, retries and estimates apply (plus the group's load); once the head holds the file
the group service forms the group.

A diffusion model (issue 38) is placed the same way for an image request (``prepare(model,
kind="image")``), only on workers with the ``image`` capability (``planner.image_need``), never
onto a group, with a ``fetch`` of ``kind`` ``image`` (the worker keeps it for its image engine).
A request of the other kind gets a 400 naming the endpoint before anything is spent: a text
request for a diffusion model (``model_makes_images``), an image request for a text model
(``model_not_image``). Image requests enter the demand book like text ones, and more copies of
an image model for unmet demand go to image workers (``add_copies``); the demand told to
workers marks image models (``ModelDemand.kind``), which workers following demand leave to the
queen.

What a placement costs is bounded before it is spent. The serving path calls ``prepare`` only
after the caller was admitted and its money held (``http.generation.serve``). A new placement is
counted against the caller's ``placements_per_key_per_hour`` (``budget.PlacementLimits``) before
the hub is read, whatever comes of it, and against the queen's ``placements_per_hour`` when a fetch
goes out; what the queen already knows it answers for free (``_known_refusal``: the operator's
lists, a name the hub lacks, from the catalog's negative cache, a model no worker fits).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from queen_server.catalog import ModelCatalog, ModelFacts, hub_name
from queen_server.errors import (
    ApiError,
    InvalidRequest,
    ModelForbidden,
    ModelLoading,
    ModelNotFound,
    ModelUnverified,
    NoCapacity,
    WorkerFailed,
)
from queen_server.placement.budget import PlacementLimits
from queen_server.placement.demand import DemandBook
from queen_server.placement.planner import ModelNeed, choose, image_need, need_of, repo_allowed
from queen_server.swarm.registry import Registry
from queen_server.swarm.worker import Worker
from shared_schema import Demand, DownloadProgress, Fetch, FetchFailed, ModelDemand, encode
from shared_schema.capabilities import IMAGE
from shared_schema.diffusion_check import DIFFUSION_ARCHITECTURE
from shared_schema.fitting import MB
from shared_schema.placement import MAX_DEMAND_MODELS

__all__ = ["GroupHeads", "Loading", "PlacementService", "PlacementSettings", "refusal"]

log = logging.getLogger(__name__)

LOAD_BYTES_PER_S = 1 << 30  # a loaded model maps its file: about a GB a second, plus a moment
LOAD_FIXED_S = 2.0
UNMET_AFTER_S = 0.5  # a request that waited longer for a worker counts as unmet demand
UNFIT_RECHECK_S = 10.0  # a model no worker could hold is looked at again after this long
MAX_UNFIT = 1000


class PlacementSettings(Protocol):
    @property
    def on_demand(self) -> bool: ...
    @property
    def model_allow(self) -> list[str]: ...
    @property
    def model_deny(self) -> list[str]: ...
    @property
    def max_model_gb(self) -> float | None: ...
    @property
    def model_wait_s(self) -> float: ...
    @property
    def price_wait_s(self) -> float: ...
    @property
    def fetch_stall_s(self) -> float: ...
    @property
    def max_fetch_attempts(self) -> int: ...
    @property
    def assumed_download_mb_s(self) -> float: ...
    @property
    def max_copies_per_model(self) -> int: ...
    @property
    def placements_per_hour(self) -> int: ...
    @property
    def placements_per_key_per_hour(self) -> int: ...
    @property
    def demand_interval_s(self) -> float: ...


class GroupHeads(Protocol):
    """Where a model no single worker can hold is fetched (``placement.groups.GroupService``)."""

    async def head_to_fetch(self, model: str, exclude: Collection[str]
                            ) -> Worker | str | None: ...
    def fetch_ended(self, model: str, ok: bool, why: str = "") -> None: ...
    def load_estimate_s(self, size_bytes: int) -> float: ...
    @property
    def group_only(self) -> set[str]: ...


@dataclass
class Loading:
    """One model's placement under way: the workers asked, and those that failed it."""

    need: ModelNeed
    facts: ModelFacts
    started: float
    asked: dict[str, float] = field(default_factory=dict)  # worker key -> last progress time
    progress: dict[str, int] = field(default_factory=dict)  # worker key -> bytes downloaded
    failed: dict[str, str] = field(default_factory=dict)  # worker key -> why
    done: set[str] = field(default_factory=set)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    error: ApiError | None = None
    group: bool = False  # fetched onto a group's would-be head (not loaded there)
    no_group: str | None = None  # why no group could serve it, in words


def refusal(model: str, exc: ModelUnverified) -> ApiError:
    """The answer for a name the hub cannot resolve into one pinned file."""
    kind = exc.kind
    if kind == "not_found":
        return ModelNotFound(f"The model '{model}' does not exist on the hub: {exc}",
                             param="model")
    if kind == "gated":
        return ModelForbidden(f"The model '{model}' is gated on the hub and this queen has no "
                              f"access to it: {exc}", param="model", code="model_gated")
    if kind in ("ambiguous", "no_match"):
        shown = exc.candidates[:20]
        more = f" (and {len(exc.candidates) - 20} more)" if len(exc.candidates) > 20 else ""
        what = "matches several files" if kind == "ambiguous" else "matches no file"
        pick = (f"; name one of: {', '.join(shown)}{more}" if shown
                else "; the repo holds no .gguf file")
        return InvalidRequest(f"The filter in '{model}' {what}{pick}", param="model",
                              code="model_ambiguous" if kind == "ambiguous"
                              else "model_file_not_found", extra={"candidates": exc.candidates})
    if kind == "unreachable":
        return NoCapacity(f"The queen cannot read '{model}' on the hub right now: {exc}",
                          code="hub_unreachable", headers={"Retry-After": "30"})
    return InvalidRequest(f"The model '{model}' cannot be served: {exc}", param="model",
                          code="model_unusable")


def need_for(model: str, facts: ModelFacts) -> ModelNeed:
    """What serving the pinned file takes: a diffusion model's (an image worker's) or an
    LLM's."""
    size = facts.size_bytes or 0
    if (facts.architecture or "").startswith(DIFFUSION_ARCHITECTURE):
        return image_need(model, facts.sha256, size)
    return need_of(model, facts.sha256, size, facts.shape)


def wrong_kind(model: str, found: str) -> InvalidRequest:
    """The 400 for a request of the other kind than ``model``'s (``found``)."""
    if found == "image":
        return InvalidRequest(f"The model '{model}' makes images: use /v1/images/generations.",
                              param="model", code="model_makes_images")
    return InvalidRequest(f"The model '{model}' is a text model: /v1/images/generations needs a "
                          "diffusion model.", param="model", code="model_not_image")


class PlacementService:
    def __init__(
        self,
        settings: PlacementSettings,
        registry: Registry,
        catalog: ModelCatalog,
        *,
        speeds_for: Callable[[str], Mapping[str, float]],
        size_class_of: Callable[[str], str],
        earn_msat_per_1k: Callable[[str], int],
        clock: Callable[[], float] = time.monotonic,
        groups: GroupHeads | None = None,
    ) -> None:
        self.settings = settings
        self.groups = groups
        self.registry = registry
        self.catalog = catalog
        self.speeds_for = speeds_for
        self.size_class_of = size_class_of
        self.earn_msat_per_1k = earn_msat_per_1k
        self.clock = clock
        self.book = DemandBook(clock=clock)
        self.loading: dict[str, Loading] = {}
        self._placing: dict[str, asyncio.Task[Loading]] = {}
        self.limits = PlacementLimits(settings, clock)
        self._demand = Demand(models=[], interval_s=settings.demand_interval_s)
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop: asyncio.Task[None] | None = None
        # Models no connected worker could hold, until when: a client asking again and again
        # for one gets the same answer without a scan of every worker each time.
        self._unfit: dict[str, tuple[float, str]] = {}

    # --- what routing asks ------------------------------------------------------------------

    def pinned(self, model: str) -> frozenset[str | None] | None:
        """The sha256s of the files that may serve ``model`` (``catalog.served_files``:
        workers holding another file are not used), None for any."""
        return self.catalog.served_files(model)

    @property
    def demand(self) -> Demand:
        """The last demand told to workers (sent in each welcome, and by ``/worker/demand``)."""
        return self._demand

    def started(self, model: str, waited_s: float) -> None:
        """A request for ``model`` reached a worker after ``waited_s`` (for the demand: one
        that waited more than a moment found every holder busy)."""
        book = self.book
        book.asked(model, met=waited_s < UNMET_AFTER_S)
        book.waited(model, waited_s)

    # --- a request for a model nobody holds -------------------------------------------------

    def placeable(self, model: str) -> bool:
        """Whether ``prepare`` would try to place ``model`` at all: placement is on, some
        connected worker takes models, and it is a hub name. Reads nothing (a request for a
        model that is not placeable is answered 404 before its caller is counted)."""
        return (self.settings.on_demand and hub_name(model) is not None
                and bool(self.registry.takers()))

    async def prepare(self, model: str, caller: str | None = None, *,
                      kind: str = "text") -> None:
        """Place ``model`` (or join its placement under way), then wait for it if it will be
        ready within ``model_wait_s``; else ``ModelLoading`` with an estimate. Returns at once
        for a name that is not a hub name or when placement is off (the caller's 404).

        ``caller`` (``http.generation.caller_of``) is charged one of its
        ``placements_per_key_per_hour`` for a new placement that reads the hub or sends a
        fetch, whatever comes of it; joining a placement under way, and a refusal the queen
        already knows (the operator's lists, a name the hub said it lacks, no worker fits),
        cost nothing and are not counted. The serving path calls this only once the caller
        was admitted and its money held. ``kind``: ``image`` for an image request (a diffusion
        model, on an image worker); a model of the other kind is a 400 naming the endpoint."""
        if not self.placeable(model):
            return  # nobody to place it on: the caller's 404 says no worker serves it
        loading = self.loading.get(model)
        if loading is None and self._held(model):
            return  # placed since the caller looked: routing serves it now
        if loading is None or (loading.ready.is_set() and not loading.asked):
            loading = await self._placement(model, caller, kind)
        self._check_kind(model, loading, kind)
        estimate = self.estimate_s(loading)
        if estimate > self.settings.model_wait_s:
            self.book.asked(model, met=False)  # a request that starts is counted by ``started``
            raise self._loading_error(model, estimate)
        self.book.queue(model, 1)
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(loading.ready.wait(), self.settings.model_wait_s)
        finally:
            self.book.queue(model, -1)
        if loading.error is not None:
            raise loading.error
        if not loading.ready.is_set():
            self.book.asked(model, met=False)
            raise self._loading_error(model, self.estimate_s(loading))

    def _check_kind(self, model: str, loading: Loading, kind: str) -> None:
        """A 400 for a request of ``kind`` joining the placement of a model of the other."""
        if loading.need.kind != kind:
            raise wrong_kind(model, loading.need.kind)

    def _held(self, model: str) -> bool:
        """Whether a connected worker holds the file ``model`` is pinned to."""
        pin = self.catalog.pin(model)
        if pin is None:
            return False
        for worker in self.registry.holders(model):
            held = worker.models.get(model)
            if held is not None and held.sha256 == pin.sha256:
                return True
        return False

    def _loading_error(self, model: str, estimate: float) -> ModelLoading:
        seconds = max(1, round(estimate))
        return ModelLoading(
            f"The model '{model}' is being loaded onto a worker; it should be ready in about "
            f"{seconds} s. Try again then.", code="model_loading",
            headers={"Retry-After": str(seconds)}, extra={"estimated_time": round(estimate, 1)})

    async def _placement(self, model: str, caller: str | None, kind: str) -> Loading:
        task = self._placing.get(model)
        if task is None:  # one resolution and one first fetch, however many ask at once
            self._known_refusal(model)
            if self.catalog.pin(model) is None:  # the hub is to be read: within the limits
                self.limits.spend_queen(model, check_only=True)
            if caller is not None:
                self.limits.charge(caller, model)
            task = asyncio.get_running_loop().create_task(self._place(model, kind))
            self._placing[model] = task
            task.add_done_callback(lambda _t: self._placing.pop(model, None))
        return await asyncio.shield(task)

    def _known_refusal(self, model: str) -> None:
        """Raise what the queen already knows it answers for ``model`` without reading the hub
        or asking a worker: the operator's lists, a name the hub said it lacks (the catalog's
        remembered failure, until it is read again), a model no worker could hold a moment
        ago. Costs the caller nothing."""
        parsed = hub_name(model)
        assert parsed is not None
        settings = self.settings
        why = repo_allowed(parsed.repo_id, settings.model_allow, settings.model_deny)
        if why is not None:
            raise ModelForbidden(f"The model '{model}' is not served here: {why}.",
                                 param="model")
        unfit = self._unfit.get(model)
        if unfit is not None and unfit[0] > self.clock():
            raise NoCapacity(unfit[1], code="no_worker_fits")
        failed = self.catalog.remembered_failure(model)
        if failed is not None:
            raise refusal(model, failed)

    async def _place(self, model: str, kind: str) -> Loading:
        settings = self.settings
        try:
            facts = await self.catalog.resolve(model, settings.price_wait_s)
        except ModelUnverified as exc:
            raise refusal(model, exc) from exc
        need = need_for(model, facts)
        if need.kind != kind:  # before any fetch: it would be of no use to the request
            raise wrong_kind(model, need.kind)
        size = need.size_bytes
        limit = settings.max_model_gb
        if limit is not None and size > limit * 1e9:
            raise InvalidRequest(
                f"The model '{model}' is {size / 1e9:.1f} GB; this queen places models up to "
                f"{limit:g} GB (APIARY_MAX_MODEL_GB).", param="model", code="model_too_large")
        spent = self.limits.spend_queen(model)
        loading = Loading(need, facts, self.clock())
        self.loading[model] = loading
        # A model the group planner finds no one worker can hold goes to a group's head;
        # any other (or one no group can serve either) to the best worker that fits it.
        # Image models are never split across a group.
        loading.group = self.groups is not None and kind == "text"
        await self._ask_more(loading, 1)
        if loading.group and not loading.asked and not loading.failed:
            loading.group = False
            await self._ask_more(loading, 1)
        if not loading.asked:  # no fetch went out: no placement spent
            self.limits.refund_queen(spent)
            if loading.failed:  # the workers chosen could not even be sent the fetch
                self._give_up(loading)
            if self.loading.get(model) is loading:
                del self.loading[model]
            if loading.error is not None:
                raise loading.error
            raise self._no_worker_fits(loading.need, loading.no_group)
        return loading

    def _no_worker_fits(self, need: ModelNeed, no_group: str | None = None) -> NoCapacity:
        """The answer for a model no connected worker can hold, remembered for
        ``UNFIT_RECHECK_S`` (so a flood of requests for it costs one scan, not one each)."""
        now = self.clock()
        message = self._unplaceable(need)
        if no_group:
            message += f" No group of workers can serve it together either: {no_group}."
        if len(self._unfit) >= MAX_UNFIT:
            self._unfit = {k: v for k, v in self._unfit.items() if v[0] > now}
        if len(self._unfit) < MAX_UNFIT:
            self._unfit[need.name] = (now + UNFIT_RECHECK_S, message)
        return NoCapacity(message, code="no_worker_fits")

    def _unplaceable(self, need: ModelNeed) -> str:
        takers: Collection[Worker] = self.registry.takers()
        what = "models"
        if need.kind == "image":
            takers = [w for w in takers if IMAGE in w.capabilities]
            what = "image models"
        file_mb = -(-need.size_bytes // MB)
        if not takers:
            return (f"No connected worker takes {what} on demand, so '{need.name}' "
                    f"({file_mb:,} MB) cannot be placed; try again later.")
        room = max((w.model_room_mb or 0) for w in takers)
        memory = max((w.memory_budget_mb or 0) for w in takers)
        return (f"No connected worker can hold '{need.name}': it needs {file_mb:,} MB of disk and "
                f"{need.memory_mb:,} MB of memory; the most any of the {len(takers)} workers "
                f"taking {what} has is {room:,} MB of room and a {memory:,} MB memory budget.")

    async def _ask_more(self, loading: Loading, count: int) -> None:
        """Send ``fetch`` to up to ``count`` more workers (never one that failed it). A worker
        whose socket refuses the frame has failed it: the next best is asked in its place, here
        and now, so that the caller sees the worker actually asked (or none)."""
        need = loading.need
        facts = loading.facts
        frame = encode(Fetch(name=need.name, repo_id=facts.repo_id, revision=facts.commit,
                             paths=list(facts.paths), sha256=need.sha256,
                             size_bytes=need.size_bytes, group=loading.group,
                             kind=need.kind))
        while count > 0 and len(loading.failed) < self.settings.max_fetch_attempts:
            exclude = loading.failed.keys() | loading.asked.keys() | loading.done
            if loading.group:
                chosen = await self._group_head(loading, exclude)
            else:
                speeds = self.speeds_for(self.size_class_of(need.name))
                chosen = choose(need, self.registry.takers(), speeds, count, exclude=exclude)
            if not chosen:
                return
            for worker in chosen:
                connection = self.registry.connection(worker.key)
                if connection is None:  # gone since ``takers`` listed it
                    loading.failed[worker.key] = "worker_left: not connected"
                    continue
                loading.asked[worker.key] = self.clock()
                worker.downloads[need.name] = DownloadProgress(
                    name=need.name, downloaded_bytes=0, total_bytes=need.size_bytes)
                log.info("placing %s on worker %s (%d MB)", need.name, worker.public_id,
                         need.size_bytes // MB)
                try:
                    await connection.send_frame(frame)
                except Exception as exc:  # its socket is gone; its cleanup follows
                    loading.asked.pop(worker.key, None)
                    worker.downloads.pop(need.name, None)
                    loading.failed[worker.key] = (
                        f"worker_left: sending the fetch failed: {exc}"[:300])
                    log.warning("worker %s could not be sent the fetch of %s: %s",
                                worker.public_id, need.name, exc)
                    continue
                count -= 1

    async def _group_head(self, loading: Loading, exclude: Collection[str]) -> list[Worker]:
        """The worker to fetch ``loading``'s model for a group it is to lead, if any."""
        assert self.groups is not None
        found = await self.groups.head_to_fetch(loading.need.name, exclude)
        if isinstance(found, str):
            loading.no_group = found
            return []
        return [found] if found is not None else []

    def estimate_s(self, loading: Loading) -> float:
        """Seconds until the soonest asked worker should have the model loaded."""
        if loading.ready.is_set():
            return 0.0
        best: float | None = None
        assumed = self.settings.assumed_download_mb_s * MB
        for key in loading.asked:
            worker = self.registry.get(key)
            progress = worker.downloads.get(loading.need.name) if worker is not None else None
            total = loading.need.size_bytes
            done = progress.downloaded_bytes if progress is not None else 0
            speed = progress.bytes_per_s if progress is not None and progress.bytes_per_s else None
            seconds = max(total - done, 0) / (speed or assumed)
            if loading.group and self.groups is not None:
                seconds += self.groups.load_estimate_s(total)
            else:
                seconds += total / LOAD_BYTES_PER_S + LOAD_FIXED_S
            best = seconds if best is None else min(best, seconds)
        return best if best is not None else float(self.settings.model_wait_s) + 1

    # --- what workers say -------------------------------------------------------------------

    def on_status(self, worker: Worker) -> None:
        """A worker's status was applied (``Registry.apply_status``): a fetched model it now
        holds ends the wait; download progress keeps its placement from counting as stalled."""
        now = self.clock()
        for name, loading in list(self.loading.items()):
            if worker.key not in loading.asked:
                continue
            held = worker.models.get(name)
            if held is not None and held.sha256 == loading.need.sha256:
                del loading.asked[worker.key]
                loading.done.add(worker.key)
                loading.ready.set()
                log.info("worker %s now %s %s (%.0f s after it was asked for)",
                         worker.public_id, "holds, to lead a group," if loading.group
                         else "serves", name, now - loading.started)
                if loading.group and self.groups is not None:
                    self.groups.fetch_ended(name, True)
                if not loading.asked:
                    del self.loading[name]
                continue
            progress = worker.downloads.get(name)
            if progress is not None and progress.downloaded_bytes > loading.progress.get(
                    worker.key, -1):
                loading.progress[worker.key] = progress.downloaded_bytes
                loading.asked[worker.key] = now

    def fetch_failed(self, worker: Worker, failure: FetchFailed) -> None:
        loading = self.loading.get(failure.name)
        if loading is None or worker.key not in loading.asked:
            return
        self._failed(loading, worker, failure.code, failure.message)

    def left(self, worker: Worker) -> None:
        for loading in list(self.loading.values()):
            if worker.key in loading.asked:
                self._failed(loading, worker, "worker_left", "the worker disconnected")

    def _failed(self, loading: Loading, worker: Worker, code: str, message: str) -> None:
        name = loading.need.name
        loading.asked.pop(worker.key, None)
        worker.downloads.pop(name, None)
        loading.failed[worker.key] = f"{code}: {message}"[:300]
        log.warning("worker %s could not fetch %s (%s): %s", worker.public_id, name, code,
                    message[:200])
        if loading.ready.is_set() or loading.asked:
            if not loading.asked and self.loading.get(name) is loading:
                del self.loading[name]
            return
        if len(loading.failed) < self.settings.max_fetch_attempts:
            self._spawn(self._retry(loading))
            return
        self._give_up(loading)

    async def _retry(self, loading: Loading) -> None:
        await self._ask_more(loading, 1)
        if not loading.asked and not loading.ready.is_set():
            self._give_up(loading)

    def _give_up(self, loading: Loading) -> None:
        name = loading.need.name
        reasons = "; ".join(loading.failed.values()) or self._unplaceable(loading.need)
        loading.error = WorkerFailed(
            f"No worker could fetch '{name}' ({len(loading.failed)} tried): {reasons}",
            code="fetch_failed")
        loading.ready.set()
        if self.loading.get(name) is loading:
            del self.loading[name]
        if loading.group and self.groups is not None:
            self.groups.fetch_ended(name, False, reasons)

    # --- the background loop ----------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        tasks = [*self._tasks, *([self._loop] if self._loop else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _spawn(self, coro: object) -> None:
        task = asyncio.get_running_loop().create_task(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self) -> None:
        interval = self.settings.demand_interval_s
        next_demand = 0.0
        while True:
            try:
                self.check_stalls()
                if self.clock() >= next_demand:
                    next_demand = self.clock() + interval
                    await self.tell_demand()
                    await self.add_copies()
            except Exception:  # the loop must outlive any one bad round
                log.exception("the placement loop failed a round")
            await asyncio.sleep(min(interval, 5.0))

    def check_stalls(self) -> None:
        now = self.clock()
        for loading in list(self.loading.values()):
            for key, last in list(loading.asked.items()):
                if now - last > self.settings.fetch_stall_s:
                    worker = self.registry.get(key)
                    if worker is None:
                        loading.asked.pop(key, None)
                        continue
                    self._failed(loading, worker, "stalled", "no progress for "
                                 f"{self.settings.fetch_stall_s:.0f} s")

    def demand_rows(self) -> list[ModelDemand]:
        rows = []
        for row in self.book.rows()[:MAX_DEMAND_MODELS]:
            facts = self.catalog.pin(row.name)
            need = need_for(row.name, facts) if facts is not None else None
            loading = self.loading.get(row.name)
            rows.append(ModelDemand(
                name=row.name, requests_per_min=row.requests_per_min,
                unmet_per_min=row.unmet_per_min, queued=row.queued,
                mean_wait_s=row.mean_wait_s, holders=len(self.registry.holders(row.name)),
                loading=len(loading.asked) if loading is not None else 0,
                size_bytes=facts.size_bytes if facts is not None else None,
                parameter_count=facts.parameter_count if facts is not None else None,
                memory_mb=need.memory_mb if need is not None else None,
                sha256=facts.sha256 if facts is not None else None,
                revision=facts.commit if facts is not None else None,
                earn_msat_per_1k_tokens=self.earn_msat_per_1k(row.name),
                kind=need.kind if need is not None else "text"))
        return rows

    async def tell_demand(self) -> None:
        """Send every worker the demand (one frame, encoded once)."""
        self._demand = Demand(models=self.demand_rows(),
                              interval_s=self.settings.demand_interval_s)
        frame = encode(self._demand)
        for worker in self.registry:
            connection = self.registry.connection(worker.key)
            if worker.legacy or connection is None:
                continue
            with contextlib.suppress(Exception):  # a socket that broke: its cleanup follows
                await connection.send_frame(frame)

    async def add_copies(self) -> None:
        """One more copy of each pinned model whose requests found every holder busy."""
        if not self.settings.on_demand:
            return
        for row in self._demand.models:
            if row.unmet_per_min <= 0 or row.sha256 is None or row.loading:
                continue
            if self.groups is not None and row.name in self.groups.group_only:
                continue  # a lone copy would not be used: its group serves it
            if row.holders >= self.settings.max_copies_per_model:
                continue
            facts = self.catalog.pin(row.name)
            if facts is None:
                continue
            loading = Loading(need_for(row.name, facts), facts, self.clock())
            loading.ready.set()  # requests do not wait for a copy: the model is served
            await self._ask_more(loading, 1)
            if loading.asked:
                log.info("demand for %s (%.1f unmet requests a minute): placing another copy",
                         row.name, row.unmet_per_min)
                self.loading[row.name] = loading

    # --- reports ----------------------------------------------------------------------------

    def placements(self) -> list[dict[str, object]]:
        """The placements under way, for ``/v1/models`` and the admin pages."""
        out: list[dict[str, object]] = []
        for name, loading in self.loading.items():
            for key in loading.asked:
                worker = self.registry.get(key)
                progress = worker.downloads.get(name) if worker is not None else None
                total = loading.need.size_bytes or None
                done = progress.downloaded_bytes if progress is not None else 0
                out.append({
                    "model": name, "worker": worker.public_id if worker else key[:12],
                    "sha256": loading.need.sha256, "size_bytes": loading.need.size_bytes,
                    "downloaded_bytes": done,
                    "progress": round(done / total, 3) if total else None,
                    "bytes_per_s": progress.bytes_per_s if progress is not None else None,
                    "estimated_time": round(self.estimate_s(loading), 1),
                    "since_s": round(self.clock() - loading.started, 1),
                    "failed": dict(loading.failed),
                    "for_group": loading.group,
                })
        return out
