"""Fine-tuned models served on this worker (issue 37): a job whose ``Job.adapter`` names an
``ft:`` model runs on its base plus the LoRA adapter the queen stores.

``AdapterCache`` keeps the adapter files, by sha256, under ``<models_dir>/adapters``
(``<sha256>.gguf``): each read once from the queen's origin with the job's token (the
training jobs' ``transfer_url`` and ``Transfers``: no redirects, streamed, stopped past its
size, its sha256 checked), written as ``<sha256>.part`` and renamed when whole, so a
``.gguf`` there is always a checked one. Several jobs asking for one sha256 at once share one
download. A file counts against the owner's disk quota as training files do (``store_room``);
past the cache's bounds (``max_bytes``, ``max_count``), or to make room under the quota, the
least recently used files no job is using go (``choose_adapter_evictions``, pure), and
``on_evict`` hears of each (the names served with it are forgotten).

``FineTunedModels`` ties the cache to the engine's pool: for the length of a job it holds the
adapter's file (``serve``) and registers the ``ft:`` name with the pool once per name and
sha256 (``ModelPool.register_adapter``, which checks the adapter against the base). Failures
are ``AdapterFailed`` with the ``JobError``'s code: a transfer or the disk retryable, an
adapter the engine's check refuses (``invalid_adapter``) not, and that sha256 is refused from
then on without another download.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import httpx

from desktop_worker.errors import AdapterFailed, InvalidAdapter, TrainJobFailed
from desktop_worker.training_jobs import RoomBytes, Transfers, transfer_client, transfer_url
from shared_schema.training import AdapterRef

log = logging.getLogger(__name__)

ADAPTERS_DIR = "adapters"  # under the model store
MAX_REFUSED = 1024  # sha256s of adapters the check refused, remembered
_CACHED = re.compile(r"^([0-9a-f]{64})\.gguf$")


@dataclass(slots=True)
class CachedAdapter:
    """One adapter file in the cache."""

    sha256: str
    size_bytes: int
    last_used: float


def choose_adapter_evictions(files: Sequence[CachedAdapter], *, incoming_bytes: int,
                             max_bytes: int, max_count: int, room_bytes: int | None,
                             in_use: Collection[str] = ()) -> list[str]:
    """The files to remove, least recently used first and never one ``in_use``, so that one
    more of ``incoming_bytes`` keeps the cache within ``max_count`` files and ``max_bytes``,
    and fits in ``room_bytes`` (what the disk and quota leave now; None: no bound; each file
    removed gives its bytes back). As many as help when not all can go."""
    count = len(files)
    held = sum(f.size_bytes for f in files)
    freed = 0
    chosen: list[str] = []
    for cached in sorted(files, key=lambda f: f.last_used):
        fits = (count + 1 <= max_count and held + incoming_bytes <= max_bytes
                and (room_bytes is None or incoming_bytes <= room_bytes + freed))
        if fits:
            break
        if cached.sha256 in in_use:
            continue
        chosen.append(cached.sha256)
        count -= 1
        held -= cached.size_bytes
        freed += cached.size_bytes
    return chosen


def _bytes(room: int | None, freed: int) -> str:
    return "no disk bound" if room is None else f"{room + freed:,} bytes"


def _failed(code: str, message: str, *, retryable: bool) -> AdapterFailed:
    return AdapterFailed(code, message, retryable=retryable)


class AdapterCache:
    """Adapter files by sha256 under ``folder``, fetched on demand (see the module)."""

    def __init__(self, folder: Path, *, max_bytes: int, max_count: int,
                 room_bytes: RoomBytes | None = None,
                 client: Callable[[], httpx.AsyncClient] | None = None,
                 on_evict: Callable[[str], Awaitable[None]] | None = None) -> None:
        self.folder = folder
        self.max_bytes = max_bytes
        self.max_count = max_count
        self.room_bytes = room_bytes
        self.client = client or transfer_client
        self.on_evict = on_evict
        self._files: dict[str, CachedAdapter] = {}
        self._users: dict[str, int] = {}  # sha256 -> jobs holding it now
        self._downloads: dict[str, asyncio.Task[Path]] = {}
        self._reserved = 0  # bytes of the downloads under way
        self._room = asyncio.Lock()  # one eviction-and-reservation at a time
        self._scanned = False

    @property
    def held_bytes(self) -> int:
        return sum(f.size_bytes for f in self._files.values())

    def cached(self) -> dict[str, int]:
        """The files held: sha256 -> bytes."""
        return {sha: f.size_bytes for sha, f in self._files.items()}

    def path(self, sha256: str) -> Path:
        return self.folder / f"{sha256}.gguf"

    def _scan(self) -> None:
        """Index what an earlier run left (whole files only; partial ones removed)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        for entry in self.folder.iterdir():
            match = _CACHED.match(entry.name)
            with contextlib.suppress(OSError):
                if match is None:
                    if entry.name.endswith(".part") and entry.is_file():
                        entry.unlink()
                    continue
                stat = entry.stat()
                self._files[match[1]] = CachedAdapter(match[1], stat.st_size, stat.st_mtime)

    @contextlib.asynccontextmanager
    async def lease(self, ref: AdapterRef, origin: str) -> AsyncIterator[Path]:
        """The adapter's local file, downloaded when it is not here, held (never evicted)
        until the block ends."""
        sha = ref.file.sha256
        self._users[sha] = self._users.get(sha, 0) + 1
        try:
            yield await self._local(ref, origin)
        finally:
            self._users[sha] -= 1
            if not self._users[sha]:
                del self._users[sha]

    async def _local(self, ref: AdapterRef, origin: str) -> Path:
        if not self._scanned:
            await asyncio.to_thread(self._scan)
            self._scanned = True
        sha = ref.file.sha256
        cached = self._files.get(sha)
        if cached is not None:
            cached.last_used = time.time()
            return self.path(sha)
        task = self._downloads.get(sha)
        if task is None:
            task = asyncio.create_task(self._download(ref, origin), name=f"adapter {sha[:12]}")
            self._downloads[sha] = task
            task.add_done_callback(lambda _t: self._downloads.pop(sha, None))
        return await asyncio.shield(task)  # a job stopped meanwhile leaves it to the others

    async def _download(self, ref: AdapterRef, origin: str) -> Path:
        sha, size = ref.file.sha256, ref.file.size_bytes
        try:
            transfer_url(origin, ref.file.url)
        except TrainJobFailed as exc:
            raise _failed("invalid_request", f"the adapter of {ref.name} is named at "
                          f"{ref.file.url[:200]!r}, which is not a path on the queen's origin",
                          retryable=False) from exc
        await self._make_room(size, ref.name)
        part = self.folder / f"{sha}.part"
        try:
            async with self.client() as client:
                await Transfers(client, origin, ref.token).download(
                    f"the adapter of {ref.name}", ref.file, part, threading.Event())
        except TrainJobFailed as exc:
            raise _failed(exc.code, str(exc), retryable=exc.retryable) from exc
        finally:
            self._reserved -= size
        final = self.path(sha)
        await asyncio.to_thread(os.replace, part, final)
        self._files[sha] = CachedAdapter(sha, size, time.time())
        log.info("fetched the adapter of %s (%s, %d bytes)", ref.name, sha[:12], size)
        return final

    async def _make_room(self, size_bytes: int, name: str) -> None:
        """Evict what must go for ``size_bytes`` more, and reserve them; ``AdapterFailed``
        (``insufficient_disk``, retryable) when it cannot fit."""
        async with self._room:
            held = self.held_bytes + self._reserved
            room = (await asyncio.to_thread(self.room_bytes, held)
                    if self.room_bytes is not None else None)
            files = list(self._files.values())
            gone = choose_adapter_evictions(
                files, incoming_bytes=size_bytes + self._reserved, max_bytes=self.max_bytes,
                max_count=self.max_count - len(self._downloads) + 1, room_bytes=room,
                in_use=self._users)
            for sha in gone:
                await self.remove(sha)
            freed = sum(f.size_bytes for f in files if f.sha256 in gone)
            if size_bytes > self.max_bytes or (room is not None and size_bytes > room + freed):
                raise _failed("insufficient_disk", f"the adapter of {name} ({size_bytes:,} "
                              f"bytes) does not fit in what the adapter cache, the disk quota "
                              f"and headroom leave ({_bytes(room, freed)})", retryable=True)
            self._reserved += size_bytes

    async def remove(self, sha256: str) -> None:
        """Delete a cached file; ``on_evict`` hears of it."""
        cached = self._files.pop(sha256, None)
        if cached is None:
            return
        await asyncio.to_thread(self.path(sha256).unlink, missing_ok=True)
        log.info("removed the adapter %s (%d bytes) from the cache", sha256[:12],
                 cached.size_bytes)
        if self.on_evict is not None:
            await self.on_evict(sha256)


class AdapterPool(Protocol):
    """What ``FineTunedModels`` needs of the engine's ``ModelPool``."""

    async def register_adapter(self, name: str, base_name: str, adapter_path: Path | str, *,
                               scale: float = 1.0) -> object: ...
    async def forget_adapter(self, name: str) -> None: ...


class FineTunedModels:
    """Serves ``ft:`` names on ``pool`` from ``cache`` (its ``on_evict`` is set here)."""

    def __init__(self, cache: AdapterCache, pool: AdapterPool) -> None:
        self.cache = cache
        self.pool = pool
        cache.on_evict = self._evicted
        self._registered: dict[str, tuple[str, str, float]] = {}  # name -> (sha, base, scale)
        self._refused: dict[str, str] = {}  # sha256 -> why the check refused it
        self._locks: dict[str, asyncio.Lock] = {}

    def registered(self) -> dict[str, str]:
        """The fine-tuned names registered now, each with its adapter's sha256."""
        return {name: sha for name, (sha, _, _) in self._registered.items()}

    @contextlib.asynccontextmanager
    async def serve(self, ref: AdapterRef, origin: str) -> AsyncIterator[str]:
        """Make ``ref.name`` servable on the pool for the block (it yields the name)."""
        sha = ref.file.sha256
        if sha in self._refused:
            raise _failed("invalid_adapter", self._refused[sha], retryable=False)
        async with self.cache.lease(ref, origin) as path:
            await self._register(ref, path)
            yield ref.name

    async def _register(self, ref: AdapterRef, path: Path) -> None:
        wanted = (ref.file.sha256, ref.base, ref.scale)
        lock = self._locks.setdefault(ref.name, asyncio.Lock())
        async with lock:
            if ref.file.sha256 in self._refused:  # refused while this job waited
                raise _failed("invalid_adapter", self._refused[ref.file.sha256],
                              retryable=False)
            if self._registered.get(ref.name) == wanted:
                return
            try:
                await self.pool.register_adapter(ref.name, ref.base, path, scale=ref.scale)
            except InvalidAdapter as exc:
                why = f"the adapter of {ref.name} cannot be served on {ref.base}: {exc}"
                if len(self._refused) >= MAX_REFUSED:
                    self._refused.pop(next(iter(self._refused)))
                self._refused[ref.file.sha256] = why
                self._registered.pop(ref.name, None)
                await self.cache.remove(ref.file.sha256)
                raise _failed("invalid_adapter", why, retryable=False) from exc
            self._registered[ref.name] = wanted

    async def _evicted(self, sha256: str) -> None:
        for name in [n for n, (sha, _, _) in self._registered.items() if sha == sha256]:
            del self._registered[name]
            await self.pool.forget_adapter(name)
