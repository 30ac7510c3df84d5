"""Through the engine boundary, the engine answers exactly as in the worker's own process: the
same text and usage for a chat and a text completion, the same vectors for embeddings, the same
scores for an audit's re-scoring, and a cancel stops a stream."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from desktop_worker.engine.llama_model import llama_context
from desktop_worker.engine.scores import ScoreRequest
from desktop_worker.errors import UnsupportedRequest
from desktop_worker.sandbox.context import SandboxedContexts
from shared_schema.fitting import plan_load
from tests.desktop_worker.sandbox.test_crashes import Smol

ASK = {"messages": [{"role": "user", "content": "Name three colours."}], "temperature": 0,
       "max_tokens": 16}
PLAN = plan_load(Smol.info, None, gpu_layers=0, n_ctx=512)


@pytest.fixture(scope="module")
def pair() -> Any:
    here = llama_context(Smol, PLAN, 1, False)
    there = SandboxedContexts()(Smol, PLAN, 1, False)
    yield here, there
    there.close()
    here.close()


def text(chunks: list[dict[str, Any]]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                   if c.get("choices"))


@pytest.mark.timeout(120)
def test_chat_and_completions_are_the_same_text_and_usage(pair) -> None:
    here, there = pair
    for kind, request in (("chat", ASK), ("completion", {"prompt": "The sky is", **ASK})):
        mine = list(here.stream(kind, request, threading.Event()))
        theirs = list(there.stream(kind, request, threading.Event()))
        assert text(mine) == text(theirs)
        assert text(mine)
        assert here.usage() == there.usage()


@pytest.mark.timeout(120)
def test_scores_are_the_same(pair) -> None:
    here, there = pair
    job = ScoreRequest("chat", {**ASK, "temperature": 0.7}, "Red, green and blue.")
    mine = here.score(job, threading.Event())
    theirs = there.score(job, threading.Event())
    assert mine is not None
    assert theirs is not None
    # The same numbers, to the last bits numpy's summation order may move (the child's BLAS
    # may use another number of threads).
    assert theirs.argmax == mine.argmax
    for name in ("logprobs", "best_logprobs", "sampled_logprobs", "expected", "variances"):
        assert getattr(theirs, name) == pytest.approx(getattr(mine, name), rel=1e-9, abs=1e-12)
    assert theirs.usage() == mine.usage()


@pytest.mark.timeout(120)
def test_embeddings_are_the_same_vectors() -> None:
    here = llama_context(Smol, PLAN, 1, True)
    there = SandboxedContexts()(Smol, PLAN, 1, True)
    try:
        inputs = ["a bee", "a hive of bees"]
        mine, mine_tokens = here.embed(inputs)
        theirs, their_tokens = there.embed(inputs)
        assert their_tokens == mine_tokens
        assert len(theirs) == len(mine) == 2
        for vector, expected in zip(theirs, mine, strict=True):
            assert vector == pytest.approx(expected, rel=1e-6, abs=1e-6)
        with pytest.raises(UnsupportedRequest):
            there.embed([[10**9]])  # a token id past the vocabulary: refused in the child
    finally:
        there.close()
        here.close()


@pytest.mark.timeout(120)
def test_a_cancel_stops_the_stream_in_the_child(pair) -> None:
    _, there = pair
    cancel = threading.Event()
    chunks = []
    for chunk in there.stream("chat", {**ASK, "max_tokens": 400}, cancel):
        chunks.append(chunk)
        if len(chunks) == 3:
            cancel.set()
    assert len(chunks) < 20  # it stopped within a few tokens, not at 400
    assert there.alive  # and the child serves on
    assert text(list(there.stream("chat", ASK, threading.Event())))
