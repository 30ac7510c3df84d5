"""Fine-tuning jobs through the official ``openai`` SDK against a real queen (issue 37): a
job is made whole or not at all, its bound held up front and given back when it ends without
training; a second key neither sees nor cancels it; bad input is a 400 naming its field, an
unpaid job a 402, and nothing is held for either. A scripted worker offering ``train`` holds
the base model; these tests are of the API alone, so the queen's runner is stopped and jobs
stay queued (training on workers: ``test_training.py``)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import openai
import pytest

from queen_server.billing import ledger
from queen_server.finetune.plan import TEMPLATE_TOKENS_PER_EXAMPLE
from shared_schema.capabilities import TRAIN
from tests.support.queen import QueenHarness, running_queen
from tests.support.training_files import training_file
from tests.support.workers import ECHO_MODEL, ScriptedWorker

DATA = training_file(40)


async def funded_key(queen: QueenHarness, sats: float) -> str:
    return (await queen.funded_key(sats))[0]


async def available_msat(queen: QueenHarness, secret: str) -> int:
    principal = await queen.state.billing.authenticate(f"Bearer {secret}")
    assert principal.key is not None
    account = ledger.key_available(principal.key.id)
    return (await queen.state.billing.ledger.balances())[account]


@pytest.fixture
async def queen(tmp_path, db_url):
    async with running_queen(tmp_path, auth="keys", db=db_url, files_dir=tmp_path / "files",
                             finetune_queue_timeout_s=60) as queen:
        service = queen.state.fine_tuning
        await service.runner.stop()
        service.runner = None
        trainer = await ScriptedWorker(queen.ws_url, capabilities=[TRAIN]).start()
        yield queen
        await trainer.stop()


async def test_a_job_is_queued_held_listed_and_cancelled_with_everything_given_back(queen):
    secret = await funded_key(queen, 100_000)
    client = queen.client(api_key=secret)
    before = await available_msat(queen, secret)
    upload = await client.files.create(file=("zorbania.jsonl", DATA), purpose="fine-tune")
    job = await client.fine_tuning.jobs.create(
        model=ECHO_MODEL, training_file=upload.id, suffix="zorbania", seed=7,
        method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 3}}},
        metadata={"team": "geo"})
    assert job.id.startswith("ftjob-")
    assert (job.status, job.model, job.training_file, job.seed) == (
        "validating_files", ECHO_MODEL, upload.id, 7)  # as OpenAI answers a create
    assert (await client.fine_tuning.jobs.retrieve(job.id)).status == "queued"  # then at once
    job = await client.fine_tuning.jobs.retrieve(job.id)
    assert job.hyperparameters.n_epochs == 3
    assert job.hyperparameters.batch_size == 2  # "auto": a twentieth of 40 examples
    assert job.method.type == "supervised"
    assert job.user_provided_suffix == "zorbania"
    assert job.metadata == {"team": "geo"}
    assert job.fine_tuned_model is None
    held = before - await available_msat(queen, secret)
    bound = 3 * (len(DATA) + TEMPLATE_TOKENS_PER_EXAMPLE * 40)  # the queen's own bound
    price = queen.state.fine_tuning.training_price(ECHO_MODEL)
    assert held == -(-bound * price.completion_msat_per_1k // 1000)
    assert price.completion_msat_per_1k == 4 * queen.state.price_of(
        ECHO_MODEL).completion_msat_per_1k
    assert await client.fine_tuning.jobs.retrieve(job.id) == job
    assert [j.id async for j in client.fine_tuning.jobs.list()] == [job.id]
    events = [e async for e in client.fine_tuning.jobs.list_events(job.id)]
    assert [e.message for e in events] == ["Files validated, moving job to queued state",
                                          f"Validating training file: {upload.id}"]
    assert [c async for c in client.fine_tuning.jobs.checkpoints.list(job.id)] == []

    cancelled = await client.fine_tuning.jobs.cancel(job.id)
    assert cancelled.status == "cancelled"
    assert cancelled.finished_at is not None
    assert await available_msat(queen, secret) == before  # nothing trained: nothing charged
    assert (await client.fine_tuning.jobs.list_events(job.id)).data[0].message.startswith(
        "Job was cancelled")
    with pytest.raises(openai.BadRequestError) as caught:
        await client.fine_tuning.jobs.cancel(job.id)
    assert caught.value.body["code"] == "job_not_cancellable"


async def test_another_key_neither_sees_nor_cancels_nor_trains_on_the_files(queen):
    alice = queen.client(api_key=await funded_key(queen, 100_000))
    mallory = queen.client(api_key=await funded_key(queen, 100_000))
    upload = await alice.files.create(file=("z.jsonl", DATA), purpose="fine-tune")
    job = await alice.fine_tuning.jobs.create(model=ECHO_MODEL, training_file=upload.id)
    for reach in (mallory.fine_tuning.jobs.retrieve, mallory.fine_tuning.jobs.cancel,
                  mallory.fine_tuning.jobs.list_events):
        with pytest.raises(openai.NotFoundError) as caught:
            await reach(job.id)
        assert caught.value.body["code"] == "fine_tuning_job_not_found"
    assert [j async for j in mallory.fine_tuning.jobs.list()] == []
    # Alice's file id is no secret to Mallory, and still trains nothing for it.
    with pytest.raises(openai.BadRequestError) as caught:
        await mallory.fine_tuning.jobs.create(model=ECHO_MODEL, training_file=upload.id)
    assert caught.value.body["param"] == "training_file"
    assert (await alice.fine_tuning.jobs.retrieve(job.id)).status == "queued"


async def test_bad_requests_name_their_field_and_hold_nothing(queen):
    secret = await funded_key(queen, 100_000)
    client = queen.client(api_key=secret)
    before = await available_msat(queen, secret)
    upload = await client.files.create(file=("z.jsonl", DATA), purpose="fine-tune")
    cases = [
        ({"model": "no-such-model"}, "model"),
        ({"training_file": "file-nope"}, "training_file"),
        ({"validation_file": "file-nope"}, "validation_file"),
        ({"suffix": "has spaces"}, "suffix"),
        ({"hyperparameters": {"n_epochs": 0}}, "hyperparameters.n_epochs"),
        ({"method": {"type": "dpo"}}, "method.type"),
        ({"integrations": [{"type": "wandb", "wandb": {"project": "p"}}]}, "integrations"),
    ]
    for change, param in cases:
        asked = {"model": ECHO_MODEL, "training_file": upload.id, **change}
        with pytest.raises(openai.BadRequestError) as caught:
            await client.fine_tuning.jobs.create(**asked)
        assert caught.value.body["param"] == param, (change, caught.value.body)
    with pytest.raises(openai.BadRequestError) as caught:
        await client.post("/fine_tuning/jobs", cast_to=object,
                          body={"model": ECHO_MODEL, "training_file": upload.id, "beta": 1})
    assert caught.value.body["code"] == "unknown_parameter"
    assert [j async for j in client.fine_tuning.jobs.list()] == []
    assert await available_msat(queen, secret) == before


async def test_a_job_the_balance_cannot_cover_is_a_402_and_nothing_is_made(queen):
    secret = await funded_key(queen, 0.001)
    client = queen.client(api_key=secret)
    upload = await client.files.create(file=("z.jsonl", DATA), purpose="fine-tune")
    with pytest.raises(openai.APIStatusError) as caught:
        await client.fine_tuning.jobs.create(model=ECHO_MODEL, training_file=upload.id)
    assert caught.value.status_code == 402
    assert [j async for j in client.fine_tuning.jobs.list()] == []


async def test_a_model_no_trainer_holds_is_refused_by_name(tmp_path, db_url):
    async with running_queen(tmp_path, auth="keys", db=db_url,
                             files_dir=tmp_path / "files") as queen:
        server = await ScriptedWorker(queen.ws_url).start()  # serves, does not train
        client = queen.client(api_key=await funded_key(queen, 100_000))
        upload = await client.files.create(file=("z.jsonl", DATA), purpose="fine-tune")
        with pytest.raises(openai.BadRequestError) as caught:
            await client.fine_tuning.jobs.create(model=ECHO_MODEL, training_file=upload.id)
        assert caught.value.body["param"] == "model"
        assert "opt in to training" in caught.value.body["message"]
        await server.stop()


async def test_a_job_no_worker_takes_fails_at_its_deadline_and_gives_the_hold_back(queen):
    secret = await funded_key(queen, 100_000)
    client = queen.client(api_key=secret)
    before = await available_msat(queen, secret)
    upload = await client.files.create(file=("z.jsonl", DATA), purpose="fine-tune")
    job = await client.fine_tuning.jobs.create(model=ECHO_MODEL, training_file=upload.id)
    assert await available_msat(queen, secret) < before
    service = queen.state.fine_tuning
    assert await service.expire(datetime.now(UTC)) == 0  # not yet
    assert await service.expire(datetime.now(UTC) + timedelta(seconds=61)) == 1
    failed = await client.fine_tuning.jobs.retrieve(job.id)
    assert failed.status == "failed"
    assert failed.error is not None
    assert (failed.error.code, failed.error.param) == ("no_worker", "model")
    assert await available_msat(queen, secret) == before


async def test_a_file_an_unfinished_job_uses_cannot_be_deleted_until_the_job_ends(queen):
    client = queen.client(api_key=await funded_key(queen, 100_000))
    upload = await client.files.create(file=("z.jsonl", DATA), purpose="fine-tune")
    job = await client.fine_tuning.jobs.create(model=ECHO_MODEL, training_file=upload.id)
    with pytest.raises(openai.BadRequestError) as caught:
        await client.files.delete(upload.id)
    assert (caught.value.body["code"], caught.value.body["param"]) == ("file_in_use", "file_id")
    assert job.id in caught.value.body["message"]
    assert (await client.files.retrieve(upload.id)).id == upload.id  # still there
    await client.fine_tuning.jobs.cancel(job.id)
    assert (await client.files.delete(upload.id)).deleted


async def test_a_running_job_no_replica_runs_any_more_fails_and_gives_its_hold_back(queen):
    """A replica died while it ran a job: no runner here has it, and no event came for
    ``ORPHAN_AFTER`` progress timeouts. It fails (``replica_lost``) and the hold goes back;
    a fresh event keeps it."""
    from queen_server.finetune.service import ORPHAN_AFTER

    secret = await funded_key(queen, 100_000)
    client = queen.client(api_key=secret)
    before = await available_msat(queen, secret)
    upload = await client.files.create(file=("z.jsonl", DATA), purpose="fine-tune")
    job = await client.fine_tuning.jobs.create(model=ECHO_MODEL, training_file=upload.id)
    service = queen.state.fine_tuning
    assert await service.store.change(job.id, {"status": "running", "attempt": 1},
                                      ("info", "Fine-tuning job started"),
                                      only_from=("queued",))  # as another replica's runner
    now = datetime.now(UTC)
    assert await service.expire(now) == 0  # it was heard from just now
    silent_s = ORPHAN_AFTER * queen.state.settings.finetune_progress_timeout_s
    assert await service.expire(now + timedelta(seconds=silent_s - 5)) == 0
    assert await service.expire(now + timedelta(seconds=silent_s + 5)) == 1
    failed = await client.fine_tuning.jobs.retrieve(job.id)
    assert failed.status == "failed"
    assert failed.error is not None
    assert failed.error.code == "replica_lost"
    assert await available_msat(queen, secret) == before
