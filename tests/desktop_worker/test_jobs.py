"""The job runner: a plain answer is sent whole, with checkpoints of its text while it grows."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from desktop_worker.errors import UnsupportedRequest
from desktop_worker.jobs import JobRunner, embedding_inputs, job_kind
from shared_schema import (
    ChatCompletion,
    ChatCompletionChunk,
    Chunk,
    EmbeddingResponse,
    Job,
    Result,
)
from shared_schema.answers import answer_problem
from tests.support.job_sink import RecordingSink
from tests.support.stub_worker import StubPool
from tests.support.workers import ECHO_MODEL, echo_words

WORDS = " ".join(f"w{i}" for i in range(30))
REQUEST = {"model": ECHO_MODEL, "messages": [{"role": "user", "content": WORDS}]}


async def run(runner: JobRunner, request: dict[str, Any], continuation: str | None = None
              ) -> RecordingSink:
    sink = RecordingSink()
    runner.start(Job(id="j1", openai_url="/v1/chat/completions", openai_req=request,
                     continuation=continuation), sink)
    async with asyncio.timeout(10):
        await sink.done.wait()
    assert sink.errors == []
    return sink


async def test_a_plain_answer_sends_checkpoints_then_the_whole_answer():
    runner = JobRunner(StubPool(token_delay_s=0.005), has_model=lambda _: True,  # type: ignore[arg-type]
                       checkpoint_s=0.03)
    sink = await run(runner, REQUEST)
    words = echo_words(REQUEST)
    [(data, usage)] = sink.results
    assert data["choices"][0]["message"]["content"] == "".join(words)
    assert usage.completion_tokens == len(words)
    assert len(sink.chunks) >= 2  # 31 tokens at 5 ms, a checkpoint every 30 ms
    saved = "".join(c["choices"][0]["delta"]["content"] for c in sink.chunks)
    assert "".join(words).startswith(saved)  # in order, nothing twice
    counted = sum(c["usage"]["completion_tokens"] for c in sink.chunks)
    assert counted == len(saved.split())


async def test_a_streamed_answer_sends_every_chunk_and_no_checkpoint():
    runner = JobRunner(StubPool(token_delay_s=0.0), has_model=lambda _: True,  # type: ignore[arg-type]
                       checkpoint_s=0.0)
    sink = await run(runner, {**REQUEST, "stream": True})
    assert len(sink.chunks) == len(echo_words(REQUEST)) + 1  # every word, then the finish
    assert not any("usage" in chunk for chunk in sink.chunks)


async def test_a_fast_plain_answer_is_one_frame():
    runner = JobRunner(StubPool(token_delay_s=0.0), has_model=lambda _: True)  # type: ignore[arg-type]
    sink = await run(runner, REQUEST)
    assert sink.chunks == []
    assert len(sink.results) == 1


async def test_a_continuation_reaches_the_engine():
    runner = JobRunner(StubPool(token_delay_s=0.0), has_model=lambda _: True)  # type: ignore[arg-type]
    sink = await run(runner, REQUEST, continuation="echo: w0 w1")
    [(data, usage)] = sink.results
    assert data["choices"][0]["message"]["content"] == "".join(echo_words(REQUEST)[3:])
    assert usage.prompt_tokens == 7 + 3


async def test_every_frame_the_worker_sends_passes_the_queens_check():
    """The worker shapes its answers with ``shared_schema.answers``; the queen checks them with
    ``answer_problem`` before relaying them. A plain answer with checkpoints, a streamed one and
    an embeddings answer all pass, and read as the OpenAI models say."""
    runner = JobRunner(StubPool(token_delay_s=0.002), has_model=lambda _: True,  # type: ignore[arg-type]
                       checkpoint_s=0.01)
    plain = await run(runner, REQUEST)
    streamed = await run(runner, {**REQUEST, "stream": True})
    assert plain.chunks  # checkpoints were sent
    for sink in (plain, streamed):
        for seq, data in enumerate(sink.chunks):
            assert answer_problem(Chunk(id="j1", seq=seq, data=data)) is None
            ChatCompletionChunk.model_validate(data)
        [(data, usage)] = sink.results
        assert answer_problem(Result(id="j1", data=data, usage=usage)) is None
    ChatCompletion.model_validate(plain.results[0][0])

    sink = RecordingSink()
    runner.start(Job(id="e1", openai_url="/v1/embeddings",
                     openai_req={"model": ECHO_MODEL, "input": ["a b", "c"]}), sink)
    async with asyncio.timeout(10):
        await sink.done.wait()
    [(data, usage)] = sink.results
    assert answer_problem(Result(id="e1", data=data, usage=usage), embeddings=True) is None
    embeddings = EmbeddingResponse.model_validate(data)
    assert [item.index for item in embeddings.data] == [0, 1]
    assert embeddings.model == ECHO_MODEL
    assert usage.prompt_tokens == 3


def test_a_jobs_kind_comes_from_its_path():
    assert job_kind("/v1/chat/completions") == "chat"
    assert job_kind("/v1/completions") == "completions"
    assert job_kind("/v1/embeddings") == "embeddings"


def test_embedding_inputs_are_texts_or_token_lists():
    assert embedding_inputs("a") == ["a"]
    assert embedding_inputs(["a", "b"]) == ["a", "b"]
    assert embedding_inputs([1, 2]) == [[1, 2]]
    assert embedding_inputs([[1], [2, 3]]) == [[1], [2, 3]]
    for bad in (None, [], [[]], ["a", 1], [True], [1.5], [-1], {"a": 1}):
        with pytest.raises(UnsupportedRequest):
            embedding_inputs(bad)


async def test_bad_embeddings_input_is_a_non_retryable_invalid_request():
    sink = RecordingSink()
    runner = JobRunner(StubPool(token_delay_s=0.0), has_model=lambda _: True)  # type: ignore[arg-type]
    runner.start(Job(id="e", openai_url="/v1/embeddings",
                     openai_req={"model": ECHO_MODEL, "input": [["x"]]}), sink)
    async with asyncio.timeout(10):
        await sink.done.wait()
    assert [(code, retryable) for code, _, retryable in sink.errors] == [
        ("invalid_request", False)]
