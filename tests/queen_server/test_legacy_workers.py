"""Legacy workers as the real GPUtopia workerbee speaks, against a real queen over real sockets:
its registration (``vram`` in bytes, the newer fields), the lowest routing tier, billing by the
queen's count, and the ``legacy_workers`` setting: "on", "unbilled" and "off"."""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import orjson
import pytest
from pydantic import ValidationError
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from queen_server.billing import ledger
from queen_server.settings import QueenSettings
from queen_server.swarm.metering import END_TOKENS, Meter
from shared_schema import Refused, decode
from shared_schema.protocol import CLOSE_POLICY
from tests.queen_server.billing.test_billing_api import funded_key
from tests.support.queen import running_queen
from tests.support.workers import ECHO_MODEL, LegacyWorker, ScriptedWorker

HELLO = [{"role": "user", "content": "Hello"}]
LEGACY_MODEL = "TheBloke/Mistral-7B-Instruct-v0.1-GGUF:Q4_K_M"  # held by no v1 worker
LEGACY_TEXT = LegacyWorker.ANSWER["choices"][0]["message"]["content"]
DEV_KEY = "dev-key"
FUNDS_SATS = 1000


def workerbee(queen, answer=None) -> LegacyWorker:
    """A scripted worker that registers exactly as the real workerbee does."""
    return LegacyWorker(queen.ws_url, answer, registration=LegacyWorker.WORKERBEE_REGISTRATION)


async def joined(queen, count: int = 1) -> None:
    await queen.wait_until(lambda: len(queen.state.registry) == count, what="workers joined")


def legacy_workers(queen) -> list[Any]:
    return [worker for worker in queen.state.registry if worker.legacy]


@pytest.mark.parametrize("mode", ["on", "unbilled", "off"])
def test_the_setting_is_read_from_apiary_legacy_workers(monkeypatch, mode):
    monkeypatch.setenv("APIARY_LEGACY_WORKERS", mode)
    assert QueenSettings().legacy_workers == mode


def test_the_setting_defaults_to_on_and_refuses_other_values(monkeypatch):
    monkeypatch.delenv("APIARY_LEGACY_WORKERS", raising=False)
    assert QueenSettings().legacy_workers == "on"
    monkeypatch.setenv("APIARY_LEGACY_WORKERS", "sometimes")
    with pytest.raises(ValidationError, match="legacy_workers"):
        QueenSettings()


# --- "on" (the default) ------------------------------------------------------------------------


async def test_the_real_workerbee_joins_with_its_vram_read_in_bytes(queen):
    assert queen.state.settings.legacy_workers == "on"
    bee = await workerbee(queen).start()
    try:
        await joined(queen)
        [worker] = legacy_workers(queen)
        assert worker.vram_mb == LegacyWorker.WORKERBEE_VRAM_BYTES // 2**20 == 26_624
        assert worker.gpus == ["NVIDIA GeForce RTX 3090"]
        assert worker.capabilities == frozenset()
        assert worker.models == {}
        answer = await queen.client().chat.completions.create(model=LEGACY_MODEL,
                                                              messages=HELLO)
        assert answer.choices[0].message.content == LEGACY_TEXT
        # with no max_tokens from the client, the worker is given the queen's default limit
        assert bee.requests == [{"openai_url": "/v1/chat/completions",
                                 "openai_req": {"model": LEGACY_MODEL, "messages": HELLO,
                                                "max_tokens": 4096, "stream": False}}]
    finally:
        await bee.stop()


async def test_a_legacy_worker_gets_nothing_while_a_v1_holder_is_free(queen):
    bee = await workerbee(queen).start()
    v1 = await ScriptedWorker(queen.ws_url).start()
    try:
        await joined(queen, 2)
        client = queen.client()
        for _ in range(4):
            answer = await client.chat.completions.create(model=ECHO_MODEL, messages=HELLO)
            assert answer.choices[0].message.content == "echo: Hello"
        assert bee.requests == []  # the lowest tier: it only fetches what no holder can take
        assert len(v1.jobs) == 4
    finally:
        await v1.stop()
        await bee.stop()


async def test_a_billed_job_on_the_real_workerbee_is_charged_by_the_queens_count(tmp_path):
    lie = {"choices": [{"index": 0, "finish_reason": "stop",
                        "message": {"role": "assistant", "content": "Hello"}}],
           "usage": {"prompt_tokens": 1_000_000, "completion_tokens": 1_000_000,
                     "total_tokens": 2_000_000}}
    async with running_queen(tmp_path, auth="keys") as queen:
        bee = await workerbee(queen, lambda _request: lie).start()
        try:
            await joined(queen)
            secret, key_id = await funded_key(queen, FUNDS_SATS)
            answer = await queen.client(api_key=secret).chat.completions.create(
                model=LEGACY_MODEL, messages=HELLO, max_tokens=200)
            meter = Meter.for_chat({"messages": HELLO},
                                   queen.state.settings.template_allowance_tokens)
            bound = (meter.prompt_bound, len(b"Hello") + END_TOKENS)
            assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == bound
            money = await queen.state.billing.ledger.balances()
            charged = FUNDS_SATS * 1000 - money[ledger.key_available(key_id)]
            # a legacy model is on no hub: priced as unverified (the test queen's class: tiny)
            assert charged == queen.state.billing.prices.unverified.cost_msat(*bound)
            assert (await queen.state.billing.ledger.check()).clean
        finally:
            await bee.stop()


# --- "off" -------------------------------------------------------------------------------------


@pytest.mark.parametrize("registration", [LegacyWorker.WORKERBEE_REGISTRATION,
                                          LegacyWorker.REGISTRATION], ids=["workerbee", "wiki"])
async def test_off_refuses_legacy_workers_with_a_policy_close(tmp_path, registration):
    async with running_queen(tmp_path, legacy_workers="off") as queen:
        async with connect(queen.ws_url, proxy=None) as ws:
            await ws.send(orjson.dumps(registration).decode())
            refused = decode(await ws.recv())
            assert isinstance(refused, Refused)
            assert refused.code == "legacy_disabled"
            with pytest.raises(ConnectionClosed) as closed:
                async with asyncio.timeout(5):
                    await ws.recv()
            assert closed.value.rcvd is not None
            assert closed.value.rcvd.code == CLOSE_POLICY
        assert len(queen.state.registry) == 0
        # v1 workers are not touched by the setting.
        v1 = await ScriptedWorker(queen.ws_url).start()
        try:
            await joined(queen)
            answer = await queen.client().chat.completions.create(model=ECHO_MODEL,
                                                                  messages=HELLO)
            assert answer.choices[0].message.content == "echo: Hello"
        finally:
            await v1.stop()


# --- "unbilled" --------------------------------------------------------------------------------


@pytest.fixture
async def unbilled(tmp_path):
    async with running_queen(tmp_path, auth="keys", api_keys=[DEV_KEY],
                             legacy_workers="unbilled") as queen:
        bee = await workerbee(queen).start()
        await joined(queen)
        yield queen, bee
        await bee.stop()


async def test_unbilled_keeps_billed_chats_and_embeddings_off_legacy_workers(unbilled):
    queen, bee = unbilled
    secret, key_id = await funded_key(queen, FUNDS_SATS)
    client = queen.client(api_key=secret)
    with pytest.raises(openai.NotFoundError) as chat:
        await client.chat.completions.create(model=LEGACY_MODEL, messages=HELLO, max_tokens=50)
    assert chat.value.code == "model_not_found"
    assert "billed" in chat.value.message
    with pytest.raises(openai.NotFoundError) as embeddings:
        await client.embeddings.create(model=LEGACY_MODEL, input="Hello")
    assert embeddings.value.code == "model_not_found"
    assert bee.requests == []
    # Nothing was charged, and nothing is left on hold.
    money = await queen.state.billing.ledger.balances()
    assert money[ledger.key_available(key_id)] == FUNDS_SATS * 1000
    assert queen.state.billing._states[key_id].inflight == 0


async def test_unbilled_still_serves_unbilled_callers_on_legacy_workers(unbilled):
    queen, bee = unbilled
    answer = await queen.client(api_key=DEV_KEY).chat.completions.create(
        model=LEGACY_MODEL, messages=HELLO)
    assert answer.choices[0].message.content == LEGACY_TEXT
    assert len(bee.requests) == 1


@pytest.mark.parametrize("mode", ["on", "unbilled"])
async def test_a_billed_job_waits_for_a_busy_v1_worker_rather_than_go_legacy_when_unbilled(
        tmp_path, mode):
    async with running_queen(tmp_path, auth="keys", legacy_workers=mode,
                             queue_timeout_s=0.5) as queen:
        v1 = await ScriptedWorker(queen.ws_url, behaviour="gated").start()
        bee = await workerbee(queen).start()
        try:
            await joined(queen, 2)
            secret, _ = await funded_key(queen, FUNDS_SATS)
            client = queen.client(api_key=secret)
            first = asyncio.create_task(client.chat.completions.create(
                model=ECHO_MODEL, messages=HELLO, max_tokens=50))
            async with asyncio.timeout(5):
                await v1.job_arrived.wait()  # the v1 worker's only slot is taken
            second = client.chat.completions.create(model=ECHO_MODEL, messages=HELLO,
                                                    max_tokens=50)
            if mode == "on":
                answer = await second
                assert answer.choices[0].message.content == LEGACY_TEXT
                assert len(bee.requests) == 1
            else:
                with pytest.raises(openai.APIStatusError) as busy:
                    await second
                assert busy.value.status_code == 503
                assert bee.requests == []
            v1.release.set()
            assert (await first).choices[0].message.content == "echo: Hello"
        finally:
            v1.release.set()
            await v1.stop()
            await bee.stop()
