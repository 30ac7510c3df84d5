"""Models on demand (issue 17): what the queen tells workers about demand, the ``fetch`` command
that places a model on a worker, and the worker's answer when a fetch fails.

The queen resolves a hub name itself (the file, its size, sha256 and shape from the GGUF
header), picks workers that fit it, and sends each a ``Fetch`` naming the exact commit, files and
sha256: the worker downloads exactly that file, checks it, loads it and says so in its ``status``
(its models, with the sha256). A fetch that cannot be done comes back as ``FetchFailed`` with a
``code`` from ``FETCH_FAILURES``. ``Demand`` goes to every worker in its welcome and then every
``interval_s``: the models developers ask for, so that an app can offer the ones that fit its
machine, or pull them itself when its owner lets the swarm choose its models.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from shared_schema.base import WireModel
from shared_schema.hardware import MAX_MODEL_BYTES, MAX_PARAMETERS, MAX_VRAM_MB

__all__ = [
    "FETCH_FAILURES",
    "MAX_DEMAND_MODELS",
    "Demand",
    "Fetch",
    "FetchFailed",
    "ModelDemand",
]

# The most models one demand message lists (the queen sends the busiest).
MAX_DEMAND_MODELS = 50

# Why a worker could not fetch a model. ``disk_full``: no room on the disk or under the owner's
# quota; ``memory``: the model would not fit the worker's memory budget; ``sha256_mismatch``: the
# file downloaded is not the one named; ``hub_error``: the hub refused or was out of reach;
# ``not_allowed``: this worker does not take fetches (its owner said no); ``paused``: its owner
# paused it; ``load_failed``: downloaded but llama.cpp could not load it.
FETCH_FAILURES = frozenset({"disk_full", "memory", "sha256_mismatch", "hub_error", "not_allowed",
                            "paused", "load_failed", "cancelled"})


class ModelDemand(WireModel):
    """Demand for one model on this queen, over the last minutes."""

    name: str = Field(min_length=1, max_length=400)
    requests_per_min: float = Field(ge=0)
    unmet_per_min: float = Field(
        ge=0, description="Requests per minute that found no worker holding the model free.")
    queued: int = Field(ge=0, description="Requests waiting for it now.")
    mean_wait_s: float = Field(ge=0, description="How long requests waited for a worker.")
    holders: int = Field(ge=0, description="Connected workers that hold it.")
    loading: int = Field(ge=0, description="Workers fetching or loading it now.")
    size_bytes: int | None = Field(default=None, ge=0, le=MAX_MODEL_BYTES)
    parameter_count: int | None = Field(default=None, ge=0, le=MAX_PARAMETERS)
    memory_mb: int | None = Field(
        default=None, ge=0, le=MAX_VRAM_MB,
        description="Memory to serve it at the default context (file plus KV cache), as the "
        "queen computes it from the header with the worker's own fitting rules.")
    sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    revision: str | None = Field(
        default=None, pattern=r"^[0-9a-f]{40}$",
        description="The commit the queen pinned the name to: pull from it, and check the "
        "sha256, so that the queen uses the copy (it routes only to its pinned file).")
    earn_msat_per_1k_tokens: int = Field(
        default=0, ge=0, description="What a worker earns per 1,000 completion tokens of it, "
        "after the queen's fee (0: the queen does not pay).")
    kind: Literal["text", "image"] = Field(
        default="text", description="A text model, or a diffusion model for the workers that "
        "make images (issue 38): only the queen places those, with a fetch of kind image.")


class Demand(WireModel):
    type: Literal["demand"] = "demand"
    models: list[ModelDemand] = Field(default_factory=list, max_length=MAX_DEMAND_MODELS)
    interval_s: float = Field(default=60.0, gt=0)


class Fetch(WireModel):
    """Download this model (exactly this file), check it and load it. ``group``: only download
    and check it, for a model group this worker is to lead (the model does not fit it alone;
    the head process loads it across the group's members). ``kind`` ``image`` (issue 38): a
    diffusion model for the worker's image engine, sent only to workers with the ``image``
    capability; it is downloaded and checked, and the image child loads it on its first job."""

    type: Literal["fetch"] = "fetch"
    name: str = Field(min_length=1, max_length=400)
    repo_id: str = Field(min_length=1, max_length=200)
    revision: str = Field(pattern=r"^[0-9a-f]{40}$", description="The commit to download from.")
    paths: list[str] = Field(min_length=1, max_length=256)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="Of the first (or only) file.")
    size_bytes: int = Field(ge=0, le=MAX_MODEL_BYTES)
    group: bool = False
    kind: Literal["text", "image"] = "text"


class FetchFailed(WireModel):
    type: Literal["fetch_failed"] = "fetch_failed"
    name: str = Field(min_length=1, max_length=400)
    code: str = Field(min_length=1, max_length=64)
    message: str = Field(default="", max_length=2000)
