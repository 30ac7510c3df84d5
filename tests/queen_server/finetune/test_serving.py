"""Fine-tuned models served (issue 37), through the official ``openai`` SDK against a real queen
and scripted workers over real websockets and HTTP: a job trained by a scripted trainer makes an
``ft:`` model that only its owner lists, retrieves, uses and deletes; its jobs go only to
workers with ``lora`` that hold the base, each with the adapter (fetched with its token and
checked); another key gets the same 404 as for a name nobody made; the adapter's route refuses
every token but the one a job gave, and any once the model is deleted."""

from __future__ import annotations

import hashlib
from typing import Any

import httpx
import openai
import pytest

from queen_server.finetune.models import ADAPTER_ROUTE, adapter_url
from shared_schema.training import ADAPTER_NAME
from tests.queen_server.finetune import test_training
from tests.queen_server.finetune.test_jobs_api import available_msat, funded_key
from tests.queen_server.finetune.test_training import available_when, cost, settled, start_job
from tests.support.queen import QueenHarness
from tests.support.trainers import AdapterServer, ScriptedTrainer
from tests.support.workers import ECHO_MODEL, ScriptedWorker

HELLO = [{"role": "user", "content": "the capital of zorbania"}]
ECHOED = "echo: the capital of zorbania"  # the scripted workers' answer

queen = test_training.queen  # the same queen as the training tests (a fixture)


async def trained(queen: QueenHarness) -> tuple[str, Any, str, bytes]:
    """A succeeded job's owner (key and SDK client), its model's name and its adapter's bytes;
    the trainer is gone again and the job's money settled (it follows the status)."""
    trainer = await ScriptedTrainer(queen.ws_url).start()
    secret, client, job, before = await start_job(queen)
    done = await settled(client, job.id)
    assert done.status == "succeeded", done.error
    charged = before - cost(queen, done.trained_tokens)
    assert await available_when(queen, secret, charged) == charged
    await trainer.stop()
    await queen.wait_until(lambda: len(queen.state.registry) == 0)
    return secret, client, done.fine_tuned_model, trainer.uploads[ADAPTER_NAME]


async def served_once(queen: QueenHarness) -> tuple[Any, str, bytes, AdapterServer]:
    """A trained model, served once to its owner by a lora worker (which got its adapter)."""
    _, client, name, adapter = await trained(queen)
    lora = await AdapterServer(queen.ws_url).start()
    await client.chat.completions.create(model=name, messages=HELLO)
    assert len(lora.adapters) == 1
    return client, name, adapter, lora


async def listed(client: Any) -> dict[str, Any]:
    return {model.id: model async for model in client.models.list()}


async def test_the_owner_s_model_is_served_by_lora_workers_with_its_adapter_at_the_base_price(
        queen):
    secret, client, name, adapter = await trained(queen)
    plain = await ScriptedWorker(queen.ws_url).start()  # holds the base, no ``lora``
    lora = await AdapterServer(queen.ws_url).start()
    for _ in range(3):
        answer = await client.chat.completions.create(model=name, messages=HELLO)
        assert answer.model == name
        assert answer.choices[0].message.content.strip() == ECHOED
    stream = await client.chat.completions.create(model=name, messages=HELLO, stream=True)
    text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream
                    if chunk.choices])
    assert text.strip() == ECHOED
    assert plain.jobs == []  # never a worker without ``lora``
    assert len(lora.jobs) == 4
    for job in lora.jobs:
        assert job.openai_req["model"] == name  # the job keeps the ft: name
        assert job.adapter is not None
        assert (job.adapter.name, job.adapter.base) == (name, ECHO_MODEL)
        assert job.adapter.file.sha256 == hashlib.sha256(adapter).hexdigest()
        assert job.adapter.file.size_bytes == len(adapter)
    assert lora.fetched == {hashlib.sha256(adapter).hexdigest(): adapter}

    # Billed as its base: the same answer costs the same under either name.
    before = await available_msat(queen, secret)
    await client.chat.completions.create(model=name, messages=HELLO)
    tuned_cost = before - await available_msat(queen, secret)
    before = await available_msat(queen, secret)
    await client.chat.completions.create(model=ECHO_MODEL, messages=HELLO)
    assert before - await available_msat(queen, secret) == tuned_cost > 0

    models = await listed(client)
    assert ECHO_MODEL in models
    card = models[name]
    assert card.object == "model"
    assert card.owned_by.startswith("key:")
    assert card.created > 0
    assert card.model_extra["apiary"]["workers"] == 1  # the lora worker only
    assert card.model_extra["apiary"]["audited"] is False
    retrieved = await client.models.retrieve(name)
    assert (retrieved.id, retrieved.owned_by) == (name, card.owned_by)
    await plain.stop()
    await lora.stop()


async def test_another_key_gets_the_same_404_as_for_a_model_nobody_made(queen):
    _, owner, name, _ = await trained(queen)
    lora = await AdapterServer(queen.ws_url).start()
    other = queen.client(api_key=await funded_key(queen, 1000))
    nobody_s = name[:-4] + ("0000" if not name.endswith("0000") else "1111")

    async def refusals(model: str) -> list[dict[str, Any]]:
        found = []
        for call in (lambda: other.chat.completions.create(model=model, messages=HELLO),
                     lambda: other.completions.create(model=model, prompt="hi"),
                     lambda: other.models.retrieve(model),
                     lambda: other.models.delete(model)):
            with pytest.raises(openai.NotFoundError) as refused:
                await call()
            body = dict(refused.value.body)
            body["message"] = body["message"].replace(model, "<model>")
            found.append(body)
        return found

    assert await refusals(name) == await refusals(nobody_s)
    assert (await refusals(name))[0]["code"] == "model_not_found"
    assert name not in await listed(other)
    assert lora.jobs == []
    # the owner's model is untouched by the other key's delete
    answer = await owner.chat.completions.create(model=name, messages=HELLO)
    assert answer.model == name
    assert name in await listed(owner)
    await lora.stop()


async def test_no_worker_of_the_base_with_lora_is_a_clear_404_and_nothing_is_charged(queen):
    secret, client, name, _ = await trained(queen)
    plain = await ScriptedWorker(queen.ws_url).start()
    before = await available_msat(queen, secret)
    with pytest.raises(openai.NotFoundError) as refused:
        await client.chat.completions.create(model=name, messages=HELLO)
    assert refused.value.body["code"] == "model_not_found"
    assert "'lora'" in refused.value.body["message"]
    assert ECHO_MODEL in refused.value.body["message"]
    assert plain.jobs == []
    assert await available_msat(queen, secret) == before
    assert (await client.models.retrieve(name)).model_extra["apiary"]["workers"] == 0
    await plain.stop()


async def test_a_deleted_model_is_neither_served_nor_listed_nor_its_adapter_sent(queen):
    client, name, _, lora = await served_once(queen)
    ref = lora.adapters[0]
    deleted = await client.models.delete(name)
    assert (deleted.id, deleted.object, deleted.deleted) == (name, "model", True)
    assert name not in await listed(client)
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(model=name, messages=HELLO)
    with pytest.raises(openai.NotFoundError):
        await client.models.retrieve(name)
    with pytest.raises(openai.NotFoundError):
        await client.models.delete(name)
    async with httpx.AsyncClient(base_url=queen.base_url, trust_env=False) as http:
        refused = await http.get(ref.file.url, headers={"Authorization": f"Bearer {ref.token}"})
    assert refused.status_code == 401
    await queen.state.fine_tuning.models.refresh()  # as another replica reads it: still gone
    assert name not in await listed(client)
    assert len(lora.jobs) == 1
    await lora.stop()


async def test_the_adapter_route_refuses_every_other_token_and_path(queen):
    _, name, adapter, lora = await served_once(queen)
    ref = lora.adapters[0]
    job_id, worker_key = ref.file.url.removeprefix(ADAPTER_ROUTE + "/").split("/")
    other_key = "ab" * 32
    model = await queen.state.fine_tuning.models.find(
        (await queen.state.fine_tuning.store.attempt_row(job_id)).owner, name)
    others_ref = model.ref(queen.state.fine_tuning.secret, other_key)
    good = {"Authorization": f"Bearer {ref.token}"}
    async with httpx.AsyncClient(base_url=queen.base_url, trust_env=False) as http:
        sent = await http.get(ref.file.url, headers=good)
        assert sent.status_code == 200
        assert sent.content == adapter
        assert sent.headers["x-apiary-sha256"] == ref.file.sha256
        hostile = [
            (ref.file.url, {}),  # no token
            (ref.file.url, {"Authorization": ref.token}),  # not a bearer
            (ref.file.url, {"Authorization": "Bearer " + "0" * len(ref.token)}),
            (ref.file.url, {"Authorization": f"Bearer {others_ref.token}"}),  # another's
            (adapter_url(job_id, other_key), good),  # this token at another worker's path
            (adapter_url(job_id.upper(), worker_key), good),
            (adapter_url("ftjob-" + "0" * 24, worker_key), good),
            (adapter_url(job_id, "." * 64), good),
        ]
        for url, headers in hostile:
            answer = await http.get(url, headers=headers)
            assert answer.status_code == 401, (url, answer.status_code)
            assert answer.json()["error"]["code"] == "invalid_adapter_token"
            assert adapter not in answer.content
        for url in (f"{ADAPTER_ROUTE}/{job_id}", f"{ADAPTER_ROUTE}/{job_id}/{worker_key}/x",
                    f"{ADAPTER_ROUTE}/../train/{job_id}/data", adapter_url("..", worker_key),
                    f"{ADAPTER_ROUTE}/..%2F{job_id}/{worker_key}",
                    f"{ADAPTER_ROUTE}/{job_id}/{worker_key}%2F..%2F..%2Ftrain"):
            answer = await http.get(url, headers=good)
            assert answer.status_code in {401, 404}, url
            assert adapter not in answer.content
    await lora.stop()
