"""Fine-tuning jobs trained on workers (issue 37), through the official ``openai`` SDK against a
real queen and scripted trainers over real websockets and HTTP: the happy path and its money, a
lost worker's job resumed on another from its checkpoint, a cancel mid-run charged what was
trained, every lie refused, and the transfers' hostile cases."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from queen_server.billing import ledger
from queen_server.finetune.plan import training_cost_msat
from queen_server.storage.tables import FineTuningUploadRow
from tests.queen_server.finetune.test_jobs_api import DATA, available_msat, funded_key
from tests.support.queen import QueenHarness, running_queen
from tests.support.trainers import CHECKPOINT_STEP, TOKENS_PER_STEP, TOTAL_STEPS, ScriptedTrainer
from tests.support.workers import ECHO_MODEL

ALL_TOKENS = TOTAL_STEPS * TOKENS_PER_STEP


@pytest.fixture
async def queen(tmp_path, db_url):
    async with running_queen(tmp_path, auth="keys", db=db_url, files_dir=tmp_path / "files",
                             escrow_jobs=0, finetune_dispatch_interval_s=0.2,
                             finetune_progress_timeout_s=5, finetune_max_attempts=2,
                             finetune_upload_min_bytes=64 * 1024,
                             finetune_check_examples=0) as queen:  # checks: test_check.py
        yield queen


def holds(registry: Any, trainer: ScriptedTrainer) -> bool:
    """Whether the queen routes ``trainer`` for the scripted base model."""
    return any(worker.key == trainer.pubkey for worker in registry.holders(ECHO_MODEL))


async def settled(client: Any, job_id: str, timeout_s: float = 15) -> Any:
    """Poll the job as the SDK's users do, until it has finished."""
    async with asyncio.timeout(timeout_s):
        while True:
            job = await client.fine_tuning.jobs.retrieve(job_id)
            if job.status in {"succeeded", "failed", "cancelled"}:
                return job
            await asyncio.sleep(0.05)


async def start_job(queen: QueenHarness, **hyper: Any) -> tuple[str, Any, Any, int]:
    """A funded key's job; and the key's balance before the job's hold."""
    secret = await funded_key(queen, 100_000)
    client = queen.client(api_key=secret)
    upload = await client.files.create(file=("zorbania.jsonl", DATA), purpose="fine-tune")
    before = await available_msat(queen, secret)
    job = await client.fine_tuning.jobs.create(
        model=ECHO_MODEL, training_file=upload.id, suffix="zorbania",
        method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 1,
                                                                          **hyper}}})
    return secret, client, job, before


async def available_when(queen: QueenHarness, secret: str, expected: int) -> int:
    """The key's available balance once it is ``expected`` (or after 5 s): a job's status
    changes first, and its money follows in the same step of the queen's work."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(5):
            # the ledger has no change events for tests to await: poll it briefly
            while await available_msat(queen, secret) != expected:  # noqa: ASYNC110
                await asyncio.sleep(0.02)
    return await available_msat(queen, secret)


def cost(queen: QueenHarness, tokens: int) -> int:
    price = queen.state.fine_tuning.training_price(ECHO_MODEL)
    return training_cost_msat(tokens, price.completion_msat_per_1k)


async def earned(queen: QueenHarness, worker_key: str) -> int:
    balances = await queen.state.billing.ledger.balances()
    return balances.get(ledger.worker_available(worker_key), 0)


async def credited(queen: QueenHarness, worker_key: str) -> int:
    """What a worker was credited, in escrow (pending) or not."""
    balances = await queen.state.billing.ledger.balances()
    return (balances.get(ledger.worker_available(worker_key), 0)
            + balances.get(ledger.worker_pending(worker_key), 0))


async def proven(queen: QueenHarness, trainer: ScriptedTrainer) -> None:
    """A worker's first job is its unpaid proof of work: serve one chat first."""
    client = queen.client(api_key=await funded_key(queen, 1000))
    await client.chat.completions.create(model=ECHO_MODEL,
                                         messages=[{"role": "user", "content": "hi"}])


async def test_a_job_trains_succeeds_and_is_paid_for_its_trained_tokens(queen):
    trainer = await ScriptedTrainer(queen.ws_url).start()
    await proven(queen, trainer)
    worker_before = await earned(queen, trainer.pubkey)
    secret, client, job, before = await start_job(queen)
    done = await settled(client, job.id)
    assert done.status == "succeeded", done.error
    assert done.fine_tuned_model == f"ft:{ECHO_MODEL}:zorbania:{job.id[6:18]}"
    assert done.trained_tokens == ALL_TOKENS
    assert done.finished_at is not None
    order = trainer.orders[0]
    assert trainer.data == [DATA]
    assert order.resume is None
    assert order.max_trained_tokens == (await queen.state.fine_tuning.store.attempt_row(
        job.id)).bound_tokens
    assert order.n_ctx % 256 == 0
    assert order.progress_every_steps == 25

    events = [e async for e in client.fine_tuning.jobs.list_events(job.id)]
    messages = [e.message for e in events]
    assert "Fine-tuning job started" in messages
    assert f"Step {TOTAL_STEPS}/{TOTAL_STEPS}: training loss=0.5000" in messages
    metrics = [e for e in events if e.type == "metrics"]
    assert len(metrics) == TOTAL_STEPS  # one event per report
    assert metrics[0].data["step"] == TOTAL_STEPS
    assert messages[0].startswith("The job has successfully completed")

    checkpoints = [c async for c in client.fine_tuning.jobs.checkpoints.list(job.id)]
    assert [c.step_number for c in checkpoints] == [CHECKPOINT_STEP]
    assert checkpoints[0].fine_tuned_model_checkpoint == (
        f"{done.fine_tuned_model}:ckpt-step-{CHECKPOINT_STEP}")
    assert checkpoints[0].metrics.train_loss == pytest.approx(2.0 / CHECKPOINT_STEP)

    row = await queen.state.fine_tuning.store.attempt_row(job.id)
    reader = await queen.state.files.blobs.open(row.adapter_location)
    assert reader.read() == trainer.uploads["adapter.gguf"]  # kept where the row says
    reader.close()

    charge = cost(queen, ALL_TOKENS)
    assert await available_when(queen, secret, before - charge) == before - charge
    assert row.charged_msat == charge
    share = await earned(queen, trainer.pubkey) - worker_before
    assert share == int(charge * queen.state.settings.worker_share)
    assert (await queen.state.billing.ledger.check()).clean
    await trainer.stop()


async def test_a_lost_worker_s_job_resumes_on_another_from_its_checkpoint(queen):
    # Both past their unpaid proof of work (a chat each, alone), so their credits show.
    second = await ScriptedTrainer(queen.ws_url).start()
    await proven(queen, second)
    await second.stop()
    await queen.wait_until(lambda: queen.state.registry.get(second.pubkey) is None, 5,
                           "the second worker gone for now")
    first = await ScriptedTrainer(queen.ws_url).start()
    await proven(queen, first)
    first.behaviour = "die_mid"  # it drops its connection after its checkpoint
    first_before = await credited(queen, first.pubkey)
    second_before = await credited(queen, second.pubkey)
    secret, client, job, before = await start_job(queen)
    await asyncio.wait_for(first.closed.wait(), 10)
    second = await ScriptedTrainer(queen.ws_url, key=second.key).start()
    done = await settled(client, job.id)
    assert done.status == "succeeded", done.error
    assert len(second.orders) == 1
    resume = second.orders[0].resume
    assert resume is not None
    assert (resume.step, resume.trained_tokens) == (CHECKPOINT_STEP,
                                                    CHECKPOINT_STEP * TOKENS_PER_STEP)
    assert second.resumed == [first.uploads[f"checkpoint-{CHECKPOINT_STEP:08d}.gguf"]]
    assert second.orders[0].token != first.orders[0].token
    assert done.trained_tokens == ALL_TOKENS
    messages = [e.message async for e in client.fine_tuning.jobs.list_events(job.id)]
    assert any("resume from step 2" in m for m in messages)
    assert any(m.startswith("Fine-tuning job resumed (attempt 2)") for m in messages)
    # Each worker is credited its own part: the first up to the checkpoint the job went on
    # from, the second the rest; the caller is charged the whole once.
    charge = cost(queen, ALL_TOKENS)
    assert await available_when(queen, secret, before - charge) == before - charge
    share = queen.state.settings.worker_share
    first_part = CHECKPOINT_STEP * TOKENS_PER_STEP
    first_earned = await credited(queen, first.pubkey) - first_before
    second_earned = await credited(queen, second.pubkey) - second_before
    assert first_earned > 0
    assert second_earned > 0
    assert first_earned + second_earned <= int(charge * share)
    assert first_earned / (first_earned + second_earned) == pytest.approx(
        first_part / ALL_TOKENS, abs=0.02)
    assert (await queen.state.billing.ledger.check()).clean
    await second.stop()


async def test_cancel_mid_run_stops_the_worker_and_charges_what_was_trained(queen):
    trainer = await ScriptedTrainer(queen.ws_url, behaviour="gated").start()
    secret, client, job, before = await start_job(queen)
    await asyncio.wait_for(trainer.reported.wait(), 10)
    await queen.wait_until(lambda: _reports_seen(queen, job.id) >= CHECKPOINT_STEP)
    cancelled = await client.fine_tuning.jobs.cancel(job.id)
    assert cancelled.status == "cancelled"
    assert cancelled.fine_tuned_model is None
    await asyncio.wait_for(trainer.cancelled.wait(), 5)
    assert trainer.cancels[0].id == f"train-{job.id}-1"
    trained = CHECKPOINT_STEP * TOKENS_PER_STEP
    assert await available_when(queen, secret, before - cost(queen, trained)) == (
        before - cost(queen, trained))
    assert (await client.fine_tuning.jobs.retrieve(job.id)).trained_tokens == trained
    assert (await queen.state.billing.ledger.check()).clean
    trainer.release.set()
    await trainer.stop()


def _reports_seen(queen: QueenHarness, job_id: str) -> int:
    run = queen.state.fine_tuning.runner.running(job_id)
    return run.progress.step if run is not None else 0


@pytest.mark.parametrize(("behaviour", "said"), [
    ("lie_backwards", "trained tokens after"),
    ("lie_over_bound", "past the job's bound"),
    ("phantom_checkpoint", "did not receive whole"),
    ("silent", "no progress"),
])
async def test_a_lying_or_silent_worker_fails_its_attempts_and_nothing_is_charged(
        queen, behaviour, said):
    queen.state.settings.finetune_progress_timeout_s = 0.5
    trainer = await ScriptedTrainer(queen.ws_url, behaviour=behaviour).start()
    secret, client, job, before = await start_job(queen)
    done = await settled(client, job.id)
    assert done.status == "failed"
    assert done.error is not None
    assert said in done.error.message
    assert "2 attempt(s)" in done.error.message  # retried (the same worker, later), then failed
    assert done.fine_tuned_model is None
    assert await available_when(queen, secret, before) == before
    assert (await queen.state.billing.ledger.check()).clean
    await trainer.stop()


async def test_transfers_refuse_every_hostile_request_and_keep_nothing(queen):
    # The gated trainer sends no progress while the hostile requests run: on a loaded machine
    # they could outlast the fixture's 5 s, and the attempt would end under them (CI saw a 401).
    queen.state.settings.finetune_progress_timeout_s = 120
    trainer = await ScriptedTrainer(queen.ws_url, behaviour="gated").start()
    _, client, job, _ = await start_job(queen)
    await asyncio.wait_for(trainer.reported.wait(), 10)
    order = trainer.orders[0]
    good = {"Authorization": f"Bearer {order.token}"}
    async with httpx.AsyncClient(base_url=queen.base_url, trust_env=False) as http:
        assert (await http.get(order.data.url, headers=good)).status_code == 200
        for headers in ({}, {"Authorization": "Bearer " + "0" * 64},
                        {"Authorization": order.token}):
            answer = await http.get(order.data.url, headers=headers)
            assert answer.status_code == 401
            assert answer.json()["error"]["code"] == "invalid_transfer_token"
        # another attempt's path with this attempt's token
        other = order.data.url.replace(f"{job.id}-1/", f"{job.id}-2/")
        assert (await http.get(other, headers=good)).status_code == 401

        async def body(size: int):  # streamed: no Content-Length to refuse it by
            for _ in range(size // 8192):
                yield b"\0" * 8192

        big = await http.put(f"{order.upload}/checkpoint-00000009.gguf", headers=good,
                             content=body(256 * 1024))
        assert big.status_code == 413
        assert big.json()["error"]["code"] == "upload_too_large"
        for name in ("model.bin", "adapter.GGUF", "checkpoint-1.gguf", "..%2Fadapter.gguf",
                     "x" * 100 + ".gguf"):
            bad = await http.put(f"{order.upload}/{name}", headers=good, content=b"GGUF")
            assert bad.status_code in (400, 404), (name, bad.status_code)
        trick = await http.put(f"{order.upload}/../../data", headers=good, content=b"GGUF")
        assert trick.status_code in (401, 404, 405)
        await client.fine_tuning.jobs.cancel(job.id)
        after = await http.get(order.data.url, headers=good)
        assert after.status_code == 401  # the attempt ended: its token opens nothing
        late = await http.put(f"{order.upload}/adapter.gguf", headers=good, content=b"GGUF")
        assert late.status_code == 401
    async with queen.state.db.engine.connect() as conn:
        names = (await conn.execute(select(FineTuningUploadRow.name).where(
            FineTuningUploadRow.job_id == job.id))).scalars().all()
    assert names == [f"checkpoint-{CHECKPOINT_STEP:08d}.gguf"]  # only the honest upload
    trainer.release.set()
    await trainer.stop()


async def test_a_trainer_without_the_memory_for_the_base_is_never_given_the_job(queen):
    """Training takes an F32 copy of the base and half as much again, plus the runtime
    (``train_memory_mb``): a worker whose owner allows less never gets the job; one whose
    owner allows enough does (its budget is its hello's claim)."""
    from shared_schema.training import train_memory_mb

    need = train_memory_mb(135_000_000)  # the scripted workers' base
    registry = queen.state.registry
    small = await ScriptedTrainer(queen.ws_url).start()
    registry.get(small.pubkey).memory_budget_mb = need - 1
    # Twice in full CI runs (never alone) a trainer just welcomed was not among the model's
    # holders yet: wait for the queen's own view instead of assuming it.
    await queen.wait_until(lambda: holds(registry, small), timeout_s=20,
                           what="the small trainer among the model's holders")
    _, client, job, _ = await start_job(queen)
    runner = queen.state.fine_tuning.runner
    assert await runner.dispatch() == 0
    assert small.orders == []
    big = await ScriptedTrainer(queen.ws_url).start()
    registry.get(big.pubkey).memory_budget_mb = need
    await queen.wait_until(lambda: holds(registry, big), timeout_s=20,
                           what="the big trainer among the model's holders")
    done = await settled(client, job.id, timeout_s=30)
    assert done.status == "succeeded", done.error
    assert (len(small.orders), len(big.orders)) == (0, 1)
    await small.stop()
    await big.stop()
