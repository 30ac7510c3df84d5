"""CallStream: streamed call-format JSON -> OpenAI chat deltas, however the text is split."""

from __future__ import annotations

import itertools
import json
import random
import re
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from queen_server.shaping import tools

WEATHER = {"type": "function", "function": {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
GET = {"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}
PLAN = tools.plan([WEATHER, GET], "auto", None)
CALL_ID = re.compile(r"^call_[0-9a-f]{24}$")

# Prose with escapes of every kind, a surrogate pair, raw non-ASCII and call-format look-alikes.
PROSE = (r'Say \"hi\"\n\t\\ \/ \u00e9\ud83d\ude00 \b\f\r' + 'caf\u00e9 \U0001f41d '
         + r'{\"tool_calls\": [{\"name\": \"get\"}]}')
PROSE_TEXT = json.loads(f'"{PROSE}"')
# Arguments that look like the end of a call, a name that is a prefix of another.
HOSTILE = ('{"tool_calls": [{"name": "get", "arguments": {"q": "\\"}]}", "t": "a\\n\\"}]",'
           ' "n": [1, {"a": "]"}],'
           ' "e": "\\\\", "u": "\\ud83d\\ude00\u00e9"}}, {"name": "get_weather", "arguments": '
           '{"city": "}{][\\""}}]}')


@dataclass
class Replay:
    """What a client (the openai SDK) builds from the deltas."""

    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)
    reason: str = ""
    deltas: list[dict[str, Any]] = field(default_factory=list)

    def take(self, deltas: list[dict[str, Any]]) -> None:
        for delta in deltas:
            self.deltas.append(delta)
            assert len(delta) == 1, delta
            if "content" in delta:
                assert isinstance(delta["content"], str)
                assert delta["content"]
                self.content += delta["content"]
                continue
            [item] = delta["tool_calls"]
            if "id" in item:
                assert item["index"] == len(self.calls)
                assert CALL_ID.match(item["id"])
                assert item["type"] == "function"
                assert item["function"]["arguments"] == ""
                self.calls.append({"id": item["id"], "name": item["function"]["name"],
                                   "arguments": ""})
            else:
                assert set(item) == {"index", "function"}
                assert set(item["function"]) == {"arguments"}
                assert item["function"]["arguments"]
                self.calls[item["index"]]["arguments"] += item["function"]["arguments"]


def replay(pieces: list[str], reason: str = "stop", plan: tools.ToolPlan | None = PLAN) -> Replay:
    stream = tools.CallStream(plan)
    out = Replay()
    for piece in pieces:
        out.take(stream.feed(piece))
    last, out.reason = stream.finish(reason)
    out.take(last)
    return out


def split(text: str, cuts: list[int]) -> list[str]:
    edges = [0, *sorted(cuts), len(text)]
    return [text[a:b] for a, b in itertools.pairwise(edges)]


def outcome(result: Replay) -> tuple[str, list[tuple[str, Any]], str]:
    return (result.content,
            [(c["name"], json.loads(c["arguments"])) for c in result.calls], result.reason)


def test_prose_streams_decoded_at_every_split_point():
    text = '{"content": "' + PROSE + '"}'
    for cut in range(len(text) + 1):
        result = replay(split(text, [cut]))
        assert (result.content, result.calls, result.reason) == (PROSE_TEXT, [], "stop"), cut


def test_hostile_calls_at_every_split_point_and_pair_of_split_points():
    text = HOSTILE
    whole = outcome(replay([text]))
    assert whole == ("", [("get", json.loads(text)["tool_calls"][0]["arguments"]),
                          ("get_weather", {"city": '}{]["'})], "tool_calls")
    for a in range(len(text) + 1):
        assert outcome(replay(split(text, [a]))) == whole, a
        for b in range(a, len(text) + 1, 7):
            assert outcome(replay(split(text, [a, b]))) == whole, (a, b)


def test_one_character_at_a_time_and_random_splits():
    texts = [HOSTILE, '{"content": "' + PROSE + '"}',
             '{ "tool_calls" : [ { "name" : "get" , "arguments" : { } } ] } ']
    rng = random.Random(15)
    for text in texts:
        whole = outcome(replay([text]))
        assert outcome(replay(list(text))) == whole
        for _ in range(200):
            cuts = rng.sample(range(len(text)), rng.randint(1, 12))
            assert outcome(replay(split(text, cuts))) == whole


def test_the_stream_and_the_whole_answer_agree():
    assert PLAN is not None
    for text, reason in [(HOSTILE, "stop"), ('{"content": "' + PROSE + '"}', "stop"),
                         (HOSTILE[:70], "length")]:
        streamed = replay(list(text), reason)
        message, whole_reason = tools.answer_message(text, PLAN, reason)
        assert whole_reason == streamed.reason
        assert (message["content"] or "") == streamed.content
        complete = [c for c in streamed.calls if _loads(c["arguments"])]
        assert [(c["function"]["name"], c["function"]["arguments"])
                for c in message.get("tool_calls", [])] == [
            (c["name"], c["arguments"]) for c in complete]


def _loads(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def test_deltas_come_as_soon_as_they_can():
    stream = tools.CallStream(PLAN)
    assert stream.feed('{"content": "He') == [{"content": "He"}]
    assert stream.feed("llo\\") == [{"content": "llo"}]  # the escape waits for its letter
    assert stream.feed("n\\ud83d") == [{"content": "\n"}]  # a high surrogate waits for its pair
    assert stream.feed("\\ude00!") == [{"content": "\U0001f600!"}]
    assert stream.finish("stop") == ([], "stop")

    stream = tools.CallStream(PLAN)
    assert stream.feed('{"tool_calls": [{"name": "get') == []  # "get" or "get_weather"?
    [header] = stream.feed('_weather", "argu')
    assert header["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert stream.feed('ments": {"ci') == [
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"ci'}}]}]
    fragment, second = stream.feed('ty": "Oslo"}}, {"name": "get"')
    assert fragment == {"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Oslo"}'}}]}
    assert second["tool_calls"][0]["index"] == 1
    assert second["tool_calls"][0]["function"] == {"name": "get", "arguments": ""}
    assert stream.feed(', "arguments": {"a"') == [
        {"tool_calls": [{"index": 1, "function": {"arguments": '{"a"'}}]}]
    deltas, reason = stream.finish("length")
    assert (deltas, reason) == ([], "length")  # cut off: the calls so far, and "length"


def test_a_cut_off_call_ends_with_the_workers_reason():
    result = replay([HOSTILE[:60]], "length")
    assert result.reason == "length"
    assert [c["name"] for c in result.calls] == ["get"]
    result = replay(['{"content": "abc'], "length")
    assert (result.content, result.reason) == ("abc", "length")


def test_a_call_without_arguments_takes_none():
    result = replay(['{"tool_calls": [{"name": "get"}]}'])
    assert (result.calls[0]["arguments"], result.reason) == ("{}", "tool_calls")


def test_ids_are_unique_in_an_answer():
    call = '{"name": "get", "arguments": {}}'
    result = replay(['{"tool_calls": [' + ", ".join([call] * 50) + "]}"])
    assert len({c["id"] for c in result.calls}) == 50


def test_text_that_is_not_json_passes_through_as_prose():
    result = replay(["  plain ", '{"a": 1}', " end"])
    assert (result.content, result.calls, result.reason) == ('plain {"a": 1} end', [], "stop")
    assert replay([]).content == ""


def test_text_after_the_answer_is_ignored():
    result = replay(['{"content": "a"}', ' {"content": "b"}'])
    assert result.content == "a"


def test_lone_surrogates_become_replacement_characters():
    result = replay(['{"content": "\\ud83d x \\ude00 \\ud83d\\ud83d\\ude00 \\ud83d"}'])
    assert result.content == "\ufffd x \ufffd \ufffd\U0001f600 \ufffd"


def test_a_plan_less_stream_reads_calls_too():
    result = replay(['{"tool_calls": [{"name": "x", "arguments": {"y": 1}}]}'], plan=None)
    assert outcome(result) == ("", [("x", {"y": 1})], "tool_calls")


def test_a_long_answer_fed_a_character_at_a_time_reads_whole():
    """200k one-character pieces: a reader that re-read from the start per piece would take
    10^10 steps and never finish inside the test's timeout (no clock is read here)."""
    big = "x" * 200_000
    stream = tools.CallStream(PLAN)
    prose = []
    for char in '{"content": "' + big + '"}':
        prose.extend(delta.get("content", "") for delta in stream.feed(char))
    assert "".join(prose) == big
    stream = tools.CallStream(PLAN)
    arguments = '{"q": "' + big + '", "n": [' + ", ".join(["1"] * 20_000) + "]}"
    fragments = []
    for char in '{"tool_calls": [{"name": "get", "arguments": ' + arguments + "}]}":
        for delta in stream.feed(char):
            for call in delta.get("tool_calls", []):
                fragments.append(call["function"]["arguments"])
    assert "".join(fragments) == arguments


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(st.characters(exclude_categories=["Cs"])),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.text(st.characters(exclude_categories=["Cs"]), max_size=8), inner, max_size=4),
    max_leaves=12)
ARGUMENTS = st.dictionaries(st.text(max_size=8), JSON_VALUES, max_size=5)


@settings(max_examples=150, deadline=None)
@given(prose=st.none() | st.text(st.characters(exclude_categories=["Cs"])),
       calls=st.lists(st.tuples(st.sampled_from(["get", "get_weather"]), ARGUMENTS),
                      min_size=1, max_size=3),
       ascii_only=st.booleans(), compact=st.booleans(), data=st.data())
def test_any_answer_any_split(prose, calls, ascii_only, compact, data):
    separators = (",", ":") if compact else (", ", ": ")
    answer: dict[str, Any] = (
        {"content": prose} if prose is not None else
        {"tool_calls": [{"name": name, "arguments": args} for name, args in calls]})
    text = json.dumps(answer, ensure_ascii=ascii_only, separators=separators)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=10))
    result = replay(split(text, cuts))
    if prose is not None:
        assert (result.content, result.calls, result.reason) == (prose, [], "stop")
    else:
        assert result.content == ""
        assert [(c["name"], json.loads(c["arguments"])) for c in result.calls] == calls
        assert result.reason == "tool_calls"


@pytest.mark.parametrize("reason", ["stop", "length"])
def test_a_complete_answer_with_calls_is_tool_calls(reason):
    assert replay(['{"tool_calls": [{"name": "get", "arguments": {}}]}'], reason).reason == (
        "tool_calls")
