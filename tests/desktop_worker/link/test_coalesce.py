"""The worker's rule for joining streamed chunks (``desktop_worker.link.coalesce``) and the link
machine's use of it: one frame in flight per job, what waited meanwhile goes as one frame, only
to a queen whose welcome says it reads ``Chunk.tokens``."""

from __future__ import annotations

from typing import Any

from desktop_worker.link.coalesce import Coalescer
from desktop_worker.link.machine import Link, Send
from shared_schema import Challenge, Chunk, Hello, Job, Usage, Welcome, decode, encode
from tests.support.workers import new_key, signed_hello

CHUNK = "chat.completion.chunk"


def text(word: str, index: int = 0, logprobs: list[Any] | None = None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": index, "delta": {"content": word}}
    if logprobs is not None:
        choice["logprobs"] = {"content": logprobs}
    choice["finish_reason"] = None
    return {"object": CHUNK, "choices": [choice]}


def opening(word: str) -> dict[str, Any]:
    return {"object": CHUNK, "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                "content": word},
                                          "finish_reason": None}]}


def finish(reason: str = "stop", index: int = 0) -> dict[str, Any]:
    return {"object": CHUNK, "choices": [{"index": index, "delta": {},
                                          "finish_reason": reason}]}


def frames(out: Coalescer) -> list[tuple[dict[str, Any], int]]:
    return out.drain()


def joined_text(data: dict[str, Any]) -> str:
    return "".join((c.get("delta") or {}).get("content") or "" for c in data["choices"])


def test_text_made_while_a_frame_is_sent_goes_as_one_frame():
    out = Coalescer()
    for word in ["a", " b", " c"]:
        out.add(text(word))
    [(data, tokens)] = frames(out)
    assert tokens == 3
    assert data == text("a b c")  # the same shape, key order included


def test_a_lone_chunk_goes_unchanged():
    out = Coalescer()
    chunk = text("a")
    out.add(chunk)
    assert out.next_frame() == (chunk, 1)
    assert out.next_frame() is None
    assert len(out) == 0


def test_role_and_finish_are_frames_of_their_own_and_never_joined_across():
    out = Coalescer()
    for chunk in [opening("Hi"), text(" there"), text(","), finish(), text("late")]:
        out.add(chunk)
    got = frames(out)
    assert [tokens for _, tokens in got] == [1, 2, 1, 1]
    assert got[0][0] == opening("Hi")
    assert got[1][0] == text(" there,")
    assert got[2][0] == finish()
    assert got[3][0] == text("late")
    # the text the client reads, in order, is the same
    assert "".join(joined_text(d) for d, _ in got) == "Hi there,late"


def test_choices_are_never_joined_with_each_other():
    out = Coalescer()
    for chunk in [text("a", 0), text("b", 1), text("c", 1), text("d", 0)]:
        out.add(chunk)
    got = frames(out)
    assert [(d["choices"][0]["index"], joined_text(d), n) for d, n in got] == [
        (0, "a", 1), (1, "bc", 2), (0, "d", 1)]


def test_logprobs_are_joined_with_their_text_and_never_mixed_with_plain_text():
    first = [{"token": "a", "logprob": -0.1}]
    out = Coalescer()
    out.add(text("a", logprobs=first))
    out.add(text("b", logprobs=[{"token": "b", "logprob": -0.2}]))
    out.add(text("c"))  # no logprobs: a frame of its own
    got = frames(out)
    assert got[0] == (text("ab", logprobs=[{"token": "a", "logprob": -0.1},
                                           {"token": "b", "logprob": -0.2}]), 2)
    assert first == [{"token": "a", "logprob": -0.1}]  # the engine's own list is not grown
    assert got[1] == (text("c"), 1)


def test_unknown_fields_tool_calls_usage_and_empty_text_are_never_joined():
    odd = [
        {"object": CHUNK, "choices": [{"index": 0, "delta": {"content": "x"}}], "usage": {}},
        {"object": CHUNK, "choices": [{"index": 0, "delta": {"tool_calls": []}}]},
        {"object": CHUNK, "choices": [{"index": 0, "delta": {"content": "x", "refusal": "no"}}]},
        {"object": CHUNK, "choices": [{"index": 0, "delta": {"content": "x"}, "extra": 1}]},
        {"object": CHUNK, "choices": [{"index": 0, "delta": {"content": ""}}]},
        {"object": CHUNK, "choices": [{"index": 0, "delta": {"content": 5}}]},
        {"object": CHUNK, "choices": [{"index": "0", "delta": {"content": "x"}}]},
        {"object": CHUNK, "choices": [{"index": 0, "delta": {"content": "x"},
                                       "logprobs": {"content": [], "refusal": []}}]},
        {"object": CHUNK, "choices": []},
        {"object": CHUNK, "choices": "nope"},
        {"object": "other", "choices": [{"index": 0, "delta": {"content": "x"}}]},
        {"object": CHUNK, "model": "m", "choices": [{"index": 0, "delta": {"content": "x"}}]},
        {"choices": [{"index": 0, "delta": {"content": "x"}}]},
    ]
    for chunk in odd:
        out = Coalescer()
        out.add(text("a"))
        out.add(chunk)
        out.add(text("b"))
        got = frames(out)
        assert [n for _, n in got] == [1, 1, 1], chunk
        assert got[1][0] is chunk


def test_fields_beside_the_choices_must_match_to_join():
    out = Coalescer()
    for word in "abc":
        out.add({**text(word), "model": "m", "id": "x"})
    out.add({**text("d"), "model": "other", "id": "x"})
    got = frames(out)
    assert got[0] == ({**text("abc"), "model": "m", "id": "x"}, 3)
    assert got[1][1] == 1


def test_a_joined_frame_is_capped_in_tokens_and_characters():
    out = Coalescer(max_tokens=4, max_chars=1000)
    for _ in range(10):
        out.add(text("x"))
    assert [n for _, n in frames(out)] == [4, 4, 2]
    out = Coalescer(max_tokens=100, max_chars=10)
    for _ in range(7):
        out.add(text("abcd"))
    got = frames(out)
    assert [(joined_text(d), n) for d, n in got] == [("abcdabcd", 2)] * 3 + [("abcd", 1)]
    assert all(len(joined_text(d)) <= 10 for d, _ in got)


def test_max_tokens_one_joins_nothing():
    out = Coalescer(max_tokens=1)
    for word in "abc":
        out.add(text(word))
    assert [(joined_text(d), n) for d, n in frames(out)] == [("a", 1), ("b", 1), ("c", 1)]


def test_a_frame_taken_is_not_joined_into_any_more():
    out = Coalescer()
    out.add(text("a"))
    data, _ = out.next_frame()
    out.add(text("b"))
    assert data == text("a")
    assert out.next_frame() == (text("b"), 1)


# --- the link machine ---------------------------------------------------------------------


def _ready(chunk_tokens: int | None, *, join_tokens: int = 32) -> Link:
    key = new_key()

    def hello_for(nonce: str, origin: str) -> Hello:
        return signed_hello(key, nonce, models=[], origin=origin)

    link = Link(hello_for, 2, "https://queen.example", join_tokens=join_tokens)
    link.receive(encode(Challenge(nonce="ab" * 16)))
    link.receive(encode(Welcome(session_id="s", worker_id="w", heartbeat_interval_s=15,
                                chunk_tokens=chunk_tokens)))
    link.receive(encode(Job(id="a", openai_url="/v1/chat/completions",
                            openai_req={"stream": True})))
    return link


def _chunks(actions: list[Any]) -> list[Chunk]:
    out = []
    for action in actions:
        assert isinstance(action, Send)
        message = decode(action.frame)
        if isinstance(message, Chunk):
            out.append(message)
    return out


def test_the_machine_joins_what_waited_while_a_frame_was_sent():
    link = _ready(chunk_tokens=4096)
    [first] = _chunks(link.chunk("a", opening("Hi")))
    for word in [" a", " b", " c"]:
        assert link.chunk("a", text(word)) == []
    [second] = _chunks(link.chunk_sent("a"))
    assert link.chunk_sent("a") == []
    [third] = _chunks(link.chunk("a", text(" d")))  # idle again: out at once, alone
    assert [(c.seq, c.tokens, joined_text(c.data)) for c in (first, second, third)] == [
        (0, 1, "Hi"), (1, 3, " a b c"), (2, 1, " d")]


def test_the_worker_and_the_queen_caps_both_hold():
    link = _ready(chunk_tokens=2, join_tokens=32)  # the queen's cap is lower
    assert link.chunk_tokens == 2
    link.chunk("a", text("x"))
    for _ in range(5):
        link.chunk("a", text("y"))
    sent = []
    while actions := link.chunk_sent("a"):
        sent += _chunks(actions)
    assert [c.tokens for c in sent] == [2, 2, 1]
    assert _ready(chunk_tokens=4096, join_tokens=3).chunk_tokens == 3


def test_an_older_queen_gets_one_frame_per_chunk():
    link = _ready(chunk_tokens=None)  # its welcome does not name chunk_tokens
    assert link.chunk_tokens == 1
    link.chunk("a", text("x"))
    for word in "yz":
        link.chunk("a", text(word))
    sent = []
    while actions := link.chunk_sent("a"):
        sent += _chunks(actions)
    assert [(c.seq, c.tokens, joined_text(c.data)) for c in sent] == [(1, 1, "y"), (2, 1, "z")]


def test_the_result_goes_after_every_waiting_chunk_in_order():
    link = _ready(chunk_tokens=4096)
    link.chunk("a", opening("Hi"))  # being sent
    link.chunk("a", text(" there"))
    link.chunk("a", finish())
    actions = link.result("a", {}, Usage(prompt_tokens=1, completion_tokens=2, total_tokens=3))
    messages = [decode(a.frame) for a in actions]
    assert [(m.type, getattr(m, "seq", None)) for m in messages] == [
        ("chunk", 1), ("chunk", 2), ("result", None)]
    assert messages[1].data == finish()
    assert link.chunk_sent("a") == []  # the pump finds nothing more: the job is over
    assert link.chunk("a", text("late")) == []


def test_an_error_also_sends_what_waited_and_a_lost_connection_forgets_it():
    link = _ready(chunk_tokens=4096)
    link.chunk("a", text("x"))
    link.chunk("a", text("y"))
    messages = [decode(a.frame) for a in link.error("a", "cancelled", "bye", False)]
    assert [m.type for m in messages] == ["chunk", "error"]
    link = _ready(chunk_tokens=4096)
    link.chunk("a", text("x"))
    link.chunk("a", text("y"))
    link.connection_lost()
    assert link.chunk_sent("a") == []
