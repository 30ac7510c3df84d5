"""Training a LoRA adapter with llama.cpp (issue 37): the contract (``TrainSpec`` and its
events) and the run's plan, pure; ``engine.train_run`` runs it in the train child.

A job's examples (OpenAI's chat fine-tuning rows, validated by the queen) are rendered with the
base model's own chat template and tokenized by llama.cpp, then planned (``plan_windows``,
pure): per epoch the examples are shuffled (seeded) and packed whole, first fit, at most
``batch_size`` to a window of ``n_ctx + 1`` tokens (inputs [:-1], targets [1:]), padded at the
end. One window is one optimizer step. The plan depends only on the spec, so a run resumed from
the checkpoint after step S trains the same windows from S + 1 on.

The loss covers every position of a window, the user's and system's tokens and the padding
too: llama.cpp's API labels every position with a one-hot row and has no way to leave one out
(a label outside the vocabulary aborts it). ``trained_tokens`` (what the job is billed for)
counts the positions whose target is an example's token, never the padding.

llama.cpp trains F32 tensors only: the base is first copied to F32 (``ggml_opt.f32_copy``) in
the run's folder; the adapter (rank ``rank``, alpha ``2 * rank``, on q, k, v, o, gate, up and
down of every layer) is a GGUF LoRA that llama.cpp serves on the original, quantized base file.
The run itself (``engine.train_run``, in the train child only: it loads llama.cpp, which the
worker's own process never does) first has ``ggml_opt.self_check`` prove that this build's
gradients do not pile up across steps; training refuses to start when they do. A checkpoint
holds the adapter only (llama.cpp keeps AdamW's moments out of reach): a resumed run starts its
optimizer afresh.

Where it runs (``plan_train_device``, pure): on the CPU, unless the owner lets training use the
GPU (``train_on_gpu``) and the GPU has room for the F32 copy and the run's work
(``TrainLimits.memory_mb``) plus ``TRAIN_VRAM_MARGIN_MB``; then every layer goes on the GPU.
A GPU run that fails before its first step (a load, the self-check, a crash) runs again on the
CPU (``sandbox.training``).
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from desktop_worker.errors import TrainingError

log = logging.getLogger(__name__)

ADAPTER_NAME = "adapter.gguf"
EXAMPLES_NAME = "examples.jsonl"  # the run's examples, one row a line, in its folder
ALPHA_PER_RANK = 2.0
# On the GPU beside the run's own memory: the CUDA context, cuBLAS's workspace, the compute
# buffers llama.cpp sizes for a window.
TRAIN_VRAM_MARGIN_MB = 1024


@dataclass(frozen=True, slots=True)
class TrainDevice:
    """Where a run trains: ``n_gpu_layers`` as llama.cpp takes it (0: the CPU; -1: every layer
    on the GPU), and why."""

    n_gpu_layers: int
    reason: str

    @property
    def on_gpu(self) -> bool:
        return self.n_gpu_layers != 0


def plan_train_device(need_mb: int, free_vram_mb: int | None, *, allowed: bool) -> TrainDevice:
    """Every layer on the GPU when the owner allows it and ``free_vram_mb`` holds ``need_mb``
    (the run's memory, ``TrainLimits.memory_mb``) and the margin; else the CPU."""
    if not allowed:
        return TrainDevice(0, "training on the CPU (train_on_gpu is off)")
    if free_vram_mb is None:
        return TrainDevice(0, "training on the CPU (no GPU memory detected)")
    wanted = need_mb + TRAIN_VRAM_MARGIN_MB
    if free_vram_mb < wanted:
        return TrainDevice(0, f"training on the CPU (the GPU has {free_vram_mb:,} MB free; the "
                              f"run needs {wanted:,})")
    return TrainDevice(-1, f"training on the GPU ({wanted:,} of {free_vram_mb:,} MB free)")


@dataclass(frozen=True, slots=True)
class TrainSpec:
    base_path: Path  # the base model's GGUF (as the store holds it, maybe quantized)
    examples: list[dict[str, Any]]  # OpenAI chat fine-tuning rows: {"messages": [...]}
    n_epochs: int
    batch_size: int  # examples per step, at most (packed into one window of n_ctx tokens)
    learning_rate: float  # AdamW lr
    seed: int
    rank: int = 8
    n_ctx: int = 256
    progress_every_steps: int = 25
    checkpoint_every_steps: int = 100  # and at each epoch's end
    resume_from: Path | None = None  # an adapter GGUF checkpoint of this job
    resume_step: int = 0  # the step that checkpoint was taken after


@dataclass(frozen=True, slots=True)
class TrainProgress:
    step: int
    total_steps: int
    epoch: int
    loss: float  # mean over the steps since the last progress
    trained_tokens: int


@dataclass(frozen=True, slots=True)
class TrainCheckpoint:
    step: int
    path: Path
    trained_tokens: int
    loss: float


@dataclass(frozen=True, slots=True)
class TrainResult:
    adapter_path: Path
    steps: int
    trained_tokens: int
    loss: float


TrainEvent = TrainProgress | TrainCheckpoint


# --- the plan (pure) -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Window:
    """One optimizer step: ``ids`` (``n_ctx + 1`` tokens) and how many of its ``n_ctx``
    targets are examples' tokens (the rest are padding)."""

    epoch: int  # 1-based
    ids: tuple[int, ...]
    trained_tokens: int


def plan_windows(examples: Sequence[Sequence[int]], *, n_ctx: int, pad: int, n_epochs: int,
                 batch_size: int, seed: int) -> list[Window]:
    """Every step of the run, in order (see the module's docstring)."""
    if not examples:
        raise TrainingError("there are no examples to train on")
    for index, ids in enumerate(examples):
        if len(ids) > n_ctx + 1:
            raise TrainingError(f"example {index + 1} has {len(ids)} tokens, more than the "
                                f"training window of {n_ctx + 1}")
        if len(ids) < 2:
            raise TrainingError(f"example {index + 1} has fewer than 2 tokens")
    rng = random.Random(seed)
    windows: list[Window] = []
    for epoch in range(1, n_epochs + 1):
        order = list(range(len(examples)))
        rng.shuffle(order)
        bins: list[list[int]] = []
        counts: list[int] = []
        for index in order:
            ids = examples[index]
            if not bins or counts[-1] >= batch_size or len(bins[-1]) + len(ids) > n_ctx + 1:
                bins.append([])
                counts.append(0)
            bins[-1].extend(ids)
            counts[-1] += 1
        for ids in bins:
            real = len(ids)
            windows.append(Window(epoch, tuple(ids + [pad] * (n_ctx + 1 - real)), real - 1))
    return windows


@dataclass(frozen=True, slots=True)
class Schedule:
    """When a run reports progress and writes a checkpoint (steps are 1-based)."""

    total_steps: int
    progress_every: int
    checkpoint_every: int
    epoch_ends: frozenset[int] = field(default_factory=frozenset)

    @classmethod
    def of(cls, windows: Sequence[Window], progress_every: int, checkpoint_every: int
           ) -> Schedule:
        ends = {i + 1 for i, w in enumerate(windows)
                if i + 1 == len(windows) or windows[i + 1].epoch != w.epoch}
        return cls(len(windows), max(1, progress_every), max(1, checkpoint_every),
                   frozenset(ends))

    def progress_due(self, step: int) -> bool:
        return step % self.progress_every == 0 or step == self.total_steps

    def checkpoint_due(self, step: int) -> bool:
        """Every ``checkpoint_every`` steps and at each epoch's end, but not after the last
        step: the final adapter is written then."""
        if step >= self.total_steps:
            return False
        return step % self.checkpoint_every == 0 or step in self.epoch_ends


def check_spec(spec: TrainSpec) -> None:
    """A spec's numbers, before anything is loaded: ``TrainingError`` naming the bad one."""
    checks = {"n_epochs": spec.n_epochs >= 1, "batch_size": spec.batch_size >= 1,
              "learning_rate": 0 < spec.learning_rate < 1, "rank": 1 <= spec.rank <= 256,
              # llama.cpp pads a context to a multiple of 256, and trains whole contexts
              "n_ctx": 256 <= spec.n_ctx <= 65536 and spec.n_ctx % 256 == 0,
              "progress_every_steps": spec.progress_every_steps >= 1,
              "checkpoint_every_steps": spec.checkpoint_every_steps >= 1,
              "resume_step": spec.resume_step >= 0}
    for name, ok in checks.items():
        if not ok:
            raise TrainingError(f"the training spec's {name} is out of range: "
                                f"{getattr(spec, name)!r}")
    if spec.resume_step and spec.resume_from is None:
        raise TrainingError("resume_step without resume_from")


# --- the run's files ---------------------------------------------------------------------------


def read_examples(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_examples(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
