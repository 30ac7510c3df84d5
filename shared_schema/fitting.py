"""Choosing a model's context size and GPU layers: a pure function of its GGUF metadata and the
free VRAM, with a safety margin. No I/O, so it is tested on made-up models. The worker plans its
loads with it, and the queen places models on workers with the same rules (``memory_cost_mb``:
what the worker's pool counts against its memory budget).

Memory per offloaded layer is the layer's tensor bytes plus its share of the KV cache
(``2 * n_ctx * n_head_kv * head_dim * 2 bytes``, f16 keys and values). The non-layer tensors
(token embeddings, output) go to the GPU only when every layer fits, as llama.cpp does when
``n_gpu_layers`` exceeds the block count.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

MB = 1024 * 1024
DEFAULT_CONTEXT = 4096
MIN_CONTEXT = 512
KV_BYTES_PER_VALUE = 2  # f16


class ModelShape(Protocol):
    """What fitting needs from a model's GGUF metadata (``GgufInfo`` provides it)."""

    @property
    def block_count(self) -> int: ...
    @property
    def context_length(self) -> int | None: ...
    @property
    def embedding_length(self) -> int | None: ...
    @property
    def head_count(self) -> int | None: ...
    @property
    def head_count_kv(self) -> int | None: ...
    @property
    def layer_bytes(self) -> Sequence[int]: ...
    @property
    def other_bytes(self) -> int: ...


@dataclass(frozen=True, slots=True)
class LoadPlan:
    n_ctx: int
    n_gpu_layers: int
    offloaded_layers: int
    vram_needed_mb: int
    reason: str


def kv_bytes_per_layer(shape: ModelShape, n_ctx: int) -> int:
    heads = shape.head_count or 1
    heads_kv = shape.head_count_kv or heads
    head_dim = (shape.embedding_length or 0) // heads
    return 2 * n_ctx * heads_kv * head_dim * KV_BYTES_PER_VALUE


def memory_cost_mb(shape: ModelShape, size_bytes: int, n_ctx: int | None = None,
                   contexts: int = 1) -> int:
    """What a loaded model costs against the worker's memory budget (its pool counts the same):
    the file, mapped, plus the KV cache of each context at the chosen context size."""
    kv = kv_bytes_per_layer(shape, choose_context(shape, n_ctx)) * shape.block_count
    return (size_bytes + kv * contexts) // MB


def choose_context(shape: ModelShape, requested: int | None = None) -> int:
    """The requested context (or 4096), never beyond what the model was trained for."""
    trained = shape.context_length or DEFAULT_CONTEXT
    wanted = requested if requested is not None else DEFAULT_CONTEXT
    return max(MIN_CONTEXT, min(wanted, trained))


def safety_margin_mb(free_vram_mb: int) -> int:
    """Keep 10% of free VRAM, at least 512 MB, for llama.cpp's compute buffers and the desktop."""
    return max(512, free_vram_mb // 10)


def plan_load(
    shape: ModelShape,
    free_vram_mb: int | None,
    *,
    gpu_layers: int | Literal["auto"] = "auto",
    n_ctx: int | None = None,
) -> LoadPlan:
    """How to load a model: its context size and how many layers go to the GPU."""
    context = choose_context(shape, n_ctx)
    kv = kv_bytes_per_layer(shape, context)
    per_layer = [size + kv for size in shape.layer_bytes]
    blocks = len(per_layer) or shape.block_count
    if gpu_layers != "auto":
        layers = max(0, int(gpu_layers))
        offloaded = min(layers, blocks)
        needed = sum(per_layer[:offloaded]) + (shape.other_bytes if layers > blocks else 0)
        return LoadPlan(context, layers, offloaded, needed // MB, "set by the owner")
    if not free_vram_mb:
        return LoadPlan(context, 0, 0, 0, "no GPU memory available: running on the CPU")
    budget = (free_vram_mb - safety_margin_mb(free_vram_mb)) * MB
    used = 0
    offloaded = 0
    for size in per_layer:
        if used + size > budget:
            break
        used += size
        offloaded += 1
    if offloaded == blocks and used + shape.other_bytes <= budget:
        used += shape.other_bytes
        return LoadPlan(context, blocks + 1, blocks, used // MB, "the whole model fits in VRAM")
    return LoadPlan(
        context,
        offloaded,
        offloaded,
        used // MB,
        f"{offloaded} of {blocks} layers fit in {free_vram_mb} MB of free VRAM",
    )


# The most sequences one batched context serves (issue 36): past eight, a consumer machine's
# streams each get too little for interactive use, and the queen routes by what one gets.
MAX_BATCH_SLOTS = 8


def batch_slots(
    shape: ModelShape,
    size_bytes: int,
    plan: LoadPlan,
    *,
    budget_mb: int,
    used_mb: int = 0,
    free_vram_mb: int | None = None,
    max_slots: int = MAX_BATCH_SLOTS,
) -> int:
    """How many sequences a model's batched context can hold at ``plan.n_ctx`` each (at least
    one). With one, generation shares the model's own context; with more, a batched context
    of that many sequences comes beside it, each costing its KV cache at that size: in RAM,
    out of what the worker's budget leaves after the other loaded models (``used_mb``), the
    file and the model's own context; on a GPU, also out of what the free VRAM leaves after
    the plan (its layers, one cache, the margin), at the offloaded layers' share of a cache."""
    kv_layer = kv_bytes_per_layer(shape, plan.n_ctx)
    kv_sequence = max(1, kv_layer * max(1, shape.block_count))
    room = (budget_mb - used_mb) * MB - size_bytes - kv_sequence
    slots = max(1, min(max_slots, room // kv_sequence))
    if plan.offloaded_layers > 0 and free_vram_mb:
        spare = (free_vram_mb - safety_margin_mb(free_vram_mb) - plan.vram_needed_mb) * MB
        per_sequence = max(1, kv_layer * plan.offloaded_layers)
        slots = min(slots, max(1, spare // per_sequence))
    return int(slots)
