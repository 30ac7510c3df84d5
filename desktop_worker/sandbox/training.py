"""Training a LoRA adapter in a sandboxed engine child (issue 37): ``SandboxedTrainer``.

Each run is one child in the ``train`` role, confined like a context child (Landlock, the
system call filter with no socket at all, rlimits) with limits of its own sized from the base's
parameter count (``policy.TrainLimits``: llama.cpp trains on an F32 copy of the base, made in
the child's scratch folder and removed with it). The child reads the base model's files (and
the checkpoint a resumed run starts from) and writes only its scratch folder. The worker writes
the examples there before the child starts (``examples.jsonl``), and takes each checkpoint and
the final adapter out of it into ``out_dir`` itself (``adopt_file``): the child names no path
and cannot write ``out_dir``; a file it swapped for a link, a hard link or anything but a plain
GGUF file is refused, so a hostile child cannot make the worker copy out a file it could not
read itself.

A cancel is sent to the child, which stops between two steps (``TrainingCancelled``); a child
that does not stop within ``cancel_grace_s`` is killed.

A run planned on the GPU (``engine.training.plan_train_device``) gets the GPU's device files and
starts the driver inside the sandbox, as a context child does; one that fails before its first
report runs again, from the start, in a new child on the CPU.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path

from desktop_worker.engine.training import (
    ADAPTER_NAME,
    EXAMPLES_NAME,
    TrainCheckpoint,
    TrainDevice,
    TrainProgress,
    TrainResult,
    TrainSpec,
    check_spec,
    plan_train_device,
    write_examples,
)
from desktop_worker.errors import (
    EngineCrashed,
    EngineError,
    TrainingCancelled,
    TrainingError,
    TrainingUnsupported,
)
from desktop_worker.sandbox.policy import TrainLimits, split_parts, train_policy
from desktop_worker.sandbox.process import CancelWatch, EngineProcess
from desktop_worker.store.gguf_info import read_gguf_info
from shared_schema.engine_ipc import Failed, Train, TrainCheckpointed, Trained, TrainStep
from shared_schema.training import checkpoint_name

log = logging.getLogger(__name__)

POLL_S = 0.25  # how often the run looks at its cancel event while it waits for the child
CANCEL_GRACE_S = 60.0  # a step of a large model on a slow CPU, and the child's reply
GGUF_MAGIC = b"GGUF"
COPY_BYTES = 1 << 20

TrainEventHandler = Callable[[TrainProgress | TrainCheckpoint], Awaitable[None]]


def adopt_file(scratch: Path, name: str, out_dir: Path, max_bytes: int) -> Path:
    """Copy the child's ``scratch/name`` into ``out_dir`` (written beside and renamed) and
    remove it from the scratch folder. Refused (``TrainingError``) unless it is a plain file
    of its own (not a link, not a hard link to another file, not a FIFO), a GGUF file, and at
    most ``max_bytes``: the child made it and may have made it hostile."""
    source = scratch / name
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(source, flags)
    except OSError as exc:
        raise TrainingError(f"the train engine's {name} cannot be opened: {exc}") from exc
    dest = out_dir / name
    partial = out_dir / (name + ".partial")
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
            raise TrainingError(f"the train engine's {name} is not a plain file of its own")
        if info.st_size > max_bytes:
            raise TrainingError(f"the train engine's {name} is {info.st_size:,} bytes, more "
                                f"than an adapter of this model can be ({max_bytes:,})")
        with os.fdopen(os.dup(fd), "rb") as reader:
            if reader.read(len(GGUF_MAGIC)) != GGUF_MAGIC:
                raise TrainingError(f"the train engine's {name} is not a GGUF file")
            reader.seek(0)
            out_dir.mkdir(parents=True, exist_ok=True)
            with partial.open("wb") as writer:
                while chunk := reader.read(COPY_BYTES):
                    writer.write(chunk)
        partial.replace(dest)
    finally:
        os.close(fd)
        partial.unlink(missing_ok=True)
    source.unlink(missing_ok=True)
    return dest


def raise_train_failure(failed: Failed) -> None:
    if failed.code == "cancelled":
        raise TrainingCancelled(failed.message)
    if failed.code == "training_unsupported":
        raise TrainingUnsupported(failed.message)
    raise TrainingError(f"training failed: {failed.message}")


class SandboxedTrainer:
    """Runs ``TrainSpec``s, each in a new train child: on the GPU when ``free_vram_mb`` is
    given (the owner's ``train_on_gpu``) and says the GPU has room
    (``plan_train_device``), else on the CPU. A GPU run that fails before it reported
    anything (llama.cpp's load, the self-check, a crash) runs again on the CPU."""

    def __init__(self, *, n_threads: int | None = None,
                 cancel_grace_s: float = CANCEL_GRACE_S,
                 free_vram_mb: Callable[[], int | None] | None = None) -> None:
        self.n_threads = n_threads
        self.cancel_grace_s = cancel_grace_s
        self.free_vram_mb = free_vram_mb
        self.last_process: EngineProcess | None = None  # the tests' window on the child
        self.last_device: TrainDevice | None = None  # where the last run trained

    def plan(self, limits: TrainLimits) -> TrainDevice:
        free = self.free_vram_mb() if self.free_vram_mb is not None else None
        return plan_train_device(limits.memory_mb, free, allowed=self.free_vram_mb is not None)

    async def train(self, spec: TrainSpec, out_dir: Path, cancel: threading.Event,
                    on_event: TrainEventHandler) -> TrainResult:
        """Train; ``on_event`` hears progress and each checkpoint (its file already in
        ``out_dir``). ``TrainingCancelled`` once a cancel stopped it, ``TrainingError`` (and
        its kinds) when the run failed, ``EngineCrashed`` when the child died."""
        check_spec(spec)
        info = read_gguf_info(spec.base_path)  # InvalidModelFile: the store's own check
        limits = TrainLimits.of(info.parameter_count)
        device = self.plan(limits)
        if not device.on_gpu:
            return await self._attempt(spec, out_dir, cancel, on_event, limits, device)
        reported = False

        async def heard(event: TrainProgress | TrainCheckpoint) -> None:
            nonlocal reported
            reported = True
            await on_event(event)

        try:
            return await self._attempt(spec, out_dir, cancel, heard, limits, device)
        except EngineError as exc:  # a failed run, a crashed child, a load
            if reported or cancel.is_set() or isinstance(exc, TrainingCancelled):
                raise
            log.warning("training %s on the GPU failed before its first report (%s); "
                        "training on the CPU instead", spec.base_path.name, exc)
            cpu = TrainDevice(0, f"training on the CPU (on the GPU it failed: {exc})")
            return await self._attempt(spec, out_dir, cancel, on_event, limits, cpu)

    async def _attempt(self, spec: TrainSpec, out_dir: Path, cancel: threading.Event,
                       on_event: TrainEventHandler, limits: TrainLimits, device: TrainDevice
                       ) -> TrainResult:
        """One run in a new child on ``device``."""
        self.last_device = device
        log.info("fine-tuning %s: %s", spec.base_path.name, device.reason)
        extra = [str(spec.resume_from)] if spec.resume_from is not None else []
        policy = train_policy(model_files=split_parts(str(spec.base_path)), limits=limits,
                              extra_read=extra, gpus=device.on_gpu)
        process = EngineProcess("train", policy, label=f"train {spec.base_path.name}",
                                scratch_quota_mb=limits.scratch_mb)
        self.last_process = process
        try:
            write_examples(Path(process.scratch) / EXAMPLES_NAME, spec.examples)
            await asyncio.to_thread(process.start)
            return await self._run(process, spec, out_dir, cancel, on_event,
                                   limits.max_file_mb * 2**20, device.n_gpu_layers)
        finally:
            await asyncio.to_thread(process.close)

    async def _run(self, process: EngineProcess, spec: TrainSpec, out_dir: Path,
                   cancel: threading.Event, on_event: TrainEventHandler, max_bytes: int,
                   n_gpu_layers: int) -> TrainResult:
        job = process.link.next_job()
        process.send(process.link.train(Train(
            job=job, base_path=str(spec.base_path), n_epochs=spec.n_epochs,
            batch_size=spec.batch_size, learning_rate=spec.learning_rate, seed=spec.seed,
            rank=spec.rank, n_ctx=spec.n_ctx, progress_every_steps=spec.progress_every_steps,
            checkpoint_every_steps=spec.checkpoint_every_steps,
            resume_from=str(spec.resume_from) if spec.resume_from is not None else None,
            resume_step=spec.resume_step, n_threads=self.n_threads,
            n_gpu_layers=n_gpu_layers)))
        scratch = Path(process.scratch)
        watch = CancelWatch(process, job, cancel, self.cancel_grace_s)
        while True:
            if watch.check():
                raise TrainingCancelled("the training run was cancelled (its engine did not "
                                        "stop in time and was ended)")
            try:
                message = await asyncio.to_thread(process.wait_for, POLL_S)
            except EngineCrashed:
                if watch.cancelled:
                    raise TrainingCancelled("the training run was cancelled") from None
                raise
            if message is None:
                continue
            if isinstance(message, TrainStep):
                await on_event(TrainProgress(message.step, message.total_steps, message.epoch,
                                             message.loss, message.trained_tokens))
            elif isinstance(message, TrainCheckpointed):
                name = checkpoint_name(message.step)
                path = await asyncio.to_thread(adopt_file, scratch, name, out_dir, max_bytes)
                await on_event(TrainCheckpoint(message.step, path, message.trained_tokens,
                                               message.loss))
            elif isinstance(message, Trained):
                path = await asyncio.to_thread(adopt_file, scratch, ADAPTER_NAME, out_dir,
                                               max_bytes)
                return TrainResult(path, message.steps, message.trained_tokens, message.loss)
            elif isinstance(message, Failed):
                raise_train_failure(message)
