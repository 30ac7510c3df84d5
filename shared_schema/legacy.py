"""The original, untyped messages, still accepted from workers that predate protocol v1.

A legacy worker's first frame is a bare registration (no ``type``). It then receives bare
``{openai_url, openai_req}`` requests, one at a time, and answers each with a bare OpenAI answer.

The registration is read as the real GPUtopia workerbee sends it, not only as the seed's wiki
describes it. The workerbee sends ``vram`` as psutil's *available RAM in bytes* (the wiki says
MB; ``vram_to_mb`` tells the two apart), ``disk_space`` in MB, its GPUs' ``memory`` as floats
(NVML's MiB), ``null`` for readings it lacks (``nv_gpu_count`` on a machine without NVIDIA), and
in later versions also ``worker_version``, ``capabilities``, ``pubkey``, ``slug``, ``sig``,
``ln_address``, ``auth_key`` and ``models``. Those newer fields are kept as sent but trusted for
nothing: the signature is not Apiary's and covers no nonce, so a legacy worker still has no
identity, no capabilities and no models in the queen's eyes.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import Field, field_validator, model_validator

from shared_schema.base import WireModel
from shared_schema.hardware import (
    MAX_CPUS,
    MAX_DISK_MB,
    MAX_GPUS,
    MAX_VRAM_BYTES,
    MAX_VRAM_MB,
    MIB,
    ClGpu,
    NvGpu,
    empty_to_none,
)

# THE rule for a registration's ``vram`` unit, used wherever the queen reads it (``vram_mb``):
# a value of at least 2**24 cannot be megabytes, since 2**24 MB is 16 TiB, the cap on any worker
# (``MAX_VRAM_MB``), so it is bytes (the real workerbee's psutil reading); a smaller value is MB,
# as the wiki says. A workerbee is misread only with under 16 MiB of free RAM, which cannot run
# a model anyway. The field's own cap is 16 TiB in bytes, so after conversion no value can pass
# ``MAX_VRAM_MB``: an absurd claim is refused in either unit.
VRAM_BYTES_FROM = MAX_VRAM_MB

# Fields the workerbee may send as ``null`` that mean "not read": they take their default.
_NULL_IS_DEFAULT = frozenset(
    {"cpu_count", "disk_space", "vram", "nv_gpu_count", "nv_gpus", "cl_gpus", "capabilities",
     "models"}
)
UNKNOWN_GPU = "unknown GPU"

ShortText = Annotated[str, Field(max_length=1024)]


def vram_to_mb(vram: int) -> int:
    """A registration's ``vram`` in MB, whichever unit it came in (see ``VRAM_BYTES_FROM``)."""
    return vram // MIB if vram >= VRAM_BYTES_FROM else vram


class LegacyRegistration(WireModel):
    """The original registration message, as the wiki and the real workerbee send it.

    ``vram`` keeps the value as sent (so the message round-trips); read ``vram_mb`` for its size.
    """

    ln_url: str | None = Field(default=None, max_length=2048)
    _no_empty_ln_url = field_validator("ln_url")(empty_to_none)
    cpu_count: int = Field(default=0, ge=0, le=MAX_CPUS)
    disk_space: int = Field(default=0, ge=0, le=MAX_DISK_MB,
                            description="Free disk; the workerbee sends MB. Not used.")
    vram: int = Field(default=0, ge=0, le=MAX_VRAM_BYTES,
                      description="Memory for models: MB, or bytes from the real workerbee "
                                  "(``vram_to_mb``).")
    nv_gpu_count: int = Field(default=0, ge=0, le=MAX_GPUS)
    nv_driver_version: str | None = Field(default=None, max_length=200)
    nv_gpus: list[NvGpu] = Field(default_factory=list, max_length=MAX_GPUS)
    cl_driver_version: str | None = Field(default=None, max_length=200)
    cl_gpus: list[ClGpu] = Field(default_factory=list, max_length=MAX_GPUS)
    # Sent by later workerbee versions; kept as sent, trusted for nothing.
    worker_version: str | None = Field(default=None, max_length=100)
    capabilities: list[ShortText] = Field(default_factory=list, max_length=256)
    pubkey: str | None = Field(default=None, max_length=1024)
    slug: str | None = Field(default=None, max_length=1024)
    sig: str | None = Field(default=None, max_length=2048)
    ln_address: str | None = Field(default=None, max_length=2048)
    auth_key: str | None = Field(default=None, max_length=2048, repr=False)  # a secret: unlogged
    models: list[ShortText] = Field(default_factory=list, max_length=4096)

    @model_validator(mode="before")
    @classmethod
    def _as_the_workerbee_sends_it(cls, data: Any) -> Any:
        """Read the workerbee's ``null`` readings as absent, and its GPUs' float MiB and
        missing names as the wire types take them (whole MB, a placeholder name)."""
        if not isinstance(data, dict):
            return data
        body = {key: value for key, value in data.items()
                if value is not None or key not in _NULL_IS_DEFAULT}
        for name in ("nv_gpus", "cl_gpus"):
            gpus = body.get(name)
            if isinstance(gpus, list):
                body[name] = [_gpu_as_sent(gpu) for gpu in gpus]
        return body

    @property
    def vram_mb(self) -> int:
        """The registration's memory for models, in MB, whatever unit it was sent in."""
        return vram_to_mb(self.vram)

    @property
    def gpu_names(self) -> list[str]:
        """The names of its GPUs: the NVIDIA ones, or else the OpenCL ones."""
        return [gpu.name for gpu in self.nv_gpus] or [gpu.name for gpu in self.cl_gpus]


def _gpu_as_sent(gpu: Any) -> Any:
    """One GPU of a registration with NVML's float MiB floored (a fraction of a MB is noise)
    and an unread name or size replaced; anything else is left for validation to judge."""
    if not isinstance(gpu, dict):
        return gpu
    gpu = dict(gpu)
    memory = gpu.get("memory")
    if memory is None:
        gpu["memory"] = 0
    elif isinstance(memory, float) and math.isfinite(memory) and memory >= 0:
        gpu["memory"] = int(memory)
    if gpu.get("name") is None:
        gpu["name"] = UNKNOWN_GPU
    return gpu


class LegacyRequest(WireModel):
    openai_url: str
    openai_req: dict[str, Any]


def looks_like_registration(frame: dict[str, Any]) -> bool:
    """A first frame with no ``type`` that carries the original registration's keys."""
    return "type" not in frame and bool({"cpu_count", "vram", "ln_url"} & frame.keys())
