"""Model advice from recorded hardware: what fits, and what the first-run wizard suggests."""

from __future__ import annotations

from pathlib import Path

import pytest

from desktop_worker.gui.services.advice import (
    SMOLLM2,
    fitting_models,
    memory_verdict,
    need_mb,
    suggest_model,
)
from desktop_worker.hardware import NullGpuDetector, SystemInfo, detect_hardware
from tests.support.hardware_fixtures import FixedSystemProbe, fixture_path, recorded_machine

GB = 1 << 30


def machine(name: str, tmp_path: Path):
    return recorded_machine(fixture_path(name), tmp_path)


def cpu_only(tmp_path: Path, ram_mb: int):
    info = SystemInfo(cpu_count=4, total_ram_mb=ram_mb, available_ram_mb=ram_mb,
                      disk_free_gb=100)
    return detect_hardware(tmp_path, nvidia=NullGpuDetector(), opencl=NullGpuDetector(),
                           system=FixedSystemProbe(info))


@pytest.mark.parametrize(("fixture", "expected"), [
    ("gaming_rtx3060", "bartowski/Qwen2.5-7B-Instruct-GGUF:Q4_K_M"),
    ("server_2x_a100", "bartowski/Qwen2.5-14B-Instruct-GGUF:Q4_K_M"),
])
def test_the_biggest_model_that_fits_the_gpu_is_suggested(tmp_path, fixture, expected):
    report = machine(fixture, tmp_path)
    suggestion = suggest_model(report)
    assert suggestion.name == expected
    assert memory_verdict(suggestion.size_bytes, report) is None


def test_a_vram_cap_lowers_the_suggestion(tmp_path):
    report = machine("gaming_rtx3060", tmp_path)
    assert suggest_model(report, cap_mb=3000).name == \
        "bartowski/Llama-3.2-3B-Instruct-GGUF:Q4_K_M"


def test_smollm2_when_nothing_bigger_fits(tmp_path):
    assert suggest_model(cpu_only(tmp_path, ram_mb=1024)) == SMOLLM2
    assert suggest_model(None) == SMOLLM2


def test_a_cpu_only_machine_gets_a_small_model_even_with_lots_of_ram(tmp_path):
    suggestion = suggest_model(cpu_only(tmp_path, ram_mb=64_000))
    assert need_mb(suggestion.size_bytes) <= 2048


def test_memory_verdicts(tmp_path):
    gpu = machine("gaming_rtx3060", tmp_path)
    assert memory_verdict(4 * GB, gpu) is None
    partly = memory_verdict(12 * GB, gpu)  # 11 GB of VRAM free, 23 GB of RAM
    assert partly is not None
    assert "not fit in VRAM" in partly
    assert "more than the usable VRAM" in memory_verdict(200 * GB, gpu)
    assert "not fit in VRAM" in memory_verdict(4 * GB, gpu, cap_mb=2048)
    small = cpu_only(tmp_path, ram_mb=2000)
    assert "only 2,000 MB of RAM is free" in memory_verdict(4 * GB, small)
    assert memory_verdict(100 << 20, small) is None


def cpu_machine(tmp_path: Path, threads: int, ram_mb: int):
    info = SystemInfo(cpu_count=threads, total_ram_mb=ram_mb, available_ram_mb=ram_mb,
                      disk_free_gb=100)
    return detect_hardware(tmp_path, nvidia=NullGpuDetector(), opencl=NullGpuDetector(),
                           system=FixedSystemProbe(info))


def test_a_two_thread_cpu_only_machine_gets_the_tiny_model(tmp_path):
    # The machine: 2 threads, no GPU, 24 GB of RAM. Qwen2.5 1.5B (986 MB) was suggested.
    report = cpu_machine(tmp_path, threads=2, ram_mb=24_000)
    assert suggest_model(report) == SMOLLM2
    assert fitting_models(report) == [SMOLLM2]


@pytest.mark.parametrize(("threads", "biggest"), [
    (1, SMOLLM2.name),
    (2, SMOLLM2.name),
    (4, "bartowski/Qwen2.5-1.5B-Instruct-GGUF:Q4_K_M"),
    (8, "bartowski/Llama-3.2-3B-Instruct-GGUF:Q4_K_M"),
    (32, "bartowski/Llama-3.2-3B-Instruct-GGUF:Q4_K_M"),
])
def test_cpu_only_suggestions_grow_with_threads(tmp_path, threads, biggest):
    assert suggest_model(cpu_machine(tmp_path, threads, ram_mb=64_000)).name == biggest


def test_the_choices_are_the_models_that_fit_biggest_first(tmp_path):
    report = machine("gaming_rtx3060", tmp_path)
    choices = fitting_models(report)
    assert choices[0] == suggest_model(report)
    assert [m.size_bytes for m in choices] == sorted((m.size_bytes for m in choices),
                                                     reverse=True)
    assert choices[-1] == SMOLLM2
    assert all(memory_verdict(m.size_bytes, report) is None for m in choices)
    assert "bartowski/Qwen2.5-14B-Instruct-GGUF:Q4_K_M" not in [m.name for m in choices]
    assert fitting_models(None) == [SMOLLM2]
