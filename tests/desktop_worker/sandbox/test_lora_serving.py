"""A fine-tuned model (issue 37) served through the worker's pool and its sandboxed engine
children: the base plus a LoRA adapter under its own name, beside the plain base. At
temperature 0 it answers differently from the base and exactly as llama-cpp-python does in
this process with the same ``lora_path``; the base answers as before; a batched child applies
the adapter to its batch too. A hostile adapter (truncated, another architecture, other shapes,
a whole model) is refused by the worker before a child starts and by the child itself when the
file changed since: a typed error, no child left behind, and the base served on. Real
children over the real SmolLM2."""

from __future__ import annotations

import re
import shutil
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from llama_cpp import Llama

from desktop_worker.engine.llama_model import LlamaContext
from desktop_worker.engine.pool import ModelPool
from desktop_worker.errors import InvalidAdapter, ModelLoadError
from desktop_worker.sandbox.context import SandboxedContext, SandboxedContexts
from desktop_worker.sandbox.policy import policy_for
from desktop_worker.sandbox.process import EngineProcess
from shared_schema.engine_ipc import Load, LoadAdapter
from shared_schema.fitting import LoadPlan, memory_cost_mb
from tests.desktop_worker.engine.test_adapters import REAL, lora_tensors, write_adapter
from tests.desktop_worker.sandbox.test_crashes import Smol
from tests.support.processes import engine_children

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="Landlock and POSIX children")

FT = "ft:smol:zorb:ftjob-abc123"
N_CTX = 512
ASK = {"messages": [{"role": "user", "content": "Name three colours."}], "temperature": 0,
       "max_tokens": 16}


def resolve(name: str) -> Any:
    if name != "smol":
        raise KeyError(name)
    return Smol


@pytest.fixture
def adapter(tmp_path) -> Path:
    return write_adapter(tmp_path / "adapter.gguf")


@pytest.fixture
async def pool():
    pool = ModelPool(resolve, SandboxedContexts(), max_jobs=1, n_ctx=N_CTX, n_threads=1,
                     budget_mb=4096)
    yield pool
    await pool.close()


async def chat(pool: ModelPool, name: str) -> str:
    parts: list[str] = []

    async def on_chunk(data: dict[str, Any]) -> None:
        parts.extend(choice["delta"].get("content") or "" for choice in data["choices"])

    await pool.chat(name, ASK, threading.Event(), on_chunk)
    return "".join(parts)


def in_process(lora_path: Path | None) -> str:
    """llama-cpp-python's own answer, in this process, with its own ``lora_path``."""
    llama = Llama(model_path=str(REAL), n_ctx=N_CTX, n_threads=1, verbose=False,
                  lora_path=str(lora_path) if lora_path else None)
    try:
        answer = llama.create_chat_completion(ASK["messages"], temperature=0, max_tokens=16)
        return str(answer["choices"][0]["message"]["content"])
    finally:
        llama.close()


@pytest.mark.timeout(240)
async def test_the_fine_tuned_name_answers_as_llama_cpp_with_its_adapter_beside_the_base(
        pool, adapter) -> None:
    base_before = await chat(pool, "smol")
    info = await pool.register_adapter(FT, "smol", adapter)
    assert info.size_bytes == adapter.stat().st_size
    fine_tuned = await chat(pool, FT)
    base_after = await chat(pool, "smol")

    assert fine_tuned != base_before  # the adapter changes the greedy answer
    assert fine_tuned == in_process(adapter)  # exactly as llama.cpp applies it
    assert base_before == base_after == in_process(None)  # the base unchanged beside it
    assert pool.loaded() == {"smol", FT}
    assert pool.adapted() == {FT: "smol"}

    # two children, the adapter readable in the fine-tuned one's only, counted in its memory
    ft_entry, base_entry = pool._loaded[FT], pool._loaded["smol"]
    [ft_context], [base_context] = ft_entry.contexts, base_entry.contexts
    assert ft_context.pid != base_context.pid
    assert str(adapter) in ft_context.process.policy.read_paths
    assert str(adapter.parent) not in ft_context.process.policy.read_paths
    assert str(adapter) not in base_context.process.policy.read_paths
    assert ft_entry.model.size_bytes == Smol.size_bytes + adapter.stat().st_size
    assert ft_entry.cost_mb == memory_cost_mb(Smol.info, Smol.size_bytes + info.size_bytes,
                                              N_CTX, 1)

    # forgetting the name unloads it; the base stays loaded
    await pool.forget_adapter(FT)
    assert pool.loaded() == {"smol"}
    with pytest.raises(KeyError):
        await chat(pool, FT)


@pytest.mark.timeout(240)
async def test_a_batched_child_applies_the_adapter_to_its_batch(adapter) -> None:
    """llama.cpp applies an adapter per context: a batched child's batch context (issue 36)
    must get it too, or the fine-tuned name would answer as its base."""
    pool = ModelPool(resolve, SandboxedContexts(), max_jobs=2, n_ctx=N_CTX, n_threads=1,
                     budget_mb=4096)
    plan = LoadPlan(n_ctx=N_CTX, n_gpu_layers=0, offloaded_layers=0, vram_needed_mb=0,
                    reason="test")
    here = LlamaContext(FT, REAL, plan, n_threads=1, slots=2, adapter=adapter)
    try:
        await pool.register_adapter(FT, "smol", adapter)
        fine_tuned, base = await chat(pool, FT), await chat(pool, "smol")
        assert pool.slots(FT) == 2
        expected = "".join(choice["delta"].get("content") or ""
                           for chunk in here.stream("chat", ASK, threading.Event())
                           for choice in chunk["choices"])
        assert fine_tuned == expected
        assert fine_tuned != base
    finally:
        here.close()
        await pool.close()


def hostile(kind: str, folder: Path) -> Path:
    path = folder / f"{kind}.gguf"
    if kind == "truncated":
        whole = write_adapter(folder / "whole.gguf").read_bytes()
        path.write_bytes(whole[: len(whole) // 2])
    elif kind == "another_architecture":
        write_adapter(path, arch="qwen2")
    elif kind == "wrong_shapes":
        tensors = lora_tensors()
        tensors["blk.0.attn_q.weight.lora_a"] = np.zeros((8, 1536), np.float32)
        write_adapter(path, tensors)
    else:  # a whole model passed off as an adapter
        shutil.copyfile(REAL, path)
    return path


KINDS = ("truncated", "another_architecture", "wrong_shapes", "whole_model")


@pytest.mark.timeout(240)
async def test_a_hostile_adapter_is_refused_and_the_base_served_on(pool, tmp_path) -> None:
    for kind in KINDS:
        with pytest.raises(InvalidAdapter):
            await pool.register_adapter(f"ft:smol:{kind}:x", "smol", hostile(kind, tmp_path))
    assert pool.adapted() == {}

    # registered while sound, then replaced on disk: refused before a child starts
    good = write_adapter(tmp_path / "good.gguf")
    await pool.register_adapter(FT, "smol", good)
    good.write_bytes(good.read_bytes()[:1000])
    with pytest.raises(InvalidAdapter, match=r"good\.gguf"):
        await chat(pool, FT)
    assert await chat(pool, "smol") == in_process(None)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", KINDS)
def test_the_child_itself_refuses_a_hostile_adapter(kind, tmp_path) -> None:
    """Past the worker's check (the file changed after it, or a worker that skipped it), the
    child checks again before llama.cpp opens the adapter: a typed error, the child ended."""
    bad = hostile(kind, tmp_path)
    policy = policy_for("context", model_files=[str(REAL)], adapter_files=[str(bad)])
    load = Load(name=FT, model_path=str(REAL), n_ctx=N_CTX, n_gpu_layers=0, n_threads=1,
                adapter=LoadAdapter(path=str(bad)))
    expected = re.escape(f"refused before llama.cpp opened it: {bad.name}")
    with pytest.raises(ModelLoadError, match=expected):
        SandboxedContext(FT, EngineProcess("context", policy, label="engine ft"), load,
                         ready_timeout_s=60)
    assert engine_children() == []
