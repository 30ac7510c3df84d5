"""Choosing workers to place a model on: pure, tested on made-up swarms.

A model's needs come from the queen's own reading of its GGUF header (``catalog``): the file's
size, and the memory to serve it at the default context by the worker's own rule
(``shared_schema.fitting.memory_cost_mb``, what its pool counts against its budget). A worker
fits when its room for models (free disk and what its owner's quota leaves) holds the file and
its memory budget holds the model. Among those that fit, the queen prefers, in order: workers
whose owners let the swarm choose their models, workers whose free VRAM holds every layer
(llama.cpp's full offload, by ``plan_load``'s own margin), faster ones (the speed record for the
model's size class), then the most room. What a worker says about its room and memory is a
claim: it only decides whom to ask; a worker that lied fails its fetch and is not asked again.

A diffusion model (issue 38, ``image_need``) goes only to workers with the ``image`` capability
(their owners opted in), and needs its file's room and, in memory, what the worker's image
child is allowed: its weights and ``IMAGE_COMPUTE_MB`` (``images.diffusion_memory_mb``).

The scan is linear in the workers that take fetches, once per placement (not per request), and
keeps only the best ``count`` (``heapq.nsmallest``): ``bench/placement.py`` times it on 5,000.
"""

from __future__ import annotations

import heapq
import statistics
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Literal, Protocol, TypeVar

from shared_schema import DownloadProgress, ModelDescriptor
from shared_schema.capabilities import IMAGE
from shared_schema.fitting import (
    DEFAULT_CONTEXT,
    MB,
    choose_context,
    kv_bytes_per_layer,
    memory_cost_mb,
    safety_margin_mb,
)
from shared_schema.gguf_shape import GgufShape
from shared_schema.images import diffusion_memory_mb

__all__ = [
    "ModelNeed",
    "PlacementView",
    "choose",
    "fit_problem",
    "image_need",
    "need_of",
    "repo_allowed",
]


@dataclass(frozen=True, slots=True)
class ModelNeed:
    """What serving one pinned model file takes."""

    name: str
    sha256: str
    size_bytes: int
    memory_mb: int  # against the worker's memory budget
    full_offload_mb: int  # VRAM for every layer, the rest and the KV cache
    kind: Literal["text", "image"] = "text"  # image: a diffusion model, for image workers


def need_of(name: str, sha256: str, size_bytes: int, shape: GgufShape | None) -> ModelNeed:
    """A model's needs from its size and shape (no shape: the file alone, a lower bound)."""
    if shape is None:
        mb = -(-size_bytes // MB)
        return ModelNeed(name, sha256, size_bytes, mb, mb)
    context = choose_context(shape, DEFAULT_CONTEXT)
    kv = kv_bytes_per_layer(shape, context)
    full = sum(size + kv for size in shape.layer_bytes) + shape.other_bytes
    return ModelNeed(name, sha256, size_bytes, memory_cost_mb(shape, size_bytes),
                     -(-full // MB))


def image_need(name: str, sha256: str, size_bytes: int) -> ModelNeed:
    """A diffusion model's needs: the file, and its weights and compute allowance in memory
    (also all it takes of VRAM)."""
    memory = diffusion_memory_mb(size_bytes)
    return ModelNeed(name, sha256, size_bytes, memory, memory, kind="image")


class PlacementView(Protocol):
    """What placement reads of a worker (``swarm.worker.Worker`` has it all)."""

    @property
    def key(self) -> str: ...
    @property
    def takes_fetch(self) -> bool: ...
    @property
    def paused(self) -> str | None: ...
    @property
    def flagged(self) -> bool: ...
    @property
    def closed(self) -> bool: ...
    @property
    def memory_budget_mb(self) -> int | None: ...
    @property
    def model_room_mb(self) -> int | None: ...
    @property
    def vram_free_mb(self) -> int | None: ...
    @property
    def swarm_models(self) -> bool: ...
    @property
    def capabilities(self) -> frozenset[str]: ...
    @property
    def models(self) -> Mapping[str, ModelDescriptor]: ...
    @property
    def downloads(self) -> Mapping[str, DownloadProgress]: ...


W = TypeVar("W", bound=PlacementView)


def fit_problem(worker: PlacementView, need: ModelNeed) -> str | None:
    """Why ``need`` cannot go on ``worker`` (None: it fits)."""
    if not worker.takes_fetch:
        return "takes no fetches"
    if worker.paused or worker.flagged or worker.closed:
        return "paused, flagged or gone"
    if need.kind == "image" and IMAGE not in worker.capabilities:
        return "makes no images (its owner has not turned images on)"
    room, memory = worker.model_room_mb, worker.memory_budget_mb
    if room is None or memory is None:
        return "did not say its room for models"
    if room * MB < need.size_bytes:
        return f"{room:,} MB of room for models, the file needs {-(-need.size_bytes // MB):,}"
    if memory < need.memory_mb:
        return f"a {memory:,} MB memory budget, the model needs {need.memory_mb:,}"
    return None


def whole_in_vram(worker: PlacementView, need: ModelNeed) -> bool:
    """Whether every layer fits the worker's free VRAM, by ``plan_load``'s margin."""
    free = worker.vram_free_mb
    return bool(free) and need.full_offload_mb <= free - safety_margin_mb(free)


def choose(need: ModelNeed, workers: Iterable[W], speeds: Mapping[str, float], count: int,
           exclude: Collection[str] = ()) -> list[W]:
    """Up to ``count`` workers to fetch ``need``, best first: they fit, do not hold the file
    already, are not fetching it and are not in ``exclude`` (those that failed it)."""
    unknown = statistics.median(speeds.values()) if speeds else 1.0
    fitting: list[tuple[int, int, float, int, str, W]] = []
    for worker in workers:
        if worker.key in exclude or need.name in worker.downloads:
            continue
        held = worker.models.get(need.name)
        if held is not None and held.sha256 == need.sha256:
            continue
        if fit_problem(worker, need) is not None:
            continue
        fitting.append((
            0 if worker.swarm_models else 1,
            0 if whole_in_vram(worker, need) else 1,
            speeds.get(worker.key, unknown),
            -(worker.model_room_mb or 0),
            worker.key,
            worker,
        ))
    return [entry[-1] for entry in heapq.nsmallest(count, fitting, key=lambda e: e[:5])]


def repo_allowed(repo_id: str, allow: Collection[str], deny: Collection[str]) -> str | None:
    """Why the operator's lists refuse ``repo_id`` (None: allowed). Patterns are shell-style
    (``bartowski/*``), compared case-insensitively; a deny wins over an allow."""
    repo = repo_id.lower()
    for pattern in deny:
        if fnmatchcase(repo, pattern.lower()):
            return f"'{repo_id}' is on this queen's deny-list ({pattern})"
    if allow and not any(fnmatchcase(repo, pattern.lower()) for pattern in allow):
        return f"'{repo_id}' is not on this queen's allow-list"
    return None
