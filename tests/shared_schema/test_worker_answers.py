"""The worker-side builders of ``shared_schema.answers`` for issue 15's shapes: several choices,
log probabilities in whole answers and checkpoints."""

from __future__ import annotations

import orjson

from shared_schema import ChatCompletion, ChatCompletionChunk, Chunk, Result, Usage
from shared_schema.answers import answer_from_chunks, answer_problem, checkpoint_chunk


def entry(token: str, logprob: float = -0.5) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode()),
            "top_logprobs": []}


def chunk(index: int, content: str | None = None, finish: str | None = None,
          logprobs: list | None = None, role: bool = False) -> dict:
    delta: dict = {} if content is None else {"content": content}
    if role:
        delta = {"role": "assistant", **delta}
    choice: dict = {"index": index, "delta": delta}
    if logprobs is not None:
        choice["logprobs"] = {"content": logprobs}
    choice["finish_reason"] = finish
    return {"object": "chat.completion.chunk", "choices": [choice]}


def test_several_choices_become_one_answer_in_index_order():
    answer = answer_from_chunks([
        chunk(0, "a", role=True), chunk(0, "b"), chunk(0, finish="stop"),
        chunk(1, "c", role=True), chunk(1, finish="length"),
        chunk(2, "", role=True), chunk(2, finish="stop"),
    ])
    assert [(c["index"], c["message"]["content"], c["finish_reason"])
            for c in answer["choices"]] == [(0, "ab", "stop"), (1, "c", "length"), (2, "", "stop")]
    assert all("logprobs" not in c for c in answer["choices"])
    ChatCompletion.model_validate(answer)
    assert answer_problem(Result(id="j", data=answer, usage=Usage(prompt_tokens=1,
                                                                  total_tokens=1))) is None


def test_an_answers_logprobs_are_its_chunks_entries_in_order():
    answer = answer_from_chunks([
        chunk(0, "He", logprobs=[entry("He")], role=True),
        chunk(0, "llo", logprobs=[entry("l"), entry("lo")]),
        chunk(0, finish="stop"),
        chunk(1, "", role=True), chunk(1, finish="stop"),
    ])
    first, second = answer["choices"]
    assert [e["token"] for e in first["logprobs"]["content"]] == ["He", "l", "lo"]
    assert second["logprobs"] == {"content": []}  # asked for, none made
    assert list(first) == ["index", "finish_reason", "message", "logprobs"]
    ChatCompletion.model_validate(answer)


def test_a_checkpoint_with_logprobs_counts_one_token_per_entry():
    data = checkpoint_chunk(["Hel", "lo"], [entry("H"), entry("el"), entry("lo")])
    assert orjson.dumps(data["choices"][0]).startswith(
        b'{"index":0,"delta":{"content":"Hello"},"logprobs":{"content":[')
    assert data["usage"]["completion_tokens"] == 3
    assert answer_problem(Chunk(id="j", seq=0, data=data)) is None
    ChatCompletionChunk.model_validate(data)
    # Without logprobs, the shape is the one queens have always read.
    assert "logprobs" not in checkpoint_chunk(["a"])["choices"][0]
