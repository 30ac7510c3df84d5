"""The /worker websocket: handshake, refusals, replacement, heartbeats, legacy workers."""

from __future__ import annotations

import asyncio

import orjson
import pytest
from sqlalchemy import select
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from queen_server.identity import public_id
from queen_server.storage.engine import Database
from queen_server.storage.tables import WorkerRecord
from shared_schema import SUBPROTOCOL, Challenge, Refused, decode, encode, queen_origin
from tests.support.queen import running_queen
from tests.support.workers import (
    ECHO_MODEL,
    LegacyWorker,
    ScriptedWorker,
    new_key,
    signed_hello,
)

USER = [{"role": "user", "content": "Who won the world series in 2020?"}]


async def _refusal(queen, first_frame, *, v1=True):
    """Connect, send one frame, and return the refusal and the close code."""
    subprotocols = [SUBPROTOCOL] if v1 else None
    async with connect(queen.ws_url, subprotocols=subprotocols, proxy=None) as ws:
        if v1:
            challenge = decode(await ws.recv())
            assert isinstance(challenge, Challenge)
            frame = first_frame(challenge.nonce) if callable(first_frame) else first_frame
        else:
            frame = first_frame
        await ws.send(frame)
        refused = decode(await ws.recv())
        with pytest.raises(ConnectionClosed):
            await ws.recv()
        assert isinstance(refused, Refused)
        return refused, ws.close_code


def _hello(queen, nonce, **kwargs):
    """A hello signed for ``queen`` (the origin of the URL a worker dials)."""
    return encode(signed_hello(new_key(), nonce, models=[], origin=queen_origin(queen.ws_url),
                               **kwargs))


async def test_hello_signed_over_another_nonce_is_refused(queen):
    refused, code = await _refusal(queen, lambda nonce: _hello(queen, nonce, sign_nonce="ab" * 16))
    assert refused.code == "bad_signature"
    assert code == 1008
    assert len(queen.state.registry) == 0


async def test_hello_with_a_swapped_payout_address_is_refused(queen):
    def tampered(nonce):
        body = orjson.loads(_hello(queen, nonce, ln_url="alice@example.com"))
        body["ln_url"] = "mallory@example.com"
        return orjson.dumps(body).decode()

    refused, _ = await _refusal(queen, tampered)
    assert refused.code == "bad_signature"


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        ("this is not json", "invalid_json"),
        ("[1, 2, 3]", "invalid_message"),
        ('{"type": "pong"}', "unexpected_message"),
        ('{"type": "hello", "protocol": 99}', "protocol_version"),
        ('{"type": "hello", "protocol": 2, "pubkey": 5}', "invalid_message"),
        ('{"type": "hello", "protocol": 1, "pubkey": 5}', "protocol_version"),
        (b"\x00\x01binary", "binary_frame"),
    ],
)
async def test_garbage_hellos_are_refused_with_a_reason(queen, frame, code):
    refused, close_code = await _refusal(queen, frame)
    assert refused.code == code
    assert refused.reason
    assert close_code == 1008
    assert len(queen.state.registry) == 0


async def test_oversized_hello_is_refused(tmp_path):
    async with running_queen(tmp_path, max_hello_bytes=4096) as queen:
        refused, code = await _refusal(queen, lambda nonce: _hello(queen, nonce, ln_url="x" * 2000)
                                       .replace("}", ', "pad": "' + "y" * 5000 + '"}', 1))
        assert refused.code == "frame_too_large"
        assert code == 1009


async def test_v1_hello_without_the_subprotocol_is_refused(queen):
    refused, _ = await _refusal(queen, '{"type": "hello", "protocol": 1}', v1=False)
    assert refused.code == "unexpected_message"
    assert SUBPROTOCOL in refused.reason


async def test_frames_over_the_size_limit_close_the_session(tmp_path):
    async with running_queen(tmp_path, max_frame_bytes=64 * 1024) as queen:
        worker = await ScriptedWorker(queen.ws_url).start()
        await worker.send_raw("x" * (100 * 1024))
        await asyncio.wait_for(worker.closed.wait(), 5)
        assert worker.close_code == 1009
        await queen.wait_until(lambda: len(queen.state.registry) == 0)


async def test_welcome_carries_session_and_public_id(queen):
    worker = await ScriptedWorker(queen.ws_url, ln_url="alice@example.com").start()
    try:
        assert worker.welcome.worker_id == public_id(worker.pubkey)
        assert worker.welcome.heartbeat_interval_s == 0.5
        session = queen.state.registry.get(worker.pubkey)
        assert session.ln_url == "alice@example.com"
        assert session.loaded == {ECHO_MODEL}
    finally:
        await worker.stop()


async def test_same_key_twice_closes_the_older_session(queen):
    key = new_key()
    older = await ScriptedWorker(queen.ws_url, key=key).start()
    newer = await ScriptedWorker(queen.ws_url, key=key, models=["a/b:Q8_0"]).start()
    try:
        await asyncio.wait_for(older.closed.wait(), 5)
        assert older.close_code == 4000
        assert len(queen.state.registry) == 1
        assert queen.state.registry.get(newer.pubkey).cached == {"a/b:Q8_0"}
    finally:
        await newer.stop()


async def test_worker_missing_heartbeats_leaves_the_registry(tmp_path):
    async with running_queen(tmp_path, heartbeat_misses=3) as queen:  # the default's misses
        silent = await ScriptedWorker(queen.ws_url, answer_pongs=False).start()
        chatty = await ScriptedWorker(queen.ws_url).start()
        try:
            await asyncio.wait_for(silent.closed.wait(), 5)
            assert silent.close_code == 4001
            assert [s.key for s in queen.state.registry] == [chatty.pubkey]
            # The answering worker, connected as long, outlived the same missed intervals.
            assert not chatty.closed.is_set()
        finally:
            await chatty.stop()


async def test_disconnect_leaves_the_registry_at_once(queen):
    worker = await ScriptedWorker(queen.ws_url).start()
    assert len(queen.state.registry) == 1
    await worker.stop()
    await queen.wait_until(lambda: len(queen.state.registry) == 0, timeout_s=1)


async def test_bad_frames_after_welcome_are_dropped_then_the_session_closed(tmp_path):
    async with running_queen(tmp_path, max_bad_frames=5) as queen:
        worker = await ScriptedWorker(queen.ws_url).start()
        for frame in ("nope", '{"type": "chunk"}', '{"type": "welcome", "session_id": "x", '
                      '"worker_id": "y", "heartbeat_interval_s": 1}'):
            await worker.send_raw(frame)
        answer = await queen.client().chat.completions.create(model=ECHO_MODEL, messages=USER)
        assert answer.choices[0].message.content.startswith("echo:")
        for _ in range(3):
            await worker.send_raw("{broken")
        await asyncio.wait_for(worker.closed.wait(), 5)
        assert worker.close_code == 1008
        await queen.wait_until(lambda: len(queen.state.registry) == 0)


async def test_status_updates_models_and_slots(queen):
    worker = await ScriptedWorker(queen.ws_url).start()
    try:
        await worker.send_raw(
            '{"type": "status", "active_jobs": 0, "max_jobs": 3, "models": '
            '[{"name": "new/model:Q4_0", "loaded": true}], "future_field": 1}'
        )
        session = queen.state.registry.get(worker.pubkey)
        await queen.wait_until(lambda: session.max_jobs == 3)
        assert queen.state.registry.model_names() == ["new/model:Q4_0"]
    finally:
        await worker.stop()


async def test_legacy_worker_serves_plain_and_streamed_chat(queen):
    legacy = await LegacyWorker(queen.ws_url).start()
    try:
        await queen.wait_until(lambda: len(queen.state.registry) == 1)
        client = queen.client()
        model = "TheBloke/CoolModelv2:Q4_K_M"
        answer = await client.chat.completions.create(model=model, messages=USER)
        assert answer.choices[0].message.content == LegacyWorker.ANSWER["choices"][0][
            "message"]["content"]
        assert answer.usage.total_tokens == 87
        assert answer.model == model
        assert legacy.requests[0] == {
            "openai_url": "/v1/chat/completions",
            # no max_tokens from the client: the worker gets the queen's default limit
            "openai_req": {"model": model, "messages": USER,
                           "max_tokens": queen.state.settings.default_max_tokens,
                           "stream": False},
        }
        stream = await client.chat.completions.create(model=model, messages=USER, stream=True)
        chunks = [chunk async for chunk in stream]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == "The Los Angeles Dodgers won the World Series in 2020."
        assert chunks[-1].choices[0].finish_reason == "stop"
        assert legacy.requests[1]["openai_req"]["stream"] is False
    finally:
        await legacy.stop()


@pytest.mark.parametrize("registration", [LegacyWorker.REGISTRATION,
                                          LegacyWorker.WORKERBEE_REGISTRATION],
                         ids=["wiki", "workerbee"])
async def test_legacy_worker_gets_no_challenge(queen, registration):
    async with connect(queen.ws_url, proxy=None) as ws:
        await ws.send(orjson.dumps(registration).decode())
        await queen.wait_until(lambda: len(queen.state.registry) == 1)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):
                await ws.recv()


async def test_connected_workers_are_recorded_in_the_database(queen):
    worker = await ScriptedWorker(queen.ws_url, ln_url="bob@example.com").start()
    await worker.stop()
    database = Database(str(queen.state.db.url.render_as_string(hide_password=False)))
    try:
        async with database.sessions() as session:
            rows = (await session.scalars(select(WorkerRecord))).all()
        assert [(row.key, row.public_id, row.ln_url) for row in rows] == [
            (worker.pubkey, public_id(worker.pubkey), "bob@example.com")]
    finally:
        await database.close()


async def test_worker_leaving_before_its_welcome_is_not_left_registered(queen):
    for _ in range(3):
        ws = await connect(queen.ws_url, subprotocols=[SUBPROTOCOL], proxy=None)
        challenge = decode(await ws.recv())
        await ws.send(_hello(queen, challenge.nonce))
        await ws.close()  # gone before reading the welcome
    await queen.wait_until(lambda: len(queen.state.registry) == 0,
                           what="no zombie sessions")


async def test_hot_routes_report_errors_like_the_others(queen):
    import httpx

    async with httpx.AsyncClient(base_url=queen.base_url) as http:
        response = await http.post("/v1/embeddings", content=b"{")
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_json"


async def test_a_request_made_while_a_worker_is_welcomed_is_served_by_it_after_its_welcome(
        tmp_path, monkeypatch):
    """A worker is routable as soon as it is admitted: a request that arrives while its welcome
    is on the way is leased to it (not a 404 for a model nobody serves), and its job frame
    waits for the welcome, which the worker reads first (``ScriptedWorker.start`` asserts it)."""
    from queen_server.http.worker_ws import WorkerSocket

    sending, release = asyncio.Event(), asyncio.Event()
    welcome = WorkerSocket.send_welcome

    async def held_welcome(self, frame):
        sending.set()
        await release.wait()
        await welcome(self, frame)

    monkeypatch.setattr(WorkerSocket, "send_welcome", held_welcome)
    async with running_queen(tmp_path) as queen:
        worker = ScriptedWorker(queen.ws_url)
        joining = asyncio.create_task(worker.start())
        await asyncio.wait_for(sending.wait(), 10)
        client = queen.client()
        asking = asyncio.create_task(client.chat.completions.create(
            model=ECHO_MODEL, messages=USER, max_tokens=8))

        def leased() -> bool:
            entry = queen.state.registry.get(worker.pubkey)
            return entry is not None and len(entry.jobs) == 1

        await queen.wait_until(leased, 10, "the request leased to the joining worker")
        assert not worker.jobs  # nothing reached it before its welcome
        release.set()
        await asyncio.wait_for(joining, 10)
        answer = await asyncio.wait_for(asking, 10)
        assert answer.choices[0].message.content
        assert len(worker.jobs) == 1
        await worker.stop()
