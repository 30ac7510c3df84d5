"""A worker stuffing log probabilities (issue 34), against a real queen over real sockets.

The hostile worker answers each word of the echo with as many log-probability entries as the
link's shape checks let through (one per byte of the word and one more, each with the asked
alternatives and one more, every token and bytes list as long as allowed). Each chunk is far
past what an honest token costs, so the job fails at its budget (``answer_too_large``,
retryable, and the worker is told to stop): the client gets the answer from an honest twin that
continues it, or a clean error when there is none; what the queen kept of the hostile part
stays within the job's budget.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import httpx
import pytest

from queen_server.swarm.jobs import ANSWER_TOO_LARGE, answer_budget
from shared_schema import Chunk, Job, encode
from shared_schema.answers import LOGPROB_ENTRY_WEIGHT, LOGPROB_TOKEN_BYTES, LOGPROB_TOKEN_CHARS
from tests.support.queen import running_queen
from tests.support.workers import ECHO_MODEL, ScriptedWorker, echo_words

WORDS = " ".join(f"word{i:02d}" for i in range(30))
REQUEST = {"model": ECHO_MODEL, "messages": [{"role": "user", "content": WORDS}],
           "max_tokens": 40, "logprobs": True, "top_logprobs": 2}

LOGPROBS = ["logprobs"]  # the capability a worker needs to be given such a job

pytestmark = pytest.mark.timeout(120)


class StuffingWorker(ScriptedWorker):
    """Streams the echo a word a chunk, each stuffed with log probabilities, until the queen
    cancels the job; its first chunk is honest, and the rest wait for ``release``. ``shape``:
    ``widest``, the most the shape checks allow (an entry per byte and one more, each with the
    asked alternatives and one more, tokens and bytes lists as long as allowed); ``most``,
    thousands of the smallest entries (25 characters, some 190 bytes decoded) beside a word."""

    def __init__(self, *args: Any, shape: str = "widest", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.shape = shape
        self.chunks_sent = 0

    def stuffing(self, word: str, top: int) -> list[dict[str, Any]]:
        if self.shape == "most":
            tiny = {"token": "", "logprob": 0}
            return [{**tiny, "top_logprobs": [tiny] * (top + 1)}] * 2000
        big = {"token": "\x01" * LOGPROB_TOKEN_CHARS, "logprob": -1.0,
               "bytes": [1] * LOGPROB_TOKEN_BYTES}
        return [{**big, "top_logprobs": [big] * (top + 1)}] * (len(word.encode()) + 1)

    async def _run(self, job: Job) -> None:
        top = job.openai_req.get("top_logprobs") or 0
        for seq, word in enumerate(echo_words(job.openai_req)):
            if self.cancelled.is_set():
                return
            delta: dict[str, Any] = {"content": word}
            if seq == 0:
                delta["role"] = "assistant"
            entries = self.stuffing(word, top) if seq else []  # the first one honest
            data = {"choices": [{"index": 0, "delta": delta, "finish_reason": None,
                                 "logprobs": {"content": entries}}]}
            await self.send_raw(encode(Chunk(id=job.id, seq=seq, data=data)))
            self.chunks_sent += 1
            if seq == 0:
                await self.release.wait()
            await asyncio.sleep(0)  # the queen's cancel is read between chunks


def deep_bytes(value: object) -> int:
    """The memory a decoded JSON value holds (each object counted once)."""
    seen: set[int] = set()
    stack, total = [value], 0
    while stack:
        item = stack.pop()
        if id(item) not in seen:
            seen.add(id(item))
            total += sys.getsizeof(item)
            stack.extend(item.values() if isinstance(item, dict)
                         else item if isinstance(item, list) else ())
    return total


def kept_within_budget(answer: dict[str, Any]) -> None:
    """What the queen kept of the stuffed part (and relayed with the answer), decoded, is
    within the job's budget: the weight it charged covers it."""
    budget = answer_budget(REQUEST).chars
    entries = answer["choices"][0]["logprobs"]["content"]
    assert len(entries) * LOGPROB_ENTRY_WEIGHT < budget
    assert deep_bytes(entries) < budget


@pytest.mark.parametrize(("shape", "refusal"), [
    ("widest", ANSWER_TOO_LARGE),  # within the shape checks: fails at the budget
    ("most", "invalid_message"),  # more entries than a word's bytes: refused at once
])
async def test_a_stuffing_worker_fails_its_job_and_a_twin_finishes_the_answer(
        tmp_path, shape, refusal):
    # Heartbeats every 5 s, not the harness's 0.5 s: decoding the stuffed frames takes the
    # loop (queen and workers share it here) long enough on a loaded machine that a twin could
    # miss a beat, which is not what this test is about.
    async with running_queen(tmp_path, total_timeout_s=30.0, heartbeat_interval_s=5.0) as queen:
        hostile = await StuffingWorker(queen.ws_url, continues=True, capabilities=LOGPROBS,
                                       shape=shape).start()
        twin: ScriptedWorker | None = None
        try:
            async with httpx.AsyncClient(base_url=queen.base_url, timeout=30) as http:
                request = asyncio.create_task(http.post("/v1/chat/completions", json=REQUEST))
                await asyncio.wait_for(hostile.job_arrived.wait(), 10)
                twin = await ScriptedWorker(queen.ws_url, continues=True,
                                            capabilities=LOGPROBS).start()
                hostile.release.set()
                response = await request
            assert response.status_code == 200, response.text
            answer = response.json()
            assert answer["choices"][0]["message"]["content"] == "".join(echo_words(REQUEST))
            assert [job.continuation is not None for job in twin.jobs] == [True]
            assert refusal in {error.code for error in hostile.errors}
            # It was stopped after a few of its 31 words: its budget, not max_tokens.
            assert 1 < hostile.chunks_sent < len(echo_words(REQUEST))
            kept_within_budget(answer)
            assert queen.state.registry.leased == 0
        finally:
            await hostile.stop()
            if twin is not None:
                await twin.stop()


async def test_with_no_twin_the_client_gets_a_clean_error(tmp_path):
    async with running_queen(tmp_path) as queen:
        hostile = await StuffingWorker(queen.ws_url, continues=True,
                                       capabilities=LOGPROBS).start()
        hostile.release.set()
        try:
            async with httpx.AsyncClient(base_url=queen.base_url, timeout=30) as http:
                response = await http.post("/v1/chat/completions", json=REQUEST)
            # The job failed at its budget (retryable); no twin holds the file to continue it.
            assert response.status_code == 502, response.text
            error = response.json()["error"]
            assert (error["type"], error["code"]) == ("server_error", "worker_lost")
            assert "no other connected worker holds the same model file" in error["message"]
            assert ANSWER_TOO_LARGE in {told.code for told in hostile.errors}
            assert [c.reason for c in hostile.cancels] == [ANSWER_TOO_LARGE]
            assert 1 < hostile.chunks_sent < len(echo_words(REQUEST))
            assert queen.state.registry.leased == 0
            assert len(queen.state.dispatcher.callers) == 0
        finally:
            await hostile.stop()
