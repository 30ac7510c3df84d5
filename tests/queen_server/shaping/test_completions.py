"""Text completions on the swarm's chat shapes: the worker request, the books' prompt bounds, and
``CompletionShaper`` turning stamped chat chunks and answers into ``text_completion`` objects.

Every object produced is validated with the installed ``openai`` SDK's own ``Completion`` type,
so a shape a real client cannot read fails here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from openai.types import Completion
from pydantic import ValidationError

from queen_server.http.io import param_name
from queen_server.shaping.completions import (
    DEFAULT_MAX_TOKENS,
    CompletionShaper,
    completion_logprobs,
    echo_problem,
    prompt_texts,
    worker_request,
)
from queen_server.swarm.jobs import choices_in
from queen_server.swarm.metering import Meter
from shared_schema.answers import CHAT_CHUNK, AnswerStamp, usage_counts
from shared_schema.openai_requests import CompletionRequest

CMPL_ID = "cmpl-abc"
CREATED = 1_700_000_000
MODEL = "org/repo:Q4_K_M"
STAMP = AnswerStamp("chatcmpl-abc", MODEL, CREATED)


def request(**fields: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": MODEL, "prompt": "Hi", **fields})


def shaper(req: CompletionRequest) -> CompletionShaper:
    return CompletionShaper(req, CMPL_ID, CREATED, MODEL)


def entry(token: str, logprob: float, alts: Sequence[tuple[str, float]] = (),
          raw: list[int] | None = None) -> dict[str, Any]:
    """One chat logprobs entry (OpenAI's ``ChatCompletionTokenLogprob``)."""
    return {"token": token, "logprob": logprob,
            "bytes": list(token.encode()) if raw is None else raw,
            "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())}
                             for t, lp in alts]}


def chat(index: int, *, role: bool = False, content: str | None = None,
         finish: str | None = None, logprobs: list[dict[str, Any]] | None = None
         ) -> dict[str, Any]:
    """A stamped chat chunk of one choice, as the relay hands it to the shaper."""
    delta: dict[str, Any] = {}
    if role:
        delta["role"] = "assistant"
    if content is not None:
        delta["content"] = content
    choice: dict[str, Any] = {"index": index, "delta": delta}
    if logprobs is not None:
        choice["logprobs"] = {"content": logprobs}
    choice["finish_reason"] = finish
    return STAMP.stamp({"choices": [choice]}, CHAT_CHUNK)


def sdk_chunk(data: dict[str, Any]) -> Completion:
    """A stream chunk validated by the SDK. OpenAI's stream chunks carry ``finish_reason: null``
    until a choice's end, which the SDK's (whole-answer) type does not allow; the SDK reads
    stream chunks without validating, so null is checked here and the rest validated as is."""
    checked = {**data, "choices": [
        {**c, "finish_reason": c["finish_reason"] or "stop"} for c in data["choices"]]}
    for choice in data["choices"]:
        assert choice["finish_reason"] in (None, "stop", "length", "content_filter")
    parsed = Completion.model_validate(checked)
    assert parsed.object == "text_completion"
    assert (parsed.id, parsed.created, parsed.model) == (CMPL_ID, CREATED, MODEL)
    return parsed


def stream(s: CompletionShaper, chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for chunk in chunks:
        for name, data in s.chunk(chunk):
            assert name is None  # plain data events
            sdk_chunk(data)
            out.append(data)
    return out


def texts(events: list[dict[str, Any]]) -> dict[int, str]:
    joined: dict[int, str] = {}
    for data in events:
        for choice in data["choices"]:
            joined[choice["index"]] = joined.get(choice["index"], "") + choice["text"]
    return joined


# --- the worker's request ---------------------------------------------------------------------


def test_worker_request_defaults_max_tokens_to_openais_16_and_keeps_queen_fields_home():
    req = request(echo=True, best_of=1, user="u1", stream=True,
                  stream_options={"include_usage": True})
    out = worker_request(req)
    assert out == {"model": MODEL, "prompt": "Hi", "max_tokens": DEFAULT_MAX_TOKENS,
                   "stream": True}
    assert DEFAULT_MAX_TOKENS == 16


def test_worker_request_passes_sampling_on_and_logprobs_in_the_chat_form():
    req = request(prompt=[[1, 2], [3]], max_tokens=40, temperature=0.5, top_p=0.9,
                  stop=["\n"], seed=7, n=2, best_of=2, presence_penalty=0.5,
                  frequency_penalty=-1, logit_bias={"42": -100}, logprobs=3)
    assert worker_request(req) == {
        "model": MODEL, "prompt": [[1, 2], [3]], "max_tokens": 40, "temperature": 0.5,
        "top_p": 0.9, "stop": ["\n"], "seed": 7, "n": 2, "presence_penalty": 0.5,
        "frequency_penalty": -1, "logit_bias": {"42": -100}, "logprobs": True,
        "top_logprobs": 3, "stream": False}


def test_worker_request_logprobs_zero_still_asks_for_the_chosen_tokens():
    out = worker_request(request(logprobs=0))
    assert out["logprobs"] is True
    assert out["top_logprobs"] == 0


def bounds(req: CompletionRequest) -> tuple[int, int]:
    """The prompt bound the queen meters the worker's request by, and what its hold reserves
    for the completions (``max_tokens`` for each choice of each prompt)."""
    job = worker_request(req)
    return Meter.for_completions(job, 0).prompt_bound, job["max_tokens"] * choices_in(job)


def test_prompt_texts_bound_and_budget_cover_text_and_token_prompts():
    req = request(prompt=["héllo", "ab"], n=3, max_tokens=10)
    assert prompt_texts(req) == ["héllo", "ab"]
    assert bounds(req) == ((6 + 2) + (2 + 2), 10 * 3 * 2)  # UTF-8 bytes plus special tokens
    ids = request(prompt=[5, 6, 7])
    assert prompt_texts(ids) == ["   "]
    assert bounds(ids) == (3, 16)  # token ids are used as they are
    lists = request(prompt=[[5, 6], [7]], n=2)
    assert [len(t) for t in prompt_texts(lists)] == [2, 1]
    assert bounds(lists) == (3, 16 * 2 * 2)


def test_echo_with_token_id_prompts_is_refused_naming_why():
    assert echo_problem(request(echo=True)) is None
    assert echo_problem(request(prompt=[1, 2])) is None
    for prompt in ([1, 2], [[1], [2]]):
        problem = echo_problem(request(prompt=prompt, echo=True))
        assert problem is not None
        assert "'echo'" in problem
        assert "token ids" in problem
        with pytest.raises(ValueError, match="echo"):
            shaper(request(prompt=prompt, echo=True))


# --- streams ----------------------------------------------------------------------------------


def test_a_stream_becomes_text_chunks_one_choice_each_with_the_finish_last():
    s = shaper(request(stream=True))
    assert s.sse_done is True
    assert s.opening() == []
    events = stream(s, [chat(0, role=True, content=""), chat(0, content="Hel"),
                        chat(0, content="lo"), chat(0, finish="length")])
    assert [e["choices"][0]["text"] for e in events] == ["Hel", "lo", ""]
    assert [e["choices"][0]["finish_reason"] for e in events] == [None, None, "length"]
    assert all(e["choices"][0]["logprobs"] is None for e in events)
    assert list(events[0]) == ["id", "object", "created", "model", "choices"]
    assert list(events[0]["choices"][0]) == ["text", "index", "logprobs", "finish_reason"]


def test_unknown_finish_reasons_become_stop():
    s = shaper(request(stream=True))
    events = stream(s, [chat(0, content="x", finish="tool_calls")])
    assert events[0]["choices"][0]["finish_reason"] == "stop"
    assert events[0]["choices"][0]["text"] == "x"


def test_stream_logprobs_offsets_count_from_the_choice_start_across_chunks():
    s = shaper(request(stream=True, logprobs=1))
    events = stream(s, [
        chat(0, role=True, content=""),
        chat(0, content="Hi", logprobs=[entry("Hi", -0.1, [("Hi", -0.1)])]),
        chat(0, content=" é!", logprobs=[
            entry(" ", -0.2, [("x", -0.05)]),
            entry("\ufffd", -0.3, [("\ufffd", -0.3)], raw=[0xC3]),  # half of "é"
            entry("\ufffd", -0.4, [], raw=[0xA9]),  # its other half
            entry("!", -0.5, [("!", -0.5)])]),
        chat(0, finish="stop"),
    ])
    content = [sdk_chunk(e).choices[0].logprobs for e in events]
    assert content[0] is not None
    assert content[1] is not None
    assert content[0].tokens == ["Hi"]
    assert content[0].text_offset == [0]
    assert content[1].tokens == [" ", "\ufffd", "\ufffd", "!"]
    assert content[1].token_logprobs == [-0.2, -0.3, -0.4, -0.5]
    # " " at 2, both halves of "é" where it starts (3), "!" after it (4).
    assert content[1].text_offset == [2, 3, 3, 4]
    assert texts(events)[0][4] == "!"
    # The chosen token is always among the alternatives (up to logprobs + 1 of them).
    assert content[1].top_logprobs == [{"x": -0.05, " ": -0.2}, {"\ufffd": -0.3},
                                       {"\ufffd": -0.4}, {"!": -0.5}]
    # The finish chunk carries empty lists, not null, when logprobs were asked for.
    assert events[-1]["choices"][0]["logprobs"] == {
        "tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


def test_echo_puts_the_prompt_first_in_each_choices_first_chunk():
    s = shaper(request(prompt=["One:", "Two:"], n=2, echo=True, stream=True))
    chunks = []
    for index in range(4):
        chunks += [chat(index, role=True, content=""), chat(index, content=f" c{index}"),
                   chat(index, finish="stop")]
    events = stream(s, chunks)
    assert texts(events) == {0: "One: c0", 1: "One: c1", 2: "Two: c2", 3: "Two: c3"}
    firsts = [e["choices"][0] for e in events if e["choices"][0]["text"].endswith(":")]
    assert [(c["index"], c["text"]) for c in firsts] == [
        (0, "One:"), (1, "One:"), (2, "Two:"), (3, "Two:")]


def test_echo_comes_once_even_when_a_choice_starts_with_its_finish_or_is_resent():
    s = shaper(request(prompt="P", echo=True, stream=True))
    events = stream(s, [chat(0, finish="length")])
    assert events[0]["choices"][0] == {"text": "P", "index": 0, "logprobs": None,
                                       "finish_reason": "length"}
    s = shaper(request(prompt="P", echo=True, stream=True))
    # A failover twin opens the choice again: the prompt is not repeated.
    events = stream(s, [chat(0, role=True, content="a"), chat(0, role=True, content="b")])
    assert texts(events) == {0: "Pab"}


def test_logprobs_offsets_include_the_echoed_prompt():
    # The request model refuses echo with logprobs today; the shaper counts them right anyway.
    req = CompletionRequest.model_construct(model=MODEL, prompt="Say:", echo=True, logprobs=0,
                                            n=None, stream=True, stream_options=None)
    s = shaper(req)
    events = stream(s, [chat(0, role=True, content="", logprobs=[]),
                        chat(0, content=" hi", logprobs=[entry(" hi", -1.0)]),
                        chat(0, content=" yo", logprobs=[entry(" yo", -2.0)])])
    assert events[0]["choices"][0]["text"] == "Say:"
    assert events[0]["choices"][0]["logprobs"]["text_offset"] == []
    assert events[1]["choices"][0]["logprobs"]["text_offset"] == [4]
    assert events[2]["choices"][0]["logprobs"]["text_offset"] == [7]
    answer = STAMP.answer([{"index": 0, "finish_reason": "stop",
                            "message": {"role": "assistant", "content": " hi yo"},
                            "logprobs": {"content": [entry(" hi", -1.0), entry(" yo", -2.0)]}}])
    whole = Completion.model_validate(shaper(req).whole(answer))
    assert whole.choices[0].text == "Say: hi yo"
    assert whole.choices[0].logprobs is not None
    assert whole.choices[0].logprobs.text_offset == [4, 7]
    assert whole.choices[0].logprobs.top_logprobs == [{" hi": -1.0}, {" yo": -2.0}]


def test_several_prompts_and_n_keep_the_workers_choice_index():
    s = shaper(request(prompt=[[1, 2], [3]], n=2, stream=True))
    chunks = [chat(i, content=f"t{i}") for i in range(4)] + [chat(i, finish="stop")
                                                              for i in range(4)]
    events = stream(s, chunks)
    assert texts(events) == {0: "t0", 1: "t1", 2: "t2", 3: "t3"}


def test_a_chunk_of_several_choices_becomes_one_chunk_per_choice():
    s = shaper(request(n=2, stream=True))
    data = STAMP.stamp({"choices": [
        {"index": 0, "delta": {"content": "a"}, "finish_reason": None},
        {"index": 1, "delta": {"content": "b"}, "finish_reason": "stop"}]}, CHAT_CHUNK)
    events = stream(s, [data])
    assert [(e["choices"][0]["index"], e["choices"][0]["text"],
             e["choices"][0]["finish_reason"]) for e in events] == [(0, "a", None),
                                                                     (1, "b", "stop")]


def test_the_usage_chunk_comes_only_when_asked_for():
    usage = usage_counts(5, 7)
    asked = shaper(request(stream=True, stream_options={"include_usage": True}))
    [(name, data)] = asked.closing(usage)
    assert name is None
    assert data == {"id": CMPL_ID, "object": "text_completion", "created": CREATED,
                    "model": MODEL, "choices": [], "usage": usage}
    parsed = Completion.model_validate(data)
    assert parsed.usage is not None
    assert parsed.usage.total_tokens == 12
    assert shaper(request(stream=True)).closing(usage) == []
    assert shaper(request(stream=True, stream_options={"include_usage": False})).closing(
        usage) == []


def test_a_broken_stream_ends_with_the_error_body_as_one_data_event():
    error = {"error": {"message": "worker lost", "type": "server_error", "param": None,
                       "code": "worker_lost"}}
    assert shaper(request(stream=True)).failed(error) == [(None, error)]


# --- whole answers ----------------------------------------------------------------------------


def test_a_whole_answer_becomes_a_text_completion_with_usage():
    req = request(prompt=["A", "B"], n=2, echo=True)
    answer = STAMP.answer([
        {"index": 3, "finish_reason": "stop", "message": {"role": "assistant", "content": "d"}},
        {"index": 0, "finish_reason": "length",
         "message": {"role": "assistant", "content": "a"}},
        {"index": 1, "finish_reason": "stop", "message": {"role": "assistant", "content": ""}},
        {"index": 2, "finish_reason": "stop", "message": {"role": "assistant",
                                                          "content": None}},
    ])
    answer["usage"] = usage_counts(2, 3)
    out = shaper(req).whole(answer)
    parsed = Completion.model_validate(out)
    assert (parsed.id, parsed.object, parsed.created, parsed.model) == (
        CMPL_ID, "text_completion", CREATED, MODEL)
    assert [(c.index, c.text, c.finish_reason) for c in parsed.choices] == [
        (0, "Aa", "length"), (1, "A", "stop"), (2, "B", "stop"), (3, "Bd", "stop")]
    assert all(c.logprobs is None for c in parsed.choices)
    assert out["usage"] == usage_counts(2, 3)


def test_a_whole_answer_with_logprobs_translates_each_choice():
    req = request(prompt="Q", n=2, logprobs=2)
    answer = STAMP.answer([
        {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "ab"},
         "logprobs": {"content": [entry("a", -0.5, [("a", -0.5), ("b", -1.5)]),
                                  entry("b", -0.25, [("c", -0.1), ("b", -0.25)])]}},
        {"index": 1, "finish_reason": "length",
         "message": {"role": "assistant", "content": ""}, "logprobs": None},
    ])
    answer["usage"] = usage_counts(1, 2)
    parsed = Completion.model_validate(shaper(req).whole(answer))
    first, second = parsed.choices
    assert first.logprobs is not None
    assert second.logprobs is not None
    assert first.logprobs.tokens == ["a", "b"]
    assert first.logprobs.token_logprobs == [-0.5, -0.25]
    assert first.logprobs.top_logprobs == [{"a": -0.5, "b": -1.5}, {"c": -0.1, "b": -0.25}]
    assert first.logprobs.text_offset == [0, 1]  # no echo: from the completion's start
    assert second.logprobs.tokens == []
    assert second.finish_reason == "length"


def test_completion_logprobs_reads_tokens_without_bytes_and_keeps_the_likelier_duplicate():
    out = completion_logprobs([
        {"token": "ü", "logprob": -1.0, "bytes": None,
         "top_logprobs": [{"token": "x", "logprob": -0.5, "bytes": None},
                          {"token": "x", "logprob": -3.0, "bytes": None}]},
        {"token": "z", "logprob": -2.0, "top_logprobs": []},
    ], start=10)
    assert out["text_offset"] == [10, 11]
    assert out["top_logprobs"] == [{"x": -0.5, "ü": -1.0}, {"z": -2.0}]


# --- bad requests -----------------------------------------------------------------------------


def _fails(fields: dict[str, Any]) -> tuple[str | None, str]:
    with pytest.raises(ValidationError) as caught:
        request(**fields)
    first = caught.value.errors()[0]
    return param_name(first["loc"]), str(first["msg"])


@pytest.mark.parametrize(("fields", "param"), [
    ({"suffix": "}"}, "suffix"),
    ({"logprobs": 6}, "logprobs"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, -2]}, "prompt"),
    ({"prompt": [[1], [-2]]}, "prompt"),
    ({"prompt": ["a", ""]}, "prompt"),
    ({"n": 9}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
])
def test_bad_fields_fail_naming_the_field(fields: dict[str, Any], param: str):
    assert _fails(fields)[0] == param


@pytest.mark.parametrize(("fields", "named"), [
    ({"best_of": 3, "n": 1}, "'best_of'"),
    ({"best_of": 3}, "'best_of'"),
    ({"echo": True, "logprobs": 1}, "'echo'"),
])
def test_inconsistent_fields_fail_with_a_message_naming_them(fields: dict[str, Any], named: str):
    # A model-level check: pydantic gives no location, the message names the field.
    assert named in _fails(fields)[1]
