"""The worker's model store: GGUF models on disk, pulled from the hub or imported, with an index.

Layout under ``root``::

    index.json                        what is here (written atomically)
    hub/<user>/<repo>/<path in repo>  pulled files; partial downloads sit beside them as
                                      <file>.<etag-hash>.incomplete until they finish
    imported/<name-slug>/<file name>  imported files

A model in the index is served without any network access. Everything blocks; the caller runs
it in a thread. Methods may be called from several threads at once.

The disk's headroom (issue 34, ``disk.py``) is never crossed: a pull is refused before its first
byte when what is left to download does not fit in the free space minus the headroom (and minus
what other downloads under way will still write), and a download re-reads the free space as it
runs and stops, deleting its partial file, once finishing would cross it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath
from typing import Any, Literal, Protocol

from desktop_worker.errors import (
    ChecksumMismatch,
    InsufficientDisk,
    InvalidModelFile,
    InvalidModelName,
    ModelNotCached,
)
from desktop_worker.store.disk import (
    CHECK_INTERVAL_S,
    CHECK_STEP_BYTES,
    DiskGuard,
    DiskProbe,
    default_quota_gb,
    fmt_bytes,
)
from desktop_worker.store.gguf_info import GgufInfo, split_paths
from desktop_worker.store.hub import HubClient, discard_partials, local_bytes
from desktop_worker.store.index import IndexFile
from desktop_worker.store.model_info import read_model_info
from desktop_worker.store.names import (
    check_repo_path,
    parse_model_name,
    resolve_filter,
    validate_local_name,
)
from desktop_worker.store.progress import ProgressCallback, ProgressMeter
from shared_schema.hardware import ModelDescriptor

__all__ = ["LocalModel", "ModelStore", "PullPlan", "Source"]

logger = logging.getLogger(__name__)

Source = Literal["hub", "import"]
_COPY_CHUNK = 1 << 20


@dataclass(frozen=True)
class LocalModel:
    """A model in the store. ``path`` is the file to load (the first part of a split model)."""

    name: str
    path: Path
    paths: tuple[Path, ...]
    size_bytes: int
    sha256: str
    info: GgufInfo
    source: Source
    added: float
    last_used: float
    origin: str | None = None

    def descriptor(self, loaded: bool = False) -> ModelDescriptor:
        """The model as the worker announces it to the queen."""
        return ModelDescriptor(
            name=self.name,
            file_name=self.path.name,
            size_bytes=self.size_bytes,
            sha256=self.sha256,
            parameter_count=self.info.parameter_count,
            quant=self.info.quant,
            context_length=self.info.context_length,
            loaded=loaded,
            kind="image" if self.info.is_diffusion else "text",
        )


@dataclass(frozen=True)
class PullPlan:
    """What pulling a model would take, known before a byte is downloaded.

    ``problem`` says why it cannot be stored (the quota, the free disk), else it is None.
    ``cached`` is True when the model is here already.
    """

    name: str
    files: tuple[str, ...]
    total_bytes: int
    on_disk_bytes: int
    free_bytes: int
    cached: bool = False
    problem: str | None = None


class ModelStore:
    """GGUF models under ``root``, with an optional size quota kept by LRU eviction, never
    filling the disk past its headroom.

    ``endpoint`` and ``token`` go to the hub client (defaults: ``HF_ENDPOINT``, ``HF_TOKEN``).
    ``headroom_bytes`` is what the store leaves free on its disk (None: 10 % of the disk,
    10-50 GB, ``disk.default_headroom_bytes``). A download re-reads the free disk every
    ``disk_check_bytes`` or ``disk_check_s``, whichever comes first (``self.disk``, a
    ``DiskGuard``, keeps that account). ``hub``, ``disk`` (a ``DiskProbe``) and ``clock``
    replace the hub client, the disk readings and the time source (tests).
    """

    def __init__(
        self,
        root: Path,
        *,
        quota_bytes: int | None = None,
        headroom_bytes: int | None = None,
        endpoint: str | None = None,
        token: str | None = None,
        hub: HubClient | None = None,
        disk: DiskProbe | None = None,
        disk_check_bytes: int = CHECK_STEP_BYTES,
        disk_check_s: float = CHECK_INTERVAL_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.root = Path(root)
        self.quota_bytes = quota_bytes
        self.hub = hub or HubClient(endpoint=endpoint, token=token)
        self.hub_dir = self.root / "hub"
        self.import_dir = self.root / "imported"
        self.disk = DiskGuard(self.root, disk, headroom_bytes, check_step_bytes=disk_check_bytes,
                              check_interval_s=disk_check_s)
        self._clock = clock
        self._lock = threading.RLock()
        self._name_locks: dict[str, threading.Lock] = {}
        self._reserved = 0
        self.root.mkdir(parents=True, exist_ok=True)
        self._index = IndexFile(self.root / "index.json")
        self._models = self._load()

    # --- reading -----------------------------------------------------------------------------

    def list(self) -> list[LocalModel]:
        """Every model in the store, by name."""
        with self._lock:
            return sorted(self._models.values(), key=lambda m: m.name)

    def __contains__(self, name: object) -> bool:
        with self._lock:
            return name in self._models

    @property
    def used_bytes(self) -> int:
        """Bytes held by the models in the store."""
        with self._lock:
            return sum(m.size_bytes for m in self._models.values())

    def get(self, name: str) -> LocalModel:
        """The named model (its ``last_used`` set to now); ``ModelNotCached`` if it is not here."""
        model = self._touch(name)
        if model is None:
            raise ModelNotCached(f"{name} is not in the model store; pull or import it first")
        return model

    def descriptors(self, loaded: Collection[str] = frozenset()) -> list[ModelDescriptor]:
        """Every stored model as announced to the queen, marked loaded if named in ``loaded``."""
        return [m.descriptor(m.name in loaded) for m in self.list()]

    def plan_pull(self, name: str) -> PullPlan:
        """Check a pull before downloading: list the repo, pick the file, and check the quota,
        the free disk and its headroom. Raises what ``pull`` would for a bad name, repo or
        filter."""
        with self._lock:
            cached = self._models.get(name)
        if cached is not None:
            return PullPlan(name, (cached.path.name,), cached.size_bytes, cached.size_bytes,
                            self.disk.usage().free_bytes, cached=True)
        parsed = parse_model_name(name)
        listing = self.hub.list_files(parsed.repo_id)
        resolved = resolve_filter(listing.paths(), parsed.filter)
        total = sum(listing.file(p).size or 0 for p in resolved.paths)
        on_disk = sum(local_bytes(self._hub_path(parsed.repo_id, p)) for p in resolved.paths)
        with self._lock:
            usage = self.disk.usage()
            try:
                victims = self._plan_eviction(name, total, set())
            except InsufficientDisk as exc:
                problem: str | None = str(exc)
            else:
                problem = self.disk.problem(name, total, on_disk,
                                            sum(v.size_bytes for v in victims), usage)
        return PullPlan(name, tuple(resolved.paths), total, on_disk, usage.free_bytes,
                        problem=problem)

    def check_room(
        self,
        name: str,
        size_bytes: int,
        paths: Sequence[str] = (),
        *,
        protect: Collection[str] = frozenset(),
        evict: bool = True,
    ) -> None:
        """Refuse a model of ``size_bytes`` before anything is asked of the hub: raises
        ``InsufficientDisk`` when it would not fit under the quota or in the free disk less
        its headroom (``paths``: its files in the repo, whose partial downloads count as
        downloaded already). A model already stored passes: ``pull`` decides about it."""
        with self._lock:
            if name in self._models:
                return
        repo_id = parse_model_name(name).repo_id
        on_disk = sum(local_bytes(self._hub_path(repo_id, p)) for p in paths)
        with self._lock:
            keep = set(self._models) if not evict else set(protect)
            victims = self._plan_eviction(name, size_bytes, keep)
            problem = self.disk.problem(name, size_bytes, on_disk,
                                        sum(v.size_bytes for v in victims))
        if problem is not None:
            raise InsufficientDisk(problem)

    def room_bytes(self, protect: Collection[str] = frozenset(), *, evict: bool = True) -> int:
        """Room for one more model: the free disk less its headroom and what downloads under
        way will still write, and what the quota leaves, the smaller, counting the models that
        could be evicted for it (none without ``evict``; never those in ``protect``, such as
        the loaded ones). The worker's status says this (``model_room_mb``), so the queen
        never plans a fetch the worker would refuse."""
        with self._lock:
            evictable = 0 if not evict else sum(
                m.size_bytes for m in self._models.values() if m.name not in protect)
            free = self.disk.room_bytes() + evictable
            if self.quota_bytes is None:
                return max(free, 0)
            used = sum(m.size_bytes for m in self._models.values()) + self._reserved
            return max(min(free, self.quota_bytes - used + evictable), 0)

    # --- adding ------------------------------------------------------------------------------

    def pull(
        self,
        name: str,
        progress: ProgressCallback | None = None,
        cancel: threading.Event | None = None,
        *,
        protect: Collection[str] = frozenset(),
        revision: str | None = None,
        expect_sha256: str | None = None,
        evict: bool = True,
    ) -> LocalModel:
        """The named model, downloaded from the hub first unless it is already here.

        A stored model comes back at once, with no network access. Otherwise: list the repo,
        pick the file with the filter, make room (LRU eviction under the quota, never evicting
        a name in ``protect``), check the free disk, download (resuming any partial download),
        check the sha256 and the GGUF header, record. ``progress`` gets ``PullProgress`` reports;
        setting ``cancel`` raises ``DownloadCancelled`` and keeps the partial files. The disk's
        headroom is checked before the first byte and again as bytes arrive: ``InsufficientDisk``
        (the partial files deleted) when the download would cross it.

        The queen's ``fetch`` (issue 17) names the commit (``revision``) and the sha256 of the
        file it pinned (``expect_sha256``): a stored copy of the name holding another file is
        replaced, and a file whose sha256 differs is refused (``ChecksumMismatch``). Without
        ``evict``, nothing is evicted to make room (the owner did not let the swarm choose its
        models): ``InsufficientDisk`` when the quota has no room left.
        """
        with self._name_lock(name):
            cached = self._touch(name)
            if cached is not None and expect_sha256 in (None, cached.sha256):
                return cached
            parsed = parse_model_name(name)
            listing = self.hub.list_files(parsed.repo_id, revision)
            resolved = resolve_filter(listing.paths(), parsed.filter)
            remotes = [listing.file(p) for p in resolved.paths]
            if expect_sha256 is not None and remotes[0].sha256 != expect_sha256:
                raise ChecksumMismatch(
                    f"{name}: {parsed.repo_id} at {listing.commit[:12]} holds "
                    f"{resolved.first} with sha256 {remotes[0].sha256}, not the {expect_sha256} "
                    "the queen named")
            if not evict:
                protect = {m.name for m in self.list()}
            dests = [self._hub_path(parsed.repo_id, p) for p in resolved.paths]
            sizes = [r.size for r in remotes]
            total = sum(s for s in sizes if s is not None)
            logger.info("pulling %s: %s (%d bytes)", name, resolved.label, total)
            meter = ProgressMeter(name, None if None in sizes else total, progress)
            if cached is not None:  # another file under this name: the named one replaces it
                protect = set(protect) - {name}
            with self._room(name, total, sum(local_bytes(d) for d in dests), protect) as token:
                watch = self.disk.watch(name, token, total)

                def on_disk(n: int) -> None:
                    meter.update(n)
                    watch(n)

                done = 0
                first_sha = ""
                try:
                    for i, (remote, dest) in enumerate(zip(remotes, dests, strict=True)):
                        later = sum(local_bytes(d) for d in dests[i + 1 :])
                        on_disk(done + local_bytes(dest) + later)
                        result = self.hub.download(
                            parsed.repo_id,
                            remote,
                            dest,
                            revision=listing.commit,
                            on_bytes=lambda n, base=done, rest=later: on_disk(base + n + rest),
                            cancel=cancel,
                        )
                        done += result.size
                        first_sha = first_sha or result.sha256
                except InsufficientDisk:
                    self._discard_download(dests)
                    raise
                if expect_sha256 is not None and first_sha != expect_sha256:
                    dests[0].unlink(missing_ok=True)
                    raise ChecksumMismatch(
                        f"{name}: the file downloaded has sha256 {first_sha}, not the "
                        f"{expect_sha256} the queen named; it was deleted")
                info = self._checked_info(name, dests)
                now = self._clock()
                model = LocalModel(
                    name=name,
                    path=dests[0],
                    paths=tuple(dests),
                    size_bytes=done,
                    sha256=first_sha,
                    info=info,
                    source="hub",
                    added=now,
                    last_used=now,
                    origin=f"{parsed.repo_id}@{listing.commit}:{resolved.first}",
                )
                self._put(model)
                if cached is not None and set(cached.paths) != set(dests):
                    with self._lock:
                        self._delete_files(cached)
            meter.finish()
            logger.info("pulled %s (%d bytes)", name, done)
            return model

    def import_file(
        self, path: Path, name: str, *, protect: Collection[str] = frozenset()
    ) -> LocalModel:
        """Copy a local GGUF file (all parts, for a split model) into the store under ``name``."""
        validate_local_name(name)
        source = Path(path)
        if not source.is_file():
            raise InvalidModelFile(f"{source} is not a file")
        read_model_info(source)  # refuse anything but a model file before copying
        parts = split_paths(source)
        missing = [p.name for p in parts if not p.is_file()]
        if missing:
            raise InvalidModelFile(f"{source.name} is a split model; missing: {', '.join(missing)}")
        with self._name_lock(name):
            with self._lock:
                if name in self._models:
                    raise InvalidModelName(f"a model named {name!r} is already in the store")
            size = sum(p.stat().st_size for p in parts)
            folder = self.import_dir / _slug(name)
            with self._room(name, size, 0, protect):
                folder.mkdir(parents=True, exist_ok=True)
                dests = [folder / p.name for p in parts]
                digests = [_copy_hashing(src, dst) for src, dst in zip(parts, dests, strict=True)]
                info = self._checked_info(name, dests)
                now = self._clock()
                model = LocalModel(
                    name=name,
                    path=dests[0],
                    paths=tuple(dests),
                    size_bytes=size,
                    sha256=digests[0],
                    info=info,
                    source="import",
                    added=now,
                    last_used=now,
                    origin=str(source.resolve()),
                )
                self._put(model)
            logger.info("imported %s as %s (%d bytes)", source, name, size)
            return model

    # --- removing ----------------------------------------------------------------------------

    def remove(self, name: str) -> None:
        """Forget the named model and delete its files; ``ModelNotCached`` if it is not here."""
        with self._lock:
            model = self._models.pop(name, None)
            if model is None:
                raise ModelNotCached(f"{name} is not in the model store")
            self._delete_files(model)
            self._save()
        logger.info("removed %s", name)

    # --- internals ---------------------------------------------------------------------------

    def _name_lock(self, name: str) -> threading.Lock:
        with self._lock:
            return self._name_locks.setdefault(name, threading.Lock())

    def _touch(self, name: str) -> LocalModel | None:
        with self._lock:
            model = self._models.get(name)
            if model is None:
                return None
            if not all(p.is_file() for p in model.paths):
                logger.warning("%s: its files are gone from %s; forgetting it", name, self.root)
                del self._models[name]
                self._save()
                return None
            model = replace(model, last_used=self._clock())
            self._models[name] = model
            self._save()
            return model

    def _put(self, model: LocalModel) -> None:
        with self._lock:
            self._models[model.name] = model
            self._save()

    @contextmanager
    def _room(
        self, name: str, needed: int, on_disk: int, protect: Collection[str]
    ) -> Iterator[int]:
        """Reserve ``needed`` bytes: evict under the quota, check the disk and its headroom, or
        raise. Yields the reservation's token on the disk (for ``DiskGuard.watch``)."""
        with self._lock:
            victims = self._plan_eviction(name, needed, set(protect))
            problem = self.disk.problem(name, needed, on_disk, sum(v.size_bytes for v in victims))
            if problem is not None:
                raise InsufficientDisk(problem)
            for victim in victims:
                logger.info("evicting %s (least recently used) for %s", victim.name, name)
                del self._models[victim.name]
                self._delete_files(victim)
            if victims:
                self._save()
            self._reserved += needed
            token = self.disk.reserve(needed - on_disk)
        try:
            yield token
        finally:
            with self._lock:
                self._reserved -= needed
            self.disk.release(token)

    def _discard_download(self, dests: Sequence[Path]) -> None:
        """Delete what a stopped download wrote: its partial files, and finished parts that no
        stored model holds."""
        with self._lock:
            held = {p for m in self._models.values() for p in m.paths}
        for dest in dests:
            freed = discard_partials(dest)
            if dest not in held and dest.is_file():
                freed += dest.stat().st_size
                dest.unlink(missing_ok=True)
            if freed:
                logger.info("deleted %d bytes of the stopped download of %s", freed, dest.name)
            self._prune_dirs(dest.parent)

    def _plan_eviction(self, name: str, needed: int, protect: set[str]) -> list[LocalModel]:
        quota = self.quota_bytes
        if quota is None:
            return []
        if needed > quota:
            raise InsufficientDisk(
                f"{name} ({fmt_bytes(needed)}) is larger than the model store quota "
                f"({fmt_bytes(quota)})"
            )
        used = sum(m.size_bytes for m in self._models.values()) + self._reserved
        victims: list[LocalModel] = []
        for model in sorted(self._models.values(), key=lambda m: (m.last_used, m.added)):
            if used + needed <= quota:
                break
            if model.name in protect:
                continue
            victims.append(model)
            used -= model.size_bytes
        if used + needed > quota:
            held = sorted(m.name for m in self._models.values() if m.name in protect)
            raise InsufficientDisk(
                f"{name} ({fmt_bytes(needed)}) does not fit under the quota of "
                f"{fmt_bytes(quota)}: "
                f"{fmt_bytes(used)} stays in use"
                + (f" by models that may not be evicted ({', '.join(held)})" if held else "")
            )
        return victims

    def _checked_info(self, name: str, paths: Sequence[Path]) -> GgufInfo:
        try:
            return read_model_info(paths[0])
        except InvalidModelFile as exc:
            for path in paths:
                path.unlink(missing_ok=True)
            raise InvalidModelFile(f"{name} is not a usable model file: {exc}") from exc

    def _hub_path(self, repo_id: str, path_in_repo: str) -> Path:
        """Where a hub file goes; the path is checked first (``check_repo_path``: POSIX and
        Windows rules on every OS), since it comes from the hub's listing."""
        parts = check_repo_path(path_in_repo, repo_id)
        return self.hub_dir.joinpath(*repo_id.split("/"), *parts)

    def _delete_files(self, model: LocalModel) -> None:
        shared = {p for m in self._models.values() if m.name != model.name for p in m.paths}
        for path in model.paths:
            if path in shared:
                continue
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:
                logger.warning("could not delete %s: %s", path, exc)
        for path in model.paths:
            self._prune_dirs(path.parent)

    def _prune_dirs(self, folder: Path) -> None:
        stops = {self.root, self.hub_dir, self.import_dir}
        while folder not in stops and self.root in folder.parents:
            try:
                folder.rmdir()
            except OSError:
                return
            folder = folder.parent

    def _load(self) -> dict[str, LocalModel]:
        models: dict[str, LocalModel] = {}
        dropped = False
        for name, record in self._index.load().items():
            try:
                model = self._from_record(name, record)
            except (KeyError, TypeError, ValueError) as exc:
                logger.warning("model index: skipping %s (%s)", name, exc)
                dropped = True
                continue
            if not all(p.is_file() for p in model.paths):
                logger.warning("model index: %s has files missing; forgetting it", name)
                dropped = True
                continue
            models[name] = model
        if dropped:
            self._index.save({n: self._to_record(m) for n, m in models.items()})
        return models

    def _save(self) -> None:
        self._index.save({n: self._to_record(m) for n, m in self._models.items()})

    def _to_record(self, model: LocalModel) -> dict[str, Any]:
        return {
            "paths": [self._rel(p) for p in model.paths],
            "size_bytes": model.size_bytes,
            "sha256": model.sha256,
            "info": model.info.to_dict(),
            "source": model.source,
            "added": model.added,
            "last_used": model.last_used,
            "origin": model.origin,
        }

    def _from_record(self, name: str, record: dict[str, Any]) -> LocalModel:
        paths = tuple(self._abs(p) for p in record["paths"])
        if not paths:
            raise ValueError("no files")
        source = record["source"]
        if source not in ("hub", "import"):
            raise ValueError(f"unknown source {source!r}")
        return LocalModel(
            name=name,
            path=paths[0],
            paths=paths,
            size_bytes=int(record["size_bytes"]),
            sha256=str(record["sha256"]),
            info=GgufInfo.from_dict(record["info"]),
            source=source,
            added=float(record["added"]),
            last_used=float(record["last_used"]),
            origin=record.get("origin"),
        )

    def _rel(self, path: Path) -> str:
        try:
            return path.relative_to(self.root).as_posix()
        except ValueError:
            return str(path)

    def _abs(self, text: str) -> Path:
        path = Path(text)
        return path if path.is_absolute() else self.root.joinpath(*PurePosixPath(text).parts)


def _slug(name: str) -> str:
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._")[:80] or "model"
    return f"{cleaned}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"


def _copy_hashing(source: Path, dest: Path) -> str:
    """Copy ``source`` to ``dest`` (through a temporary file) and return its sha256."""
    digest = hashlib.sha256()
    tmp = dest.with_name(dest.name + ".importing")
    try:
        with source.open("rb") as src, tmp.open("wb") as out:
            while chunk := src.read(_COPY_CHUNK):
                digest.update(chunk)
                out.write(chunk)
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return digest.hexdigest()




class StoreSettings(Protocol):
    """What ``store_for`` reads of the owner's settings (``WorkerSettings``)."""

    models_dir: Path
    disk_quota_gb: float | None
    hf_endpoint: str | None

    @property
    def disk_headroom_bytes(self) -> int | None: ...


def store_for(settings: StoreSettings, *, disk: DiskProbe | None = None) -> ModelStore:
    """The model store the owner's settings describe (the worker, the app's Models tab and
    ``apiary-worker models`` all open it this way): its headroom, and its quota. A quota the
    owner has not chosen yet (the app saves one at its first run) is half of what the store
    could ever hold now, its free disk plus what it already holds, so it does not shrink as
    the store fills; 0 is no quota."""
    store = ModelStore(settings.models_dir, headroom_bytes=settings.disk_headroom_bytes,
                       endpoint=settings.hf_endpoint, disk=disk)
    quota_gb = settings.disk_quota_gb
    if quota_gb is None:
        free = store.disk.usage().free_bytes
        quota_gb = default_quota_gb(free + store.used_bytes)
        logger.debug("no disk quota chosen: %.0f GB, half of what the store could hold",
                     quota_gb)
    store.quota_bytes = int(quota_gb * 1024**3) if quota_gb else None
    return store
