"""Huge numbers in requests are a 400 naming the parameter, never a 500 or a worker's crash."""

from __future__ import annotations

import httpx
import pytest

from shared_schema import ModelDescriptor
from tests.support.queen import running_queen
from tests.support.workers import ECHO_MODEL, ScriptedWorker

HUGE = "1" + "0" * 400  # a JSON integer literal near 10^400


@pytest.fixture
async def served(tmp_path):
    async with running_queen(tmp_path) as queen:
        worker = await ScriptedWorker(queen.ws_url).start()
        yield queen, worker
        await worker.stop()


@pytest.mark.parametrize(("route", "body", "param"), [
    ("/v1/chat/completions",
     '{"model":"%s","messages":[{"role":"user","content":"hi"}],"max_tokens":%s}', "max_tokens"),
    ("/v1/chat/completions", '{"model":"%s","messages":[{"role":"user","content":"hi"}],'
     '"max_completion_tokens":%s}', "max_completion_tokens"),
    ("/v1/chat/completions",
     '{"model":"%s","messages":[{"role":"user","content":"hi"}],"seed":%s}', "seed"),
    ("/v1/embeddings", '{"model":"%s","input":[%s]}', "input"),
    ("/v1/embeddings", '{"model":"%s","input":"hi","dimensions":%s}', "dimensions"),
])
async def test_a_huge_number_is_a_400_naming_its_parameter(served, route, body, param):
    queen, worker = served
    async with httpx.AsyncClient(base_url=queen.base_url) as client:
        response = await client.post(route, content=body % (ECHO_MODEL, HUGE),
                                     headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] is not None
    assert error["param"].startswith(param)
    assert worker.jobs == []


@pytest.mark.parametrize("claimed", [2**70, 10**40])
async def test_a_worker_claiming_absurd_parameters_is_refused_and_nothing_breaks(
        tmp_path, claimed):
    """A parameter count past any real model (2^70 used to reach /v1/models and make it a
    500: the JSON encoder takes 64 bits) refuses the hello; the swarm goes on serving."""
    async with running_queen(tmp_path) as queen:
        honest = await ScriptedWorker(queen.ws_url).start()
        liar = ScriptedWorker(queen.ws_url, models=["org/big:Q4"])
        liar.models = [ModelDescriptor.model_construct(
            name="org/big:Q4", size_bytes=1000, parameter_count=claimed, loaded=True,
            file_name=None, sha256=None, quant=None, context_length=None)]
        try:
            with pytest.raises(RuntimeError, match="refused: invalid_message"):
                await liar.start()
            async with httpx.AsyncClient(base_url=queen.base_url) as client:
                models = await client.get("/v1/models")
                stats = await client.get("/stats")
            assert models.status_code == 200
            assert [card["id"] for card in models.json()["data"]] == [ECHO_MODEL]
            assert stats.status_code == 200
        finally:
            await honest.stop()


async def test_a_trillion_parameter_claim_is_accepted_but_moves_no_price(tmp_path):
    """10^12 parameters is a real (if rare) model size, so the hello is accepted and the model
    listed; but the claim is the worker's: it is neither shown nor priced. The model (on no
    hub) is priced as unverified, here the largest class, whatever the worker says."""
    async with running_queen(tmp_path, unverified_price_class=None) as queen:
        worker = ScriptedWorker(queen.ws_url, models=["org/huge:Q2"])
        # (Its file's size, which would bound the price, it does not say.)
        worker.models = [worker.models[0].model_copy(update={"parameter_count": 10**12,
                                                             "size_bytes": 0})]
        await worker.start()
        try:
            async with httpx.AsyncClient(base_url=queen.base_url) as client:
                models = (await client.get("/v1/models")).json()["data"]
            assert models[0]["apiary"]["parameter_count"] is None
            assert models[0]["apiary"]["verified"] is False
            assert models[0]["apiary"]["price"]["size_class"] == "xxl"
        finally:
            await worker.stop()
