"""Pure advice about models and this machine: will a model fit in memory, and which model to
suggest on first run. No Qt and no I/O, so it is tested with plain numbers."""

from __future__ import annotations

from dataclasses import dataclass

from desktop_worker.hardware import HardwareReport

MIB = 1 << 20

# Room for the context (KV cache) and llama.cpp's buffers on top of the weights.
OVERHEAD = 1.2
FIXED_OVERHEAD_MB = 512
# A CPU-only machine is offered small models: bigger ones answer too slowly to earn.
CPU_ONLY_LIMIT_MB = 2048


@dataclass(frozen=True)
class CatalogModel:
    name: str  # hf-user/hf-repo:filter
    label: str
    size_bytes: int  # the GGUF file, approximately


SMOLLM2 = CatalogModel("HuggingFaceTB/SmolLM2-135M-Instruct-GGUF:Q8_0",
                       "SmolLM2 135M Instruct (tiny, runs anywhere)", 145 * MIB)

# Well-known instruct models, smallest first.
CATALOG: tuple[CatalogModel, ...] = (
    SMOLLM2,
    CatalogModel("bartowski/Qwen2.5-1.5B-Instruct-GGUF:Q4_K_M",
                 "Qwen2.5 1.5B Instruct, Q4_K_M", 986 * MIB),
    CatalogModel("bartowski/Llama-3.2-3B-Instruct-GGUF:Q4_K_M",
                 "Llama 3.2 3B Instruct, Q4_K_M", 2019 * MIB),
    CatalogModel("bartowski/Qwen2.5-7B-Instruct-GGUF:Q4_K_M",
                 "Qwen2.5 7B Instruct, Q4_K_M", 4683 * MIB),
    CatalogModel("bartowski/Qwen2.5-14B-Instruct-GGUF:Q4_K_M",
                 "Qwen2.5 14B Instruct, Q4_K_M", 8988 * MIB),
)


def need_mb(size_bytes: int) -> int:
    """Memory a model of this file size needs to serve, MiB (weights plus overhead)."""
    return int(size_bytes / MIB * OVERHEAD) + FIXED_OVERHEAD_MB


def usable_vram_mb(report: HardwareReport | None, cap_mb: int | None = None) -> int | None:
    """The GPU memory the worker may use: free NVIDIA memory (else the OpenCL GPUs' total),
    capped by the owner's setting; None without a GPU."""
    if report is None:
        return None
    free = report.free_vram_mb
    if free is None and report.vram > 0:
        free = report.vram
    if free is None or free <= 0:
        return None
    return min(free, cap_mb) if cap_mb else free


def memory_verdict(
    size_bytes: int, report: HardwareReport | None, cap_mb: int | None = None
) -> str | None:
    """Why a model of ``size_bytes`` would not fit this machine's memory, or None if it fits."""
    if report is None:
        return None
    need = need_mb(size_bytes)
    ram = report.available_ram_mb
    vram = usable_vram_mb(report, cap_mb)
    if vram is not None:
        if need <= vram:
            return None
        if need <= vram + ram:
            return (f"needs about {need:,} MB but only {vram:,} MB of VRAM is usable: it would "
                    "not fit in VRAM, so part of it runs on the CPU, more slowly")
        return (f"needs about {need:,} MB: more than the usable VRAM ({vram:,} MB) and free RAM "
                f"({ram:,} MB) together")
    if need <= ram:
        return None
    return f"needs about {need:,} MB of memory, but only {ram:,} MB of RAM is free (no GPU found)"


def suggest_model(
    report: HardwareReport | None, cap_mb: int | None = None,
    catalog: tuple[CatalogModel, ...] = CATALOG,
) -> CatalogModel:
    """The biggest catalog model that fits the GPU (or, CPU-only, a small one); SmolLM2 when
    nothing bigger fits."""
    if report is None:
        return SMOLLM2
    vram = usable_vram_mb(report, cap_mb)
    room = vram if vram is not None else min(report.available_ram_mb // 2, CPU_ONLY_LIMIT_MB)
    fitting = [m for m in catalog if need_mb(m.size_bytes) <= room]
    return max(fitting, key=lambda m: m.size_bytes) if fitting else SMOLLM2
