"""Plain regression tests for what fuzzing the /worker websocket found.

1. A bad frame after the welcome was dropped with no answer (only a log line on the queen), so a
   worker could not tell why nothing happened: each now gets an ``error`` message naming its code.
2. A queen-only message from a worker (a second ``hello``, a ``welcome``) was counted as bad but
   never closed the session, however many came: only undecodable frames checked the limit.
3. A ``ping`` with ``"ts": NaN`` (or ``1e999``) was answered with ``"ts": null``, a pong no worker
   can decode: wire floats must now be finite.
4. A hello with the all-zero public key and an all-zero signature was welcomed for about one
   nonce in four (found by ``bench/fuzz.py``): OpenSSL's Ed25519 accepts forged signatures under
   small-order keys. Such keys are now refused, so no one can join as an identity nobody holds.
5. A worker answering its own job with a malformed payload (``"choices": "x"``, a delta that is
   a string, an embeddings result without vectors, an integer past 64 bits anywhere in the
   payload, a usage past 64 bits) made the relay raise:
   a 500, or a stream cut without an end. Such a frame now fails the job (retryable, so another
   worker may answer it), the client gets a 502 in OpenAI's shape, the worker an ``error``.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import orjson
import pytest
from pydantic import ValidationError
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from shared_schema import (
    PROTOCOL_VERSION,
    SUBPROTOCOL,
    Challenge,
    Hello,
    Ping,
    Pong,
    ProtocolError,
    Welcome,
    decode,
    encode,
    queen_origin,
)
from shared_schema.protocol import SMALL_ORDER_KEYS
from tests.support.queen import running_queen
from tests.support.workers import (
    ECHO_MODEL,
    LegacyWorker,
    ScriptedWorker,
    new_key,
    signed_hello,
)

USER = [{"role": "user", "content": "one two three"}]


async def _welcomed(queen):
    ws = await connect(queen.ws_url, subprotocols=[SUBPROTOCOL], proxy=None)
    challenge = decode(await ws.recv())
    assert isinstance(challenge, Challenge)
    await ws.send(encode(signed_hello(new_key(), challenge.nonce, models=[],
                                      origin=queen_origin(queen.ws_url))))
    assert isinstance(decode(await ws.recv()), Welcome)
    return ws


async def _answer(ws):
    """The queen's next message that is not its heartbeat ping."""
    while True:
        async with asyncio.timeout(5):
            body = orjson.loads(await ws.recv())
        if body["type"] != "ping":
            return body


@pytest.mark.parametrize(
    ("frame", "code", "job_id"),
    [
        (b"\x00\x01", "bad_relay_frame", ""),
        ("{broken", "invalid_json", ""),
        ('{"id": "j-7"}', "unknown_type", "j-7"),
        ('{"type": "chunk", "id": "j-8", "seq": -1, "data": {}}', "invalid_message", "j-8"),
        ('{"type": "hello", "protocol": 1}', "invalid_message", ""),
        ('{"type": "cancel", "id": "j-9"}', "unexpected_message", "j-9"),
        ('{"type": "result", "id": "nobody", "usage": {"prompt_tokens": 1, "total_tokens": 1}}',
         "unknown_job", "nobody"),
    ],
)
async def test_each_bad_frame_after_the_welcome_gets_a_typed_error(queen, frame, code, job_id):
    ws = await _welcomed(queen)
    try:
        await ws.send(frame)
        error = await _answer(ws)
        assert error["type"] == "error"
        assert error["code"] == code
        assert error["id"] == job_id
        assert error["message"]
        assert error["retryable"] is False
        # The session goes on: a ping is still answered.
        await ws.send(encode(Ping(ts=3.0)))
        assert await _answer(ws) == {"type": "pong", "ts": 3.0}
    finally:
        await ws.close()


async def test_a_second_hello_is_unexpected_and_such_frames_close_the_session(tmp_path):
    async with running_queen(tmp_path, max_bad_frames=3) as queen:
        ws = await _welcomed(queen)
        challenge = Challenge(nonce="ab" * 32)
        hello = encode(signed_hello(new_key(), challenge.nonce, models=[]))
        for _ in range(2):
            await ws.send(hello)
            error = await _answer(ws)
            assert (error["type"], error["code"]) == ("error", "unexpected_message")
        await ws.send(encode(challenge))  # the third queen-only message
        with pytest.raises(ConnectionClosed):
            await _answer(ws)
        assert ws.close_code == 1008
        assert ws.close_reason == "too many bad frames (3)"
        await queen.wait_until(lambda: len(queen.state.registry) == 0)


async def test_frames_for_another_workers_job_are_refused_and_never_delivered(tmp_path):
    async with running_queen(tmp_path, max_bad_frames=3, first_token_timeout_s=30,
                             total_timeout_s=30) as queen:
        honest = await ScriptedWorker(queen.ws_url, behaviour="gated").start()
        try:
            stream = await queen.client().chat.completions.create(
                model=ECHO_MODEL, messages=USER, stream=True)
            (job_id,) = queen.state.registry.get(honest.pubkey).jobs
            intruder = await _welcomed(queen)
            forged = [
                {"type": "chunk", "id": job_id, "seq": 1,
                 "data": {"choices": [{"index": 0, "delta": {"content": " FORGED"}}]}},
                {"type": "result", "id": job_id,
                 "usage": {"prompt_tokens": 1, "completion_tokens": 999, "total_tokens": 1000}},
                {"type": "error", "id": job_id, "code": "x", "message": "forged"},
            ] * 2  # more than max_bad_frames: frames for unknown jobs are not counted
            for body in forged:
                await intruder.send(orjson.dumps(body).decode())
                error = await _answer(intruder)
                assert (error["type"], error["code"], error["id"]) == (
                    "error", "unknown_job", job_id)
            await intruder.close()
            handle = queen.state.registry.get(honest.pubkey).jobs[job_id]
            assert not handle.finished
            honest.release.set()
            text = "".join([c.choices[0].delta.content or "" async for c in stream
                            if c.choices])
            assert text == "echo: one two three"
        finally:
            await honest.stop()


@pytest.mark.parametrize("ts", ["NaN", "Infinity", "-Infinity", "1e999"])
async def test_a_ping_with_a_non_finite_time_is_refused_not_echoed_as_null(queen, ts):
    frame = '{"type": "ping", "ts": ' + ts + "}"
    with pytest.raises(ProtocolError) as caught:
        decode(frame)
    assert caught.value.code == "invalid_message"
    ws = await _welcomed(queen)
    try:
        await ws.send(frame)
        error = await _answer(ws)
        assert (error["type"], error["code"]) == ("error", "invalid_message")
        assert "finite" in error["message"]
    finally:
        await ws.close()


@pytest.mark.parametrize("sign_bit", [False, True])
async def test_a_hello_under_a_small_order_key_is_refused(queen, sign_bit):
    for key in sorted(SMALL_ORDER_KEYS):
        pubkey = key[:62] + format(int(key[62:], 16) | (0x80 if sign_bit else 0), "02x")
        body = {"type": "hello", "protocol": PROTOCOL_VERSION, "worker_version": "forged",
                "pubkey": pubkey,
                "signature": "00" * 64, "cpu_count": 1, "disk_space": 1, "vram": 0}
        with pytest.raises(ValidationError, match="small-order"):
            Hello.model_validate(body)
    # Over the websocket: every try is refused as invalid, none welcomed (before the fix about
    # a quarter were welcomed, and the rest refused as bad_signature).
    for _ in range(8):
        async with connect(queen.ws_url, subprotocols=[SUBPROTOCOL], proxy=None) as ws:
            assert isinstance(decode(await ws.recv()), Challenge)
            await ws.send(orjson.dumps({**body, "pubkey": "00" * 32}).decode())
            refused = decode(await ws.recv())
            assert refused.type == "refused"
            assert refused.code == "invalid_message"
            assert "small-order" in refused.reason
    assert len(queen.state.registry) == 0


class Garbler(ScriptedWorker):
    """Answers every job with the frames it is given (the job's id filled in)."""

    frames: list[dict] = []
    errors: list[dict] = []

    async def _run(self, job):
        for frame in self.frames:
            await self._ws.send(json.dumps({**frame, "id": job.id}))  # ints past 64 bits too

    async def _read(self):
        ws = self._ws
        async for frame in ws:
            body = orjson.loads(frame)
            if body["type"] == "job":
                self._tasks.add(asyncio.create_task(self._run(decode(frame))))
            elif body["type"] == "error":
                self.errors.append(body)
            elif body["type"] == "ping":
                await ws.send(encode(Pong(ts=body["ts"])))


ONE = {"prompt_tokens": 1, "total_tokens": 1}


@pytest.mark.parametrize(
    ("path", "stream", "frames"),
    [
        ("/v1/chat/completions", False, [{"type": "chunk", "seq": 0, "data": {"choices": "x"}},
                                         {"type": "result", "usage": ONE}]),
        ("/v1/chat/completions", True, [{"type": "chunk", "seq": 0,
                                         "data": {"choices": [{"delta": "x"}]}}]),
        ("/v1/chat/completions", True, [{"type": "chunk", "seq": 0,
                                         "data": {"choices": [{"index": 0}]}}]),
        ("/v1/chat/completions", False, [{"type": "result", "usage": {
            "prompt_tokens": 10**30, "completion_tokens": 1, "total_tokens": 10**30},
            "data": {"choices": [{"message": {"content": "hi"}}]}}]),
        ("/v1/chat/completions", True, [{"type": "chunk", "seq": 0, "data": {
            "choices": [{"index": 0, "delta": {"content": "a"}}], "n": 2**70}}]),
        ("/v1/embeddings", False, [{"type": "result", "data": {"object": "list"},
                                    "usage": ONE}]),
        ("/v1/embeddings", False, [{"type": "result", "data": {"data": [{"embedding": "x"}]},
                                    "usage": ONE}]),
    ],
)
async def test_a_malformed_answer_fails_the_job_with_a_502_not_a_500(queen, path, stream, frames):
    worker = Garbler(queen.ws_url)
    worker.frames, worker.errors = frames, []
    await worker.start()
    body = {"model": ECHO_MODEL, "input": "hi"} if path.endswith("embeddings") else {
        "model": ECHO_MODEL, "messages": USER, "stream": stream}
    try:
        async with httpx.AsyncClient(base_url=queen.base_url, timeout=10) as http:
            response = await http.post(path, json=body)
        assert response.status_code == 502
        error = response.json()["error"]
        assert error["type"] == "server_error"
        assert "malformed" in error["message"]
        await queen.wait_until(lambda: bool(worker.errors))
        assert worker.errors[0]["code"] == "invalid_message"
        assert worker.errors[0]["id"].startswith(("chatcmpl-", "embd-"))
        assert queen.state.registry.get(worker.pubkey).jobs == {}
    finally:
        await worker.stop()


@pytest.mark.parametrize("answer", [{"choices": [1]}, {"choices": [{"message": "x"}]},
                                    {"choices": [{"message": {"content": 5}}]}])
async def test_a_malformed_legacy_answer_is_a_502_not_a_500(queen, answer):
    legacy = await LegacyWorker(queen.ws_url, answer=lambda _request: answer).start()
    try:
        await queen.wait_until(lambda: len(queen.state.registry) == 1)
        for stream in (False, True):
            async with httpx.AsyncClient(base_url=queen.base_url, timeout=10) as http:
                response = await http.post("/v1/chat/completions", json={
                    "model": "a/b:Q4_0", "messages": USER, "stream": stream})
            assert response.status_code == 502
            assert "malformed" in response.json()["error"]["message"]
    finally:
        await legacy.stop()
