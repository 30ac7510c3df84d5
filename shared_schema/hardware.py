"""Hardware and model facts a worker reports in its hello and status messages.

Field names inherited from the original registration message keep their old spelling
(``memory``, ``vram``, ``disk_space``); their units are documented here and fixed:
``memory`` and ``vram`` are megabytes of GPU memory, ``disk_space`` is gigabytes of free disk
where models live. New fields carry their unit in the name. The one exception is a legacy
registration's ``vram``, which the real workerbee sends in bytes: ``legacy.vram_to_mb`` reads it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from shared_schema.base import WireModel

# Bounds far past any real machine: a worker claiming more is lying, and would skew the swarm's
# totals on /stats (the fuzzer's 18 EB of VRAM).
MAX_CPUS = 65_536
MAX_GPUS = 1_024
MAX_VRAM_MB = 1 << 24  # 16 TiB, across every GPU of one worker
MAX_DISK_GB = 10_000_000  # 10 PB
# "MB" on the wire is a mebibyte, as NVML and psutil count it: what a byte count is divided by.
MIB = 1 << 20
MAX_VRAM_BYTES = MAX_VRAM_MB * MIB  # the same 16 TiB, for a worker that reports bytes
MAX_DISK_MB = MAX_DISK_GB * 1024  # the same 10 PB, for a worker that reports megabytes
MAX_PARAMETERS = 10**14  # 100 T: past the largest model anyone serves (a claim past it is a lie)
MAX_MODEL_BYTES = MAX_DISK_GB * 10**9  # a model file no bigger than the biggest disk
MAX_CONTEXT = 2**31 - 1


def empty_to_none(value: str | None) -> str | None:
    """An empty payout address means none ("don't pay me"), signed and stored the same way."""
    return value or None


class NvGpu(WireModel):
    """One NVIDIA GPU as read through NVML."""

    name: str
    memory: int = Field(ge=0, le=MAX_VRAM_MB, description="Total GPU memory in MB.")
    memory_free_mb: int | None = Field(default=None, ge=0, le=MAX_VRAM_MB)
    compute_capability: str | None = None
    utilization_pct: int | None = Field(default=None, ge=0, le=100)
    uuid: str | None = None


class ClGpu(WireModel):
    """One OpenCL GPU device."""

    name: str
    vendor: str | None = None
    memory: int = Field(default=0, ge=0, description="Global memory in MB.")
    driver_version: str | None = None


class ModelDescriptor(WireModel):
    """A model the worker holds: cached on disk, and maybe loaded in memory."""

    name: str = Field(min_length=1, description="hf-user/hf-repo:filter, or an imported name.")
    file_name: str | None = None
    size_bytes: int = Field(default=0, ge=0, le=MAX_MODEL_BYTES)
    sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    parameter_count: int | None = Field(default=None, ge=0, le=MAX_PARAMETERS)
    quant: str | None = None
    context_length: int | None = Field(default=None, ge=0, le=MAX_CONTEXT)
    loaded: bool = False
    # Added for image generation (issue 38): "image" for a diffusion model (served only at
    # /v1/images/generations, by workers with the ``image`` capability); older workers: "text".
    kind: Literal["text", "image"] = "text"


class DownloadProgress(WireModel):
    """A model download in progress on the worker."""

    name: str
    downloaded_bytes: int = Field(ge=0, le=MAX_MODEL_BYTES)
    total_bytes: int | None = Field(default=None, ge=0, le=MAX_MODEL_BYTES)
    bytes_per_s: float | None = Field(default=None, ge=0)
