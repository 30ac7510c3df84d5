"""Pure advice about models and this machine: will a model fit in memory, and which model to
suggest on first run. No Qt and no I/O, so it is tested with plain numbers."""

from __future__ import annotations

from dataclasses import dataclass

from desktop_worker.hardware import HardwareReport

MIB = 1 << 20

# Room for the context (KV cache) and llama.cpp's buffers on top of the weights.
OVERHEAD = 1.2
FIXED_OVERHEAD_MB = 512
# A CPU-only machine is offered small models: bigger ones answer too slowly to earn. How small
# depends on its threads: on 2 threads a 1.5B model answers at a few tokens a second (the
# queen's timeouts come first), so only the tiny one is offered there.
CPU_LIMITS_MB = ((2, 1024), (4, 2048), (8, 3072))  # (at most this many threads, memory limit)
CPU_MANY_THREADS_LIMIT_MB = 4096


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


def cpu_limit_mb(threads: int) -> int:
    """The most memory a model may need to be offered on a CPU-only machine of ``threads``."""
    for most, limit in CPU_LIMITS_MB:
        if threads <= most:
            return limit
    return CPU_MANY_THREADS_LIMIT_MB


def model_room_mb(report: HardwareReport, cap_mb: int | None = None) -> int:
    """The memory a suggested model may need: the usable VRAM, or, CPU-only, half the free RAM
    within the limit for the machine's threads."""
    vram = usable_vram_mb(report, cap_mb)
    if vram is not None:
        return vram
    return min(report.available_ram_mb // 2, cpu_limit_mb(report.cpu_count))


def fitting_models(
    report: HardwareReport | None, cap_mb: int | None = None,
    catalog: tuple[CatalogModel, ...] = CATALOG,
) -> list[CatalogModel]:
    """The catalog models this machine can serve, biggest first (the first is the suggestion);
    SmolLM2 alone when nothing fits (or the hardware is not known yet)."""
    if report is None:
        return [SMOLLM2]
    room = model_room_mb(report, cap_mb)
    fitting = sorted((m for m in catalog if need_mb(m.size_bytes) <= room),
                     key=lambda m: m.size_bytes, reverse=True)
    return fitting or [SMOLLM2]


def suggest_model(
    report: HardwareReport | None, cap_mb: int | None = None,
    catalog: tuple[CatalogModel, ...] = CATALOG,
) -> CatalogModel:
    """The biggest catalog model that fits the GPU (or, CPU-only, a small one for its threads);
    SmolLM2 when nothing bigger fits."""
    return fitting_models(report, cap_mb, catalog)[0]
