"""What one llama.cpp process writes for a request, with the real SmolLM2: the reference a model
group's answer must equal (issue 19: the head, the worker's roles and the queen end to end)."""

from __future__ import annotations

import threading
from typing import Any

from desktop_worker.engine.llama_model import LlamaContext
from shared_schema.fitting import LoadPlan
from tests.support.on_demand import REAL

__all__ = ["ASK", "REAL", "one_process_text", "text_of"]

ASK = {"model": "smol", "messages": [{"role": "user", "content": "Tell me about Paris."}],
       "temperature": 0, "max_tokens": 40}


def text_of(chunks: list[dict[str, Any]]) -> str:
    """The content of streamed chat chunks, joined."""
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                   if c.get("choices"))


def one_process_text(request: dict[str, Any] = ASK, n_ctx: int = 512) -> str:
    """``request`` answered by one process (blocking; CPU, one thread)."""
    plan = LoadPlan(n_ctx=n_ctx, n_gpu_layers=0, offloaded_layers=0, vram_needed_mb=0,
                    reason="")
    context = LlamaContext("smol", REAL, plan, n_threads=1)
    try:
        return text_of(list(context.stream("chat", request, threading.Event())))
    finally:
        context.close()
