"""Bounded memory per job, on the link machine with no sockets: what a worker may send for one
job is tied to the job's ``max_tokens``; a chunk past what is left, or one huge chunk, fails the
job (retryable) and counts a bad frame, and the job's mailbox never holds more than its budget."""

from __future__ import annotations

import time

import pytest

from queen_server.swarm.jobs import (
    ANSWER_TOO_LARGE,
    BUDGET_SLACK_CHARS,
    DEFAULT_MAX_TOKENS,
    FRAME_CHARS_PER_TOKEN,
    MAX_CHUNK_CHARS,
    TOKEN_PIECE_BYTES,
    JobHandle,
    answer_budget,
    completion_limit,
)
from queen_server.swarm.link import NOTHING
from shared_schema import Chunk, JobError, Result, Usage, encode
from shared_schema.answers import checkpoint_chunk
from tests.queen_server.swarm.test_link import MODEL, USAGE, admitted, sent


def leased(leases: dict[str, JobHandle], job_id: str, openai_req: dict) -> JobHandle:
    handle = JobHandle(job_id, MODEL, "k", 0.0, budget=answer_budget(openai_req))
    leases[job_id] = handle
    return handle


def token_chunk(job_id: str, seq: int, content: str, *, model: str = "") -> str:
    """A chunk frame as an honest streaming worker sends it: one token, llama.cpp's fields."""
    data = {"id": "chatcmpl-" + "x" * 36, "object": "chat.completion.chunk",
            "created": 1_700_000_000, "model": model or "/home/someone/models/" + "m" * 80,
            "choices": [{"index": 0, "delta": {"content": content}, "logprobs": None,
                         "finish_reason": None}]}
    return encode(Chunk(id=job_id, seq=seq, data=data))


# --- the budget -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("req", "tokens"), [
    ({"max_tokens": 10}, 10),
    ({"max_completion_tokens": 7, "max_tokens": 99}, 7),  # as the worker reads them
    ({}, 4096),
    ({"max_tokens": None}, 4096),
    ({"max_tokens": True}, 4096),  # not a count
])
def test_the_completion_limit_is_the_requests_or_the_default(req, tokens):
    assert completion_limit(req, 4096) == tokens
    assert answer_budget(req, 4096).chars == tokens * FRAME_CHARS_PER_TOKEN + BUDGET_SLACK_CHARS


def test_a_handle_made_without_a_budget_gets_the_default_one():
    handle = JobHandle("j", MODEL, "k", 0.0)
    assert handle.budget == answer_budget({}, DEFAULT_MAX_TOKENS).chars
    assert handle.room == handle.budget
    assert handle.chunk_cap == MAX_CHUNK_CHARS


def test_the_per_token_allowance_holds_the_longest_piece_escaped_in_an_honest_frame():
    """The worst honest token: the longest piece, every byte a control character (escaped six
    characters each), in a frame with a long model path and ids."""
    piece = "\x01" * TOKEN_PIECE_BYTES
    frame = token_chunk("chatcmpl-" + "y" * 40 + ".3", 123456, piece, model="/m/" + "n" * 400)
    assert len(frame) <= FRAME_CHARS_PER_TOKEN


# --- chunks charged against it --------------------------------------------------------------------


def test_an_honest_answer_at_its_max_tokens_fits_even_if_nobody_reads_it():
    """A slow client: every chunk of a full-length honest answer waits in the deque, and the job
    is not failed (the limit is never hit within max_tokens)."""
    link, leases = admitted()
    handle = leased(leases, "j1", {"max_tokens": 500})
    for seq in range(500):
        assert link.receive(token_chunk("j1", seq, "\x01" * TOKEN_PIECE_BYTES), 1.0) == NOTHING
    finish = encode(Chunk(id="j1", seq=500, data={"choices": [
        {"index": 0, "delta": {}, "finish_reason": "length"}]}))
    assert link.receive(finish, 1.0) == NOTHING
    assert link.receive(encode(Result(id="j1", usage=USAGE)), 1.0) == NOTHING
    events = handle.take_ready()
    assert len(events) == 502
    assert isinstance(events[-1], Result)
    assert link.bad_frames == 0
    assert 0 < handle.room < handle.budget


def test_chunks_past_the_jobs_budget_fail_it_and_count_a_bad_frame():
    link, leases = admitted()
    handle = leased(leases, "j1", {"max_tokens": 2})
    big = "a" * (FRAME_CHARS_PER_TOKEN * 10)  # each chunk fits the per-chunk cap
    charged = 0
    seq = 0
    while True:
        frame = token_chunk("j1", seq, big)
        actions = link.receive(frame, 1.0)
        if actions:
            break
        charged += len(frame)
        seq += 1
    assert charged <= handle.budget < charged + len(frame)
    [error, cancel] = sent(actions)
    assert (error["code"], error["id"]) == (ANSWER_TOO_LARGE, "j1")
    # the worker is told to stop the job too, or its slot stays busy with an unread answer
    assert (cancel["type"], cancel["id"], cancel["reason"]) == ("cancel", "j1", ANSWER_TOO_LARGE)
    assert link.bad_frames == 1
    events = handle.take_ready()
    assert all(isinstance(event, Chunk) for event in events[:-1])
    assert len(events) == seq + 1
    failed = events[-1]
    assert isinstance(failed, JobError)
    assert (failed.code, failed.retryable) == (ANSWER_TOO_LARGE, True)
    assert handle.finished
    # what the worker sends for it afterwards is an unknown job's: answered, not counted
    [late] = sent(link.receive(token_chunk("j1", seq + 1, "x"), 1.0))
    assert late["code"] == "unknown_job"
    assert link.bad_frames == 1


def test_one_huge_chunk_fails_the_job_at_once_whatever_its_budget():
    link, leases = admitted()
    handle = leased(leases, "j1", {"max_tokens": 1_000_000})  # a budget of gigabytes
    assert handle.budget > 16 * MAX_CHUNK_CHARS
    [error, _cancel] = sent(link.receive(token_chunk("j1", 0, "a" * MAX_CHUNK_CHARS), 1.0))
    assert error["code"] == ANSWER_TOO_LARGE
    assert link.bad_frames == 1
    [failed] = handle.take_ready()  # the chunk itself is not kept
    assert isinstance(failed, JobError)
    assert failed.retryable


def test_a_chunk_is_capped_by_a_small_budget_too():
    link, leases = admitted()
    handle = leased(leases, "j1", {"max_tokens": 1})
    assert handle.chunk_cap == handle.budget < MAX_CHUNK_CHARS
    [error, _cancel] = sent(link.receive(token_chunk("j1", 0, "a" * handle.budget), 1.0))
    assert error["code"] == ANSWER_TOO_LARGE


def test_budgets_are_per_job():
    link, leases = admitted(max_bad_frames=10)
    small = leased(leases, "j1", {"max_tokens": 1})
    other = leased(leases, "j2", {"max_tokens": 1})
    sent(link.receive(token_chunk("j1", 0, "a" * small.budget), 1.0))
    assert small.finished
    assert not other.finished
    assert link.receive(token_chunk("j2", 0, "hello"), 1.0) == NOTHING
    [chunk] = other.take_ready()
    assert isinstance(chunk, Chunk)


def test_checkpoints_of_a_plain_answer_fit_its_budget():
    """A plain answer sends its text in checkpoints (none repeats another) and then whole."""
    link, leases = admitted()
    handle = leased(leases, "j1", {"max_tokens": 300})
    pieces = ["\x01" * TOKEN_PIECE_BYTES] * 100
    for seq in range(3):
        frame = encode(Chunk(id="j1", seq=seq, data=checkpoint_chunk(pieces)))
        assert link.receive(frame, 1.0) == NOTHING
    text = "".join(pieces) * 3
    result = Result(id="j1", usage=USAGE, data={"choices": [
        {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}]})
    assert link.receive(encode(result), 1.0) == NOTHING
    assert link.bad_frames == 0
    assert isinstance(handle.take_ready()[-1], Result)


# --- results --------------------------------------------------------------------------------------


def test_a_whole_answer_larger_than_the_budget_fails_the_job():
    link, leases = admitted()
    handle = leased(leases, "j1", {"max_tokens": 3})
    result = Result(id="j1", usage=USAGE, data={"choices": [
        {"index": 0, "finish_reason": "stop",
         "message": {"role": "assistant", "content": "a" * handle.budget}}]})
    [error, _cancel] = sent(link.receive(encode(result), 1.0))
    assert error["code"] == ANSWER_TOO_LARGE
    assert link.bad_frames == 1
    [failed] = handle.take_ready()
    assert isinstance(failed, JobError)
    assert failed.code == ANSWER_TOO_LARGE
    assert failed.retryable


def test_an_embeddings_result_is_not_held_to_a_chat_budget():
    link, leases = admitted()
    handle = leased(leases, "embd-1", {"max_tokens": 1})  # even a tiny one
    vectors = [{"object": "embedding", "index": i, "embedding": [0.125] * 4096}
               for i in range(60)]
    frame = encode(Result(id="embd-1", data={"object": "list", "data": vectors},
                          usage=Usage(prompt_tokens=60, total_tokens=60)))
    assert len(frame) > handle.budget
    assert link.receive(frame, 1.0) == NOTHING
    [result] = handle.take_ready()
    assert isinstance(result, Result)


def test_a_legacy_answer_larger_than_the_budget_fails_the_job():
    link, leases = admitted(v1=False)
    handle = leased(leases, "job-1", {"max_tokens": 1})
    body = ('{"choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant",'
            f' "content": "{"a" * handle.budget}"}}}}]}}')
    assert link.receive(body, 1.0) == NOTHING  # a legacy worker is never answered
    assert link.bad_frames == 1
    [failed] = handle.take_ready()
    assert isinstance(failed, JobError)
    assert failed.code == ANSWER_TOO_LARGE
    assert failed.retryable


# --- cost -----------------------------------------------------------------------------------------


def test_the_charge_adds_little_to_a_streamed_token():
    """Micro-benchmark: a streamed token through the link with and without the charge (a
    handle's budget set so large the check never fails is still the same code path; the
    difference against a plain ``answer_problem`` call is what the charge costs). Generous: it
    only fails if the charge became something other than O(1) per frame."""
    link, leases = admitted()
    handle = leased(leases, "j1", {"max_tokens": 10_000_000})
    frame = token_chunk("j1", 0, " token")
    n = 20_000
    started = time.perf_counter()
    for _ in range(n):
        link.receive(frame, 1.0)
        handle.take_ready()
    per_frame = (time.perf_counter() - started) / n
    assert link.bad_frames == 0
    assert handle.budget - handle.room == n * len(frame)
    assert per_frame < 200e-6  # decode + check + feed; the charge itself is a few bytecodes
