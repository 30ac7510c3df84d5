"""The original, untyped messages, still accepted from workers that predate protocol v1.

A legacy worker's first frame is a bare registration (no ``type``). It then receives bare
``{openai_url, openai_req}`` requests, one at a time, and answers each with a bare OpenAI answer.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from shared_schema.base import WireModel
from shared_schema.hardware import (
    MAX_CPUS,
    MAX_DISK_GB,
    MAX_GPUS,
    MAX_VRAM_MB,
    ClGpu,
    NvGpu,
    empty_to_none,
)


class LegacyRegistration(WireModel):
    ln_url: str | None = Field(default=None, max_length=2048)
    _no_empty_ln_url = field_validator("ln_url")(empty_to_none)
    cpu_count: int = Field(default=0, ge=0, le=MAX_CPUS)
    disk_space: int = Field(default=0, ge=0, le=MAX_DISK_GB)
    vram: int = Field(default=0, ge=0, le=MAX_VRAM_MB)
    nv_gpu_count: int = Field(default=0, ge=0, le=MAX_GPUS)
    nv_driver_version: str | None = None
    nv_gpus: list[NvGpu] = Field(default_factory=list)
    cl_driver_version: str | None = None
    cl_gpus: list[ClGpu] = Field(default_factory=list)


class LegacyRequest(WireModel):
    openai_url: str
    openai_req: dict[str, Any]


def looks_like_registration(frame: dict[str, Any]) -> bool:
    """A first frame with no ``type`` that carries the original registration's keys."""
    return "type" not in frame and bool({"cpu_count", "vram", "ln_url"} & frame.keys())
