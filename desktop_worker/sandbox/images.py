"""Rendering images in sandboxed engine children (issue 38): ``SandboxedImages``.

Each diffusion model is loaded by one child in the ``image`` role, confined like a context
child (Landlock: it reads Python, the system's libraries and its model's file, writes only its
scratch folder; the system call filter with no socket; rlimits), with a memory limit of the
model's file plus ``IMAGE_COMPUTE_MB`` for stable-diffusion.cpp's buffers plus the runtime's
allowance. That memory is reserved from the worker's model budget (``MemoryBudget``: the
``ModelPool``, which unloads idle text models to make room) before the child starts, and given
back when it ends. A child stays loaded for the next job of its model; at most ``max_models``
are kept, the least recently used ended first. Jobs of one model run one at a time (a child
renders one order at a time), so ``render`` waits its turn.

The child's images come back checked: as many as the order asked for, with its seeds (the
queen checks every image's format and size again). A child that dies fails the job as an
``EngineCrashed`` and the next job starts a new one; a cancel is passed on and read by the
child before each image of the order (a started image runs to its end).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from desktop_worker.errors import (
    EngineError,
    GenerationCancelled,
    ModelLoadError,
    UnsupportedRequest,
)
from desktop_worker.sandbox.policy import policy_for
from desktop_worker.sandbox.process import CancelWatch, EngineProcess
from shared_schema.engine_ipc import (
    Failed,
    ImageLoaded,
    LoadImage,
    Render,
    Rendered,
    SandboxPolicy,
)
from shared_schema.images import ImageOrder, RenderedImage, diffusion_memory_mb

log = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 600.0
POLL_S = 0.25
CANCEL_GRACE_S = 120.0  # one image of a large model on a slow CPU, then the child is ended


@dataclass
class _Child:
    process: EngineProcess
    family: str
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


@dataclass(frozen=True, slots=True)
class Rendering:
    images: list[RenderedImage]
    render_s: float  # the child's own clock, for the log and the Jobs tab
    family: str


class MemoryBudget(Protocol):
    """The owner's memory budget that image children count against (``ModelPool``)."""

    async def reserve(self, key: str, memory_mb: int) -> None: ...
    def release(self, key: str) -> None: ...


class NoBudget:
    """No budget to count against (the engine's own tests, the benchmarks)."""

    async def reserve(self, key: str, memory_mb: int) -> None:
        return None

    def release(self, key: str) -> None:
        return None


def image_policy(model_path: Path, taesd_path: Path | None) -> tuple[list[str], int]:
    """The files an image child reads, and its memory (MB) before the runtime allowance."""
    files = [str(model_path), *([str(taesd_path)] if taesd_path is not None else [])]
    return files, diffusion_memory_mb(sum(Path(path).stat().st_size for path in files))


class SandboxedImages:
    """Diffusion models, each in an image child, rendering ``ImageOrder``s. ``gpus``: whether
    a child may open the GPU's device files (not when the owner keeps models off the GPU,
    ``gpu_layers=0``: stable-diffusion.cpp then renders on the CPU)."""

    def __init__(self, *, n_threads: int | None = None, max_models: int = 1,
                 cancel_grace_s: float = CANCEL_GRACE_S,
                 memory: MemoryBudget | None = None, gpus: bool = True) -> None:
        self.n_threads = n_threads
        self.gpus = gpus
        self.last_policy: SandboxPolicy | None = None
        self.memory = memory or NoBudget()
        self.max_models = max_models
        self.cancel_grace_s = cancel_grace_s
        self._children: OrderedDict[Path, _Child] = OrderedDict()
        self._opening = asyncio.Lock()

    def loaded(self) -> list[Path]:
        return [path for path, child in self._children.items() if child.process.alive]

    async def render(self, model_path: Path, order: ImageOrder, cancel: threading.Event, *,
                     taesd_path: Path | None = None) -> Rendering:
        """The order's images; ``GenerationCancelled`` once a cancel stopped it,
        ``EngineCrashed`` when the child died, ``ModelLoadError`` when the model did not load,
        ``EngineError`` for a failed render."""
        child = await self._child(model_path, taesd_path)
        async with child.lock:
            if cancel.is_set():
                raise GenerationCancelled("the image job was cancelled")
            return await self._render(child, order, cancel)

    async def _child(self, model_path: Path, taesd_path: Path | None) -> _Child:
        async with self._opening:
            child = self._children.get(model_path)
            if child is not None and child.process.alive:
                self._children.move_to_end(model_path)
                return child
            if child is not None:  # it died: the next job starts a new one
                await self._end(model_path)
            while len(self._children) >= self.max_models:
                await self._end(next(iter(self._children)))
            files, memory_mb = image_policy(model_path, taesd_path)
            key = f"image:{model_path}"
            await self.memory.reserve(key, memory_mb)
            try:
                child = await asyncio.to_thread(self._open, model_path, taesd_path, files,
                                                memory_mb)
            except BaseException:
                self.memory.release(key)
                raise
            self._children[model_path] = child
            return child

    def _open(self, model_path: Path, taesd_path: Path | None, files: list[str],
              memory_mb: int) -> _Child:
        policy = policy_for("image", model_files=files, memory_mb=memory_mb, gpus=self.gpus)
        self.last_policy = policy  # the tests' window on what the child was allowed
        process = EngineProcess("image", policy, label=f"image {model_path.name}")
        try:
            process.start()
            process.send(process.link.load_image(LoadImage(
                model_path=str(model_path),
                taesd_path=str(taesd_path) if taesd_path is not None else None,
                n_threads=self.n_threads)))
            message = process.wait_for(LOAD_TIMEOUT_S)
            if isinstance(message, Failed):
                raise ModelLoadError(f"{model_path.name} did not load: {message.message}")
            if not isinstance(message, ImageLoaded):
                raise ModelLoadError(f"{model_path.name} did not load within "
                                     f"{LOAD_TIMEOUT_S:.0f} s")
        except BaseException:
            process.close()
            raise
        log.info("image engine: %s loaded (%s) in child %s", model_path.name, message.family,
                 process.pid)
        return _Child(process, message.family)

    async def _render(self, child: _Child, order: ImageOrder,
                      cancel: threading.Event) -> Rendering:
        process = child.process
        job = process.link.next_job()
        process.send(process.link.render(Render(job=job, order=order.model_dump(mode="json"))))
        watch = CancelWatch(process, job, cancel, self.cancel_grace_s)
        while True:
            if watch.check():
                raise GenerationCancelled("the image job was cancelled (its engine did not "
                                          "stop in time and was ended)")
            message = await asyncio.to_thread(process.wait_for, POLL_S)
            if message is None:
                continue
            if isinstance(message, Failed):
                if message.code == "cancelled":
                    raise GenerationCancelled(message.message)
                if message.code == "unsupported":
                    raise UnsupportedRequest(message.message)
                raise EngineError(f"rendering failed: {message.message}")
            assert isinstance(message, Rendered)
            return Rendering(checked_images(message, order), message.render_s, child.family)

    async def _end(self, model_path: Path) -> None:
        child = self._children.pop(model_path, None)
        if child is not None:
            await asyncio.to_thread(child.process.close)
            self.memory.release(f"image:{model_path}")

    async def close(self) -> None:
        for path in list(self._children):
            await self._end(path)


def checked_images(message: Rendered, order: ImageOrder) -> list[RenderedImage]:
    """The child's images as wire types, refused (``EngineError``) unless there is one per
    seed of the order, in order: a child a hostile model took over gets no further."""
    try:
        images = [RenderedImage.model_validate(image) for image in message.images]
    except ValueError as exc:
        raise EngineError(f"the image engine sent a malformed image: {exc}") from exc
    if [image.seed for image in images] != order.seeds():
        raise EngineError(f"the image engine sent {len(images)} images for seeds "
                          f"{[image.seed for image in images]}, not {order.seeds()}")
    return images
