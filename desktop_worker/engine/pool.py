"""Loaded models and their contexts: load on demand, hand a free context to each job, run the
blocking work in threads, and unload idle models (least recently used first) to stay within
the memory budget. ``choose_evictions`` is the pure deciding part.

A fine-tuned model (issue 37) is served under its own name as its base plus a LoRA adapter:
``register_adapter(name, base_name, adapter_path)`` checks the adapter against the base
(``engine.adapters``); from then on ``name`` loads as an ``AdaptedModel``, beside the plain
base, counted as the base plus the adapter.

Each context is made by the pool's factory (``contexts``). The worker's is
``sandbox.context.SandboxedContexts`` (issue 34): every context is a confined engine child, so
the worker's process never loads llama.cpp; the engine's own tests and the benchmarks pass
``llama_model.llama_context`` (in this process). A context whose ``alive`` turns false (its
child crashed, or a group's head ended) is dropped after its job and the next job gets a new
one.

Memory the worker spends outside llama.cpp counts against the same budget: an image child
(issue 38) ``reserve``s what its sandbox allows it before it starts (idle models are unloaded to
make room, as for a load) and ``release``s it when it ends; loads count what is reserved as
in use."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from desktop_worker.engine.adapters import AdapterInfo, check_adapter_file
from desktop_worker.engine.scores import Score, ScoreRequest
from shared_schema.fitting import (
    MB,
    LoadPlan,
    ModelShape,
    batch_slots,
    kv_bytes_per_layer,
    memory_cost_mb,
    plan_load,
)

log = logging.getLogger(__name__)


class EngineContext(Protocol):
    """What the pool needs of a context (``LlamaContext`` in an engine child, a
    ``SandboxedContext`` here, a group's ``GroupHead``). Blocking; ``busy`` holds one permit
    per job it runs at once (a lock: one; a batched context: its slots)."""

    busy: threading.Lock | threading.Semaphore

    def stream(self, kind: str, request: dict[str, Any], cancel: threading.Event,
               continuation: str | None = None) -> Iterator[dict[str, Any]]: ...
    def usage(self) -> dict[str, int]: ...
    def score(self, job: ScoreRequest, cancel: threading.Event) -> Score | None: ...
    def embed(self, inputs: list[str] | list[list[int]]
              ) -> tuple[list[list[float]], int]: ...
    def close(self) -> None: ...


# Makes a context of a model: ``(model, plan, n_threads, embedding)``, blocking (it runs in the
# pool's threads): a confined engine child (``SandboxedContexts``), or for a model group's
# model (issue 19) a head, which has the same ``stream``/``usage``/``busy``/``close``.
ContextFactory = Callable[["ServableModel", LoadPlan, "int | None", bool], Any]


class ServableModel(Protocol):
    """What the pool needs from the store's ``LocalModel``."""

    @property
    def name(self) -> str: ...
    @property
    def path(self) -> Any: ...
    @property
    def size_bytes(self) -> int: ...
    @property
    def info(self) -> ModelShape: ...


@dataclass(frozen=True, slots=True)
class Adapter:
    """A checked LoRA adapter file and the scale it is applied at."""

    path: Path
    size_bytes: int
    scale: float = 1.0


@dataclass(frozen=True, slots=True)
class AdaptedModel:
    """A fine-tuned model as the pool serves it: its base's file and shape, the adapter on
    top, under its own name; its size the base's plus the adapter's."""

    name: str
    base: ServableModel
    adapter: Adapter

    @property
    def path(self) -> Any:
        return self.base.path

    @property
    def paths(self) -> tuple[Any, ...]:
        return tuple(getattr(self.base, "paths", None) or (self.base.path,))

    @property
    def size_bytes(self) -> int:
        return self.base.size_bytes + self.adapter.size_bytes

    @property
    def info(self) -> ModelShape:
        return self.base.info


@dataclass(frozen=True, slots=True)
class Resident:
    """A loaded model as eviction sees it."""

    name: str
    cost_mb: int
    last_used: float
    busy: bool


def choose_evictions(residents: Sequence[Resident], need_mb: int, budget_mb: int) -> list[str]:
    """The idle models to unload, least recently used first, so ``need_mb`` more fits."""
    used = sum(resident.cost_mb for resident in residents)
    chosen: list[str] = []
    for resident in sorted(residents, key=lambda r: r.last_used):
        if used + need_mb <= budget_mb:
            break
        if resident.busy:
            continue
        chosen.append(resident.name)
        used -= resident.cost_mb
    return chosen


@dataclass
class _Loaded:
    model: ServableModel
    plan: LoadPlan
    contexts: list[EngineContext] = field(default_factory=list)
    embedder: EngineContext | None = None
    last_used: float = field(default_factory=time.monotonic)
    active: int = 0
    making: int = 0  # chat contexts being made now (counted against the limit)
    slots: int = 1  # sequences in its one batched context (issue 36); 1: a context per job

    @property
    def caches(self) -> int:
        """KV caches of ``plan.n_ctx`` its contexts hold: a batched context's sequences and
        the model's own context beside them."""
        per_context = self.slots + 1 if self.slots > 1 else 1
        return per_context * max(1, len(self.contexts)) + (1 if self.embedder else 0)

    @property
    def cost_mb(self) -> int:
        return memory_cost_mb(self.model.info, self.model.size_bytes, self.plan.n_ctx,
                              self.caches)


_END = object()


class ModelPool:
    def __init__(
        self,
        resolve: Callable[[str], ServableModel],
        contexts: ContextFactory,
        *,
        max_jobs: int = 1,
        gpu_layers: int | Literal["auto"] = "auto",
        n_ctx: int | None = None,
        n_threads: int | None = None,
        free_vram_mb: Callable[[], int | None] = lambda: None,
        budget_mb: int = 8192,
        max_contexts: Callable[[str], int | None] | None = None,
    ) -> None:
        """``max_contexts(name)``: the most chat contexts of ``name`` at once, below
        ``max_jobs`` (None: ``max_jobs``); a model group's head is one (each head would upload
        every weight to the members again)."""
        self.resolve = resolve
        self.contexts = contexts
        self.max_contexts = max_contexts
        self.max_jobs = max_jobs
        self.gpu_layers = gpu_layers
        self.n_ctx = n_ctx
        self.n_threads = n_threads
        self.free_vram_mb = free_vram_mb
        self.budget_mb = budget_mb
        self._loaded: dict[str, _Loaded] = {}
        self._reserved: dict[str, int] = {}  # memory outside llama.cpp: key -> MB
        self._adapters: dict[str, tuple[str, Adapter]] = {}  # name -> (base name, adapter)
        self._load_locks: dict[str, asyncio.Lock] = {}
        self._freed = asyncio.Condition()
        self._executor = ThreadPoolExecutor(max_workers=max_jobs + 1,
                                            thread_name_prefix="apiary-llama")

    def loaded(self) -> set[str]:
        return set(self._loaded)

    @property
    def batched(self) -> bool:
        """Whether the factory's contexts run several jobs in one batch (issue 36)."""
        return bool(getattr(self.contexts, "batched", False))

    def context_limit(self, name: str) -> int:
        """How many chat contexts of ``name`` may exist at once (at least one): one when its
        context batches its jobs."""
        entry = self._loaded.get(name)
        if entry is not None and entry.slots > 1:
            return 1
        limit = self.max_contexts(name) if self.max_contexts is not None else None
        return max(1, min(self.max_jobs, limit)) if limit is not None else self.max_jobs

    # --- fine-tuned models ---------------------------------------------------------------------

    async def register_adapter(self, name: str, base_name: str, adapter_path: Path | str, *,
                               scale: float = 1.0) -> AdapterInfo:
        """Serve ``name`` as ``base_name`` (resolved as any model) plus the LoRA adapter at
        ``adapter_path``, once the adapter passes ``check_adapter_file`` against that base
        (``InvalidAdapter`` otherwise, and nothing changes). A name loaded with another
        adapter or base is unloaded, so its next job loads the new one."""
        if name == base_name:
            raise ValueError("a fine-tuned model needs a name of its own")
        if not 0.0 <= scale <= 16.0:
            raise ValueError(f"an adapter's scale is 0 to 16, not {scale}")
        base = self.resolve(base_name)
        info = await self._run(check_adapter_file, Path(adapter_path), Path(base.path))
        registered = (base_name, Adapter(info.path, info.size_bytes, scale))
        if self._adapters.get(name) != registered:
            await self.unload(name)
            self._adapters[name] = registered
        log.info("%s is %s with the LoRA adapter %s (%d bytes, %d weights)", name, base_name,
                 info.path.name, info.size_bytes, len(info.ranks))
        return info

    async def forget_adapter(self, name: str) -> None:
        """Stop serving a fine-tuned name (unloaded first); its base stays as it is."""
        if self._adapters.pop(name, None) is not None:
            await self.unload(name)

    def adapted(self) -> dict[str, str]:
        """The fine-tuned names this pool serves, each with its base's name."""
        return {name: base for name, (base, _) in self._adapters.items()}

    def _model(self, name: str) -> ServableModel:
        """What ``name`` loads: a registered fine-tuned model, or what ``resolve`` says."""
        registered = self._adapters.get(name)
        if registered is None:
            return self.resolve(name)
        base_name, adapter = registered
        return AdaptedModel(name, self.resolve(base_name), adapter)

    # --- loading ------------------------------------------------------------------------------

    async def _run(self, func: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, func, *args)

    async def load(self, name: str) -> LoadPlan:
        """Make sure ``name`` is loaded with one chat context; returns how it was loaded."""
        entry = await self._entry(name)
        if not entry.contexts and not entry.making:
            await self._add_context(entry, take=False)
        return entry.plan

    async def _entry(self, name: str) -> _Loaded:
        lock = self._load_locks.setdefault(name, asyncio.Lock())
        async with lock:
            entry = self._loaded.get(name)
            if entry is not None:
                return entry
            model = self._model(name)
            plan = plan_load(model.info, self.free_vram_mb(), gpu_layers=self.gpu_layers,
                             n_ctx=self.n_ctx)
            entry = _Loaded(model, plan, slots=self._slots(name, model, plan))
            await self._make_room(entry.cost_mb + self._context_mb(entry), exclude=name)
            self._loaded[name] = entry
            log.info("loading %s: n_ctx=%d, gpu layers=%d (%s)", name, plan.n_ctx,
                     plan.n_gpu_layers, plan.reason)
            return entry

    def _slots(self, name: str, model: ServableModel, plan: LoadPlan) -> int:
        """Sequences in the model's batch: ``max_jobs`` as memory allows (``batch_slots``);
        one when the factory does not batch or the model is held to one context (a group's
        head)."""
        if not self.batched or self.max_jobs <= 1:
            return 1
        if self.max_contexts is not None and self.max_contexts(name) == 1:
            return 1
        used = sum(entry.cost_mb for entry in self._loaded.values())
        return batch_slots(model.info, model.size_bytes, plan, budget_mb=self.budget_mb,
                           used_mb=used, free_vram_mb=self.free_vram_mb(),
                           max_slots=self.max_jobs)

    def slots(self, name: str) -> int:
        """Jobs of ``name`` that run at once (its batch, or its contexts)."""
        entry = self._loaded.get(name)
        return entry.slots if entry is not None and entry.slots > 1 else self.context_limit(name)

    def _context_mb(self, entry: _Loaded) -> int:
        info = entry.model.info
        caches = entry.slots + 1 if entry.slots > 1 else 1
        return kv_bytes_per_layer(info, entry.plan.n_ctx) * info.block_count * caches // MB

    async def _new_context(self, entry: _Loaded, *, embedding: bool) -> EngineContext:
        await self._make_room(self._context_mb(entry), exclude=entry.model.name)
        started = time.perf_counter()
        if entry.slots > 1 and not embedding:
            context = await self._run(lambda: self.contexts(
                entry.model, entry.plan, self.n_threads, embedding, slots=entry.slots))
        else:
            context = await self._run(
                lambda: self.contexts(entry.model, entry.plan, self.n_threads, embedding))
        log.info("loaded a %s context for %s in %.2f s", "embedding" if embedding else "chat",
                 entry.model.name, time.perf_counter() - started)
        return context

    async def _add_context(self, entry: _Loaded, *, take: bool) -> EngineContext:
        """A new chat context in ``entry`` (busy already when ``take``), counted in ``making``
        meanwhile, so jobs arriving during a slow load (a group's head uploads its members'
        weights) wait for it rather than make more than the limit."""
        entry.making += 1
        try:
            context = await self._new_context(entry, embedding=False)
            if take:
                context.busy.acquire()
            entry.contexts.append(context)
            return context
        finally:
            entry.making -= 1
            async with self._freed:
                self._freed.notify_all()  # waiters look again (also when the load failed)

    def reserved_mb(self) -> int:
        """Memory reserved outside llama.cpp (image children), in MB."""
        return sum(self._reserved.values())

    async def reserve(self, key: str, memory_mb: int) -> None:
        """Count ``memory_mb`` spent outside llama.cpp under ``key`` against the budget,
        unloading idle models first to make room for it (a busy one stays: then the budget is
        crossed, and logged, rather than a job cut off)."""
        self._reserved.pop(key, None)
        await self._make_room(memory_mb, exclude="")
        self._reserved[key] = memory_mb

    def release(self, key: str) -> None:
        """``key``'s reservation is over."""
        self._reserved.pop(key, None)

    async def _make_room(self, need_mb: int, *, exclude: str) -> None:
        residents = [
            Resident(name, entry.cost_mb, entry.last_used, entry.active > 0 or name == exclude)
            for name, entry in self._loaded.items()
        ]
        reserved = self.reserved_mb()
        for name in choose_evictions(residents, need_mb, self.budget_mb - reserved):
            await self.unload(name)
        used = sum(entry.cost_mb for entry in self._loaded.values()) + reserved
        if used + need_mb > self.budget_mb:
            log.warning("loading %d MB more goes over the %d MB model budget (%d MB in use by "
                        "busy models)", need_mb, self.budget_mb, used)

    async def unload(self, name: str) -> None:
        entry = self._loaded.pop(name, None)
        if entry is None:
            return
        contexts = [*entry.contexts, *([entry.embedder] if entry.embedder else [])]
        for context in contexts:
            await self._run(_close_when_idle, context)
        log.info("unloaded %s", name)

    async def unload_idle(self) -> list[str]:
        """Unload every model no job is using now (a model group's member makes room for the
        layers it serves, issue 19); a model busy with a job stays. Returns what went."""
        idle = [name for name, entry in self._loaded.items() if entry.active == 0]
        for name in idle:
            await self.unload(name)
        return idle

    # --- serving ------------------------------------------------------------------------------

    async def _acquire(self, name: str) -> tuple[_Loaded, EngineContext]:
        """A free chat context of ``name``, counted as active (so it is never evicted)."""
        entry = await self._entry(name)
        entry.active += 1
        try:
            while True:
                for context in entry.contexts:
                    if context.busy.acquire(blocking=False):
                        return entry, context
                if len(entry.contexts) + entry.making < self.context_limit(name):
                    return entry, await self._add_context(entry, take=True)
                async with self._freed:
                    await self._freed.wait()
        except BaseException:
            entry.active -= 1
            raise

    async def _release(self, entry: _Loaded, context: EngineContext) -> None:
        if not getattr(context, "alive", True):  # its engine child ended: the next job makes one
            if context in entry.contexts:
                entry.contexts.remove(context)
            await self._run(context.close)
        context.busy.release()
        entry.active -= 1
        entry.last_used = time.monotonic()
        async with self._freed:
            self._freed.notify_all()

    async def chat(
        self,
        name: str,
        request: dict[str, Any],
        cancel: threading.Event,
        on_chunk: Callable[[dict[str, Any]], Awaitable[None]],
        continuation: str | None = None,
        scope: str | None = None,
    ) -> dict[str, int]:
        """Generate a chat answer in a thread, awaiting ``on_chunk`` for every chunk; returns
        the usage. ``continuation``: assistant text to go on from (see ``LlamaContext.submit``);
        ``scope``: the queen's cache scope of the caller, whose cached prefixes it may reuse."""
        return await self._generate(name, "chat", request, cancel, on_chunk, continuation,
                                    scope)

    async def complete(
        self,
        name: str,
        request: dict[str, Any],
        cancel: threading.Event,
        on_chunk: Callable[[dict[str, Any]], Awaitable[None]],
        scope: str | None = None,
    ) -> dict[str, int]:
        """A ``/v1/completions`` job (raw prompts, no chat template), as ``chat``."""
        return await self._generate(name, "completion", request, cancel, on_chunk, None, scope)

    async def score(self, name: str, job: ScoreRequest,
                    cancel: threading.Event) -> Score | None:
        """Score a delivered answer on a free chat context of ``name`` in a thread (one
        teacher-forced pass, see ``engine.scoring``); ``None`` if cancelled."""
        entry, context = await self._acquire(name)
        try:
            done = asyncio.get_running_loop().run_in_executor(
                self._executor, context.score, job, cancel)
            try:
                return await asyncio.shield(done)
            except asyncio.CancelledError:
                cancel.set()  # stop the thread (between decodes) before the context goes back
                await asyncio.wait([done])
                raise
        finally:
            await self._release(entry, context)

    async def _generate(
        self,
        name: str,
        kind: str,
        request: dict[str, Any],
        cancel: threading.Event,
        on_chunk: Callable[[dict[str, Any]], Awaitable[None]],
        continuation: str | None,
        scope: str | None = None,
    ) -> dict[str, int]:
        entry, context = await self._acquire(name)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        extra = {"scope": scope} if scope is not None else {}

        def generate() -> dict[str, int]:
            try:
                for chunk in context.stream(kind, request, cancel, continuation, **extra):
                    loop.call_soon_threadsafe(queue.put_nowait, chunk)
                return context.usage()
            finally:
                loop.call_soon_threadsafe(queue.put_nowait, _END)

        try:
            done = loop.run_in_executor(self._executor, generate)
            try:
                while (item := await queue.get()) is not _END:
                    await on_chunk(item)
            except BaseException:
                cancel.set()  # stop the thread before giving the context back
                raise
            finally:
                usage = await asyncio.shield(done)
            return usage
        finally:
            await self._release(entry, context)

    async def embed(
        self, name: str, inputs: list[str] | list[list[int]]
    ) -> tuple[list[list[float]], int]:
        """One vector per input (texts, or token-id lists) and the tokens read."""
        entry = await self._entry(name)
        entry.active += 1
        try:
            if entry.embedder is None:
                entry.embedder = await self._new_context(entry, embedding=True)
            embedder = entry.embedder
            while not embedder.busy.acquire(blocking=False):
                async with self._freed:
                    await self._freed.wait()
            try:
                return await self._run(embedder.embed, inputs)
            finally:
                if not getattr(embedder, "alive", True) and entry.embedder is embedder:
                    entry.embedder = None  # its child ended: the next input makes another
                    await self._run(embedder.close)
                embedder.busy.release()
        finally:
            entry.active -= 1
            entry.last_used = time.monotonic()
            async with self._freed:
                self._freed.notify_all()

    async def close(self) -> None:
        """Unload every model, each context once its generation in flight has ended."""
        for name in list(self._loaded):
            await self.unload(name)
        self._executor.shutdown(wait=False, cancel_futures=True)


def _close_when_idle(context: EngineContext) -> None:
    """Free a context, but only once no generation is using it: freeing llama.cpp's memory
    under a running generation crashes the process. A job being stopped ends within a token.
    A batched context is idle once every one of its slots is back."""
    slots = int(getattr(context, "jobs_at_once", 1))  # the permits its ``busy`` holds
    for _ in range(slots):
        context.busy.acquire()
    try:
        context.close()
    finally:
        for _ in range(slots):
            context.busy.release()
