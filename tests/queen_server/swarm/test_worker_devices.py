"""The queen keeps what a worker says of its devices for model groups (issue 19):
``device_free_mb`` from its hello, replaced by each status that carries it and kept by one that
does not; a malformed figure is refused like any malformed field (a hello: ``refused``
``invalid_message`` and closed; a status: answered ``invalid_message`` and counted as a bad
frame, the figure kept). Over a running queen's real websocket."""

from __future__ import annotations

import asyncio

import orjson
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from shared_schema import SUBPROTOCOL, Challenge, Hello, Refused, decode, encode, queen_origin
from shared_schema.groups import MAX_MEMBER_DEVICES
from tests.support.workers import ScriptedWorker, new_key, signed_hello


class DevicesWorker(ScriptedWorker):
    """A scripted worker whose hello names its devices' memory."""

    def __init__(self, ws_url: str, device_free_mb: list[int] | None) -> None:
        super().__init__(ws_url)
        self.device_free_mb = device_free_mb

    def hello(self, nonce: str) -> Hello:
        return super().hello(nonce).model_copy(update={"device_free_mb": self.device_free_mb})


async def test_the_figure_is_kept_from_the_hello_and_each_status_that_carries_it(queen) -> None:
    worker = await DevicesWorker(queen.ws_url, [7_900, 23_500]).start()
    try:
        record = queen.state.registry.get(worker.pubkey)
        assert record.device_free_mb == (7_900, 23_500)
        assert record.group_free_mb == (7_900.0, 23_500.0)
        await worker.send_raw('{"type": "status", "max_jobs": 2, "device_free_mb": [6000, 1]}')
        await queen.wait_until(lambda: record.device_free_mb == (6_000, 1))
        # a status without it (an older worker's kind) leaves it as it was
        await worker.send_raw('{"type": "status", "max_jobs": 3}')
        await queen.wait_until(lambda: record.max_jobs == 3)
        assert record.device_free_mb == (6_000, 1)
    finally:
        await worker.stop()


async def test_an_older_worker_is_planned_by_its_budget(queen) -> None:
    worker = await DevicesWorker(queen.ws_url, None).start()
    try:
        record = queen.state.registry.get(worker.pubkey)
        assert record.device_free_mb is None
        record.memory_budget_mb = 28_000
        assert record.group_free_mb == (28_000.0,)
    finally:
        await worker.stop()


async def test_a_malformed_status_figure_is_answered_and_changes_nothing(queen) -> None:
    worker = await DevicesWorker(queen.ws_url, [8_000]).start()
    try:
        record = queen.state.registry.get(worker.pubkey)
        await worker.send_raw(orjson.dumps({"type": "status", "max_jobs": 2,
                                            "device_free_mb": [8_000, -1]}).decode())
        await asyncio.wait_for(worker.told.wait(), 5)
        [error] = worker.errors
        assert error.code == "invalid_message"
        assert "device_free_mb" in error.message
        assert record.device_free_mb == (8_000,)
        assert record.max_jobs == 1  # the whole frame was refused
    finally:
        await worker.stop()


async def test_a_malformed_hello_figure_is_refused(queen) -> None:
    for bad in ([8_000] * (MAX_MEMBER_DEVICES + 1), [-1], []):
        async with connect(queen.ws_url, subprotocols=[SUBPROTOCOL], proxy=None) as ws:
            challenge = decode(await ws.recv())
            assert isinstance(challenge, Challenge)
            body = orjson.loads(encode(signed_hello(new_key(), challenge.nonce, models=[],
                                                    origin=queen_origin(queen.ws_url))))
            body["device_free_mb"] = bad
            await ws.send(orjson.dumps(body).decode())
            refused = decode(await ws.recv())
            assert isinstance(refused, Refused)
            assert refused.code == "invalid_message"
            assert "device_free_mb" in refused.reason
            with pytest.raises(ConnectionClosed):
                await asyncio.wait_for(ws.recv(), 5)
            assert ws.close_code == 1008
    assert len(queen.state.registry) == 0
