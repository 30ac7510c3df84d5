"""The queen's ``fetch`` commands (issue 17): download exactly the file the queen pinned, check
it, load it, and say so. A fetch for a model group (``Fetch.group``, issue 19) is downloaded and
checked but not loaded: the model does not fit this worker alone, and the group's head process
loads it across the members once the queen forms the group.

One fetch per model at a time: a second ``fetch`` for a model already under way is ignored (the
queen may send one again after a reconnect). Progress goes into the worker's ``status``
(``downloads``), sent as it moves; the model appears in the status's ``models`` once it is
loaded. A fetch that fails is reported as ``FetchFailed`` with a code the queen acts on (it
tries another worker): ``disk_full``, ``sha256_mismatch``, ``hub_error``, ``memory``,
``load_failed``, ``cancelled``. Downloads run in a thread; nothing here blocks the loop.

The volunteer's disk (issue 34): a fetch whose size (``Fetch.size_bytes``) does not fit under
the quota and in the free disk less its headroom is refused as ``disk_full`` before anything is
asked of the hub; one whose download would cross the headroom midway stops, its partial file is
deleted, and it fails as ``disk_full`` too (``ModelStore.pull``).

Image models (issue 38): a fetch of ``kind`` ``image`` is for the image engine, which only a
worker whose owner turned images on runs; any other worker refuses it as ``no_images`` before
anything is asked of the hub. Its file must read as a diffusion model (else it is deleted again
and the fetch fails as ``wrong_kind``: the image child could not load it), and it is kept for
the image child, which loads it on its first job, never loaded into llama.cpp.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from desktop_worker.engine.pool import ModelPool
from desktop_worker.errors import (
    ChecksumMismatch,
    DownloadCancelled,
    EngineError,
    InsufficientDisk,
    ModelStoreError,
)
from desktop_worker.link.client import FetchReport
from desktop_worker.store import ModelStore
from desktop_worker.store.progress import PullProgress
from shared_schema import DownloadProgress, Fetch, FetchFailed

__all__ = ["Fetcher", "failure_code"]

log = logging.getLogger(__name__)


def failure_code(exc: BaseException) -> str:
    """The ``FetchFailed.code`` for what stopped a fetch."""
    if isinstance(exc, InsufficientDisk):
        return "disk_full"
    if isinstance(exc, ChecksumMismatch):
        return "sha256_mismatch"
    if isinstance(exc, DownloadCancelled):
        return "cancelled"
    if isinstance(exc, EngineError):
        return "load_failed"
    if isinstance(exc, WrongKind):
        return "wrong_kind"
    return "hub_error"


class WrongKind(ModelStoreError):
    """A fetch for the image engine whose file is no diffusion model."""


@dataclass
class _Fetching:
    fetch: Fetch
    cancel: threading.Event
    progress: PullProgress | None = None


class Fetcher:
    """Runs the queen's fetches against the worker's store and pool."""

    def __init__(
        self,
        store: ModelStore,
        pool: ModelPool,
        *,
        evict: Callable[[], bool],
        changed: Callable[[], None],
        images: Callable[[], bool] = lambda: False,
    ) -> None:
        """``evict``: whether a fetch may evict models to make room (the owner's
        ``swarm_models``); ``changed`` is called whenever the status should go out now;
        ``images``: whether this worker runs an image engine (fetches of image models)."""
        self.store = store
        self.pool = pool
        self.evict = evict
        self.images = images
        self.changed = changed
        self._under_way: dict[str, _Fetching] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def downloads(self) -> list[DownloadProgress]:
        """The fetches under way, as the status reports them."""
        out = []
        for entry in self._under_way.values():
            if entry.progress is not None:
                out.append(entry.progress.to_wire())
            else:
                out.append(DownloadProgress(name=entry.fetch.name, downloaded_bytes=0,
                                            total_bytes=entry.fetch.size_bytes))
        return out

    def start(self, fetch: Fetch, report: FetchReport) -> None:
        if fetch.name in self._under_way:
            log.info("the queen asked for %s again; its fetch is already under way", fetch.name)
            return
        if fetch.kind == "image" and not self.images():
            log.warning("the queen asked for %s, an image model, but images are off here",
                        fetch.name)
            self._report(report, FetchFailed(
                name=fetch.name, code="no_images",
                message="This worker makes no images (its owner has not turned images on)."))
            return
        entry = _Fetching(fetch, threading.Event())
        self._under_way[fetch.name] = entry
        task = asyncio.get_running_loop().create_task(self._run(entry, report))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        self.changed()

    def _report(self, report: FetchReport, failure: FetchFailed) -> None:
        task = asyncio.get_running_loop().create_task(report(failure))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Cancel the fetches under way (their partial downloads stay, to resume later)."""
        for entry in self._under_way.values():
            entry.cancel.set()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=10)

    async def _run(self, entry: _Fetching, report: FetchReport) -> None:
        fetch = entry.fetch
        loop = asyncio.get_running_loop()

        def progress(update: PullProgress) -> None:  # on the download thread
            entry.progress = update
            loop.call_soon_threadsafe(self.changed)

        log.info("the queen asked this worker to fetch %s (%s, %.0f MB)", fetch.name,
                 ", ".join(fetch.paths), fetch.size_bytes / 2**20)
        protect, evict = self.pool.loaded(), self.evict()
        try:
            await asyncio.to_thread(self.store.check_room, fetch.name, fetch.size_bytes,
                                    fetch.paths, protect=protect, evict=evict)
            pulled = await asyncio.to_thread(
                self.store.pull, fetch.name, progress, entry.cancel,
                protect=protect, revision=fetch.revision,
                expect_sha256=fetch.sha256, evict=evict)
            if fetch.kind == "image" and not pulled.info.is_diffusion:
                await asyncio.to_thread(self.store.remove, fetch.name)
                raise WrongKind(f"{fetch.name} was fetched for the image engine, but its file "
                                "is no diffusion model; it was deleted again")
            if pulled.info.is_diffusion:  # issue 38: its image child loads it on its first job
                log.info("fetched %s, a diffusion model (not loaded into llama.cpp)",
                         fetch.name)
            elif fetch.group:  # too big for this worker alone: the group's head process loads it
                log.info("fetched %s to lead a model group with it", fetch.name)
            else:
                plan = await self.pool.load(fetch.name)
                log.info("fetched and loaded %s (%s)", fetch.name, plan.reason)
        except (ModelStoreError, EngineError) as exc:
            code = failure_code(exc)
            log.warning("could not fetch %s for the queen (%s): %s", fetch.name, code, exc)
            await report(FetchFailed(name=fetch.name, code=code, message=str(exc)[:2000]))
        except Exception as exc:  # a fetch must never take the worker down
            log.exception("fetching %s failed", fetch.name)
            await report(FetchFailed(name=fetch.name, code="load_failed",
                                     message=f"{type(exc).__name__}: {exc}"[:2000]))
        finally:
            self._under_way.pop(fetch.name, None)
            self.changed()
