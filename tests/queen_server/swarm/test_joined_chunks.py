"""Joined chunk frames (``Chunk.tokens``, issue 18): a worker joins the tokens it made while its
last frame was being sent. The count is a claim the queen bounds by the bytes delivered, an
older worker (no field) still counts one per frame, and the client reads the same stream.
Real queen, real websockets, scripted workers speaking the real protocol."""

from __future__ import annotations

import asyncio

import orjson

from queen_server.swarm.jobs import Credit
from queen_server.swarm.metering import Meter
from queen_server.swarm.relay import Delivered
from shared_schema import Chunk, encode
from shared_schema.protocol import MAX_CHUNK_TOKENS
from tests.support.queen import QueenHarness
from tests.support.sse import sse_events, text_of
from tests.support.workers import ECHO_MODEL, ScriptedWorker, echo_words

ROLE = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "echo:"},
                     "finish_reason": None}]}


def joined(content: str) -> dict:
    return {"choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}]}


def test_a_joined_frame_counts_its_tokens_and_an_older_one_counts_one() -> None:
    books = Delivered(Meter(prompt_bound=50, prompt_estimate=10, end_allowance=1))
    books.take(joined("abcdefgh"), 4)  # four tokens of two bytes each
    books.take(joined("ij"))  # an older worker's frame: one token
    assert books.tokens == 5
    assert books.delivered_tokens == 5
    parts, billed = books.done(Credit("w"), _usage(9, 5))
    assert billed.completion_tokens == 5
    assert parts[0].completion_tokens == 5


def test_an_inflated_count_is_bounded_by_the_bytes_delivered() -> None:
    """A worker claiming 1,000 tokens on a 3-byte delta is held to 3 wherever the count is
    used: its part when it is lost, the tokens a twin is told were delivered, a broken stream,
    and the billed usage (``Meter.bill``, whatever its result claims)."""
    meter = Meter(prompt_bound=50, prompt_estimate=10, end_allowance=1)
    books = Delivered(meter)
    books.take(joined("abc"), 1000)
    assert books.delivered_tokens == 3
    [part] = books.broken(Credit("liar"))
    assert part.completion_tokens == 3
    books.lost(Credit("liar"))
    assert books.parts[0].completion_tokens == 3
    books = Delivered(meter)
    books.take(joined("abc"), MAX_CHUNK_TOKENS)
    _, billed = books.done(Credit("liar"), _usage(9, MAX_CHUNK_TOKENS))
    assert billed.completion_tokens == meter.completion_bound(3) == 4


async def test_a_stream_of_joined_frames_reads_the_same_and_counts_every_token(queen):
    words = " ".join(f"w{i}" for i in range(100))
    user = [{"role": "user", "content": words}]
    body = {"model": ECHO_MODEL, "messages": user, "stream": True,
            "stream_options": {"include_usage": True}}
    expected = echo_words({"messages": user})
    joining = await ScriptedWorker(queen.ws_url).start()
    assert joining.welcome is not None
    assert joining.welcome.chunk_tokens == MAX_CHUNK_TOKENS  # this queen reads joined frames
    events = await sse_events(queen.base_url, body)
    await joining.stop()
    one_each = await ScriptedWorker(queen.ws_url, join_tokens=1).start()  # an older worker
    await queen.wait_until(lambda: len(queen.state.registry) == 1, what="one worker")
    older = await sse_events(queen.base_url, body)
    await one_each.stop()
    assert text_of(events) == text_of(older) == "".join(expected)
    assert events[-1] == older[-1] == "[DONE]"
    usage = {"prompt_tokens": 7, "completion_tokens": len(expected),
             "total_tokens": 7 + len(expected)}
    assert events[-2]["usage"] == older[-2]["usage"] == usage
    # the joining worker sent its 101 tokens in a handful of frames; the older one, 101
    assert joining.tokens_sent == one_each.tokens_sent == len(expected)
    assert joining.frames_sent <= 1 + -(-(len(expected) - 1) // joining.join_tokens)
    assert one_each.frames_sent == len(expected)
    assert len(_content_events(events)) == joining.frames_sent
    assert len(_content_events(older)) == len(expected)


class InflatingWorker(ScriptedWorker):
    """Streams "echo:" and then " abc" in a frame claiming 1,000 tokens; waits for
    ``release`` and vanishes mid-answer."""

    async def _run(self, job) -> None:
        self.jobs.append(job)
        await self.send_raw(encode(Chunk(id=job.id, seq=0, data=ROLE)))
        await self.send_raw(orjson.dumps({"type": "chunk", "id": job.id, "seq": 1,
                                          "tokens": 1000, "data": joined(" abc")}).decode())
        await self.release.wait()
        assert self._ws is not None
        self._ws.transport.abort()


async def test_a_twin_is_not_short_changed_by_an_inflated_count(queen: QueenHarness):
    """The lost worker claimed 1,000 tokens for 9 bytes: the twin is asked for ``max_tokens``
    less 9, not less 1,001 (which would leave it one token)."""
    user = [{"role": "user", "content": "abc def ghi"}]
    body = {"model": ECHO_MODEL, "messages": user, "stream": True, "max_tokens": 50}
    liar = await InflatingWorker(queen.ws_url, continues=True).start()
    task = asyncio.create_task(sse_events(queen.base_url, body))
    await queen.wait_until(lambda: any(s.jobs for s in queen.state.registry), what="job sent")
    twin = await ScriptedWorker(queen.ws_url, continues=True).start()
    await queen.wait_until(lambda: len(queen.state.registry) == 2, what="twin connected")
    liar.release.set()
    async with asyncio.timeout(15):
        events = await task
    assert text_of(events) == "echo: abc def ghi"
    [job] = twin.jobs
    assert job.continuation == "echo: abc"
    assert job.openai_req["max_tokens"] == 50 - len("echo: abc")
    await twin.stop()
    await liar.stop()


def _content_events(events: list) -> list:
    return [e for e in events if isinstance(e, dict)
            and any((c.get("delta") or {}).get("content") for c in e.get("choices") or ())]


def _usage(prompt: int, completion: int):
    from shared_schema import Usage

    return Usage(prompt_tokens=prompt, completion_tokens=completion,
                 total_tokens=prompt + completion)
