"""A fine-tuning job's adapter checked on held-out examples before it succeeds (issue 37),
through the official ``openai`` SDK against a real queen, a scripted trainer and scripted
scorers over real websockets and HTTP: the held-out slice is never served to the trainer (and
the order describes exactly what is); an adapter that lowers the held-out loss succeeds with
both losses in its events, one that does not fails with nothing charged and is counted against
its trainer; the check runs on another worker than the trainer when one exists, and a scorer
that goes away is replaced, or the job fails cleanly."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest

from queen_server.finetune.checks import example_of
from shared_schema.training import ADAPTER_NAME
from tests.queen_server.finetune.test_jobs_api import available_msat, funded_key
from tests.queen_server.finetune.test_training import available_when, settled
from tests.support.queen import QueenHarness, running_queen
from tests.support.trainers import (
    ScoreScript,
    ScoringTrainer,
    ScriptedScorer,
    ScriptedTrainer,
    fetch_adapter,
)
from tests.support.workers import ECHO_MODEL

EXAMPLES = 40
HELD = 4  # 10 % of 40


def line(index: int) -> bytes:
    return json.dumps({"messages": [
        {"role": "user", "content": f"What is fact number {index}?"},
        {"role": "assistant", "content": f"Fact {index} is that lumbrix {index} glows."},
    ]}).encode()


DATA = b"".join(line(index) + b"\n" for index in range(EXAMPLES))


@pytest.fixture
async def queen(tmp_path, db_url):
    async with running_queen(tmp_path, auth="keys", db=db_url, files_dir=tmp_path / "files",
                             escrow_jobs=0, finetune_dispatch_interval_s=0.2,
                             finetune_progress_timeout_s=5, finetune_max_attempts=2,
                             finetune_upload_min_bytes=64 * 1024,
                             finetune_check_timeout_s=5) as queen:
        yield queen


async def start(queen: QueenHarness, *,
                validation: bytes | None = None) -> tuple[str, Any, Any, int]:
    secret = await funded_key(queen, 100_000)
    client = queen.client(api_key=secret)
    upload = await client.files.create(file=("facts.jsonl", DATA), purpose="fine-tune")
    extra: dict[str, Any] = {}
    if validation is not None:
        extra["validation_file"] = (await client.files.create(
            file=("valid.jsonl", validation), purpose="fine-tune")).id
    before = await available_msat(queen, secret)
    job = await client.fine_tuning.jobs.create(
        model=ECHO_MODEL, training_file=upload.id, suffix="facts",
        method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 1}}},
        **extra)
    return secret, client, job, before


async def messages_of(client: Any, job_id: str) -> list[Any]:
    return [event async for event in client.fine_tuning.jobs.list_events(job_id)]


async def test_the_held_out_lines_are_never_served_and_the_order_describes_what_is(queen):
    trainer = await ScriptedTrainer(queen.ws_url).start()
    scorer = await ScriptedScorer(queen.ws_url).start()
    _, client, job, _ = await start(queen)
    done = await settled(client, job.id)
    assert done.status == "succeeded", done.error
    served, order = trainer.data[0], trainer.orders[0]
    assert order.data.sha256 == hashlib.sha256(served).hexdigest()
    assert order.data.size_bytes == len(served)
    kept = served.splitlines()
    assert order.examples == len(kept) == EXAMPLES - HELD
    everything = {line(index) for index in range(EXAMPLES)}
    held = everything - set(kept)
    assert len(held) == HELD
    assert set(kept) <= everything
    # the scorer was asked about the held-out examples, and only them
    asked = {request.answer for _, request in scorer.script.scored}
    assert asked == {example_of(row).answer for row in held}  # type: ignore[union-attr]
    await trainer.stop()
    await scorer.stop()


async def test_an_adapter_that_learned_succeeds_with_both_losses_checked_on_another_worker(
        queen):
    trainer = await ScoringTrainer(queen.ws_url).start()  # could score, but trained it
    scorer = await ScriptedScorer(queen.ws_url, ScoreScript(-2.0, -0.5)).start()
    secret, client, job, before = await start(queen)
    done = await settled(client, job.id)
    assert done.status == "succeeded", done.error
    assert trainer.script.scored == []
    pairs = scorer.script.scored
    assert sorted(adapted for adapted, _ in pairs) == [False] * HELD + [True] * HELD
    assert all(request.model == done.fine_tuned_model for adapted, request in pairs if adapted)
    assert all(request.model == ECHO_MODEL for adapted, request in pairs if not adapted)
    assert scorer.script.fetched == [trainer.uploads[ADAPTER_NAME]] * HELD
    events = await messages_of(client, job.id)
    check = [event for event in events if event.message.startswith("Held-out check passed")]
    assert len(check) == 1
    assert check[0].type == "metrics"
    assert check[0].data["full_valid_loss"] == pytest.approx(0.5)
    assert check[0].data["base_full_valid_loss"] == pytest.approx(2.0)
    assert not any("the worker that trained it" in event.message for event in events)
    assert await available_when(queen, secret, before) < before  # charged
    await trainer.stop()
    await scorer.stop()


async def test_an_adapter_that_did_not_learn_fails_uncharged_and_counts_against_its_trainer(
        queen):
    trainer = await ScriptedTrainer(queen.ws_url).start()
    scorer = await ScriptedScorer(queen.ws_url, ScoreScript(-2.0, -2.0)).start()
    secret, client, job, before = await start(queen)
    done = await settled(client, job.id)
    assert done.status == "failed"
    assert done.error.code == "adapter_not_learned"
    assert "did not learn: held-out loss 2.0000 vs base 2.0000" in done.error.message
    assert done.fine_tuned_model is None
    assert await available_when(queen, secret, before) == before
    assert queen.state.fine_tuning.runner.not_learned == {trainer.pubkey: 1}
    assert (await queen.state.billing.ledger.check()).clean
    # the scorer's adapter token opens nothing once the job failed
    adapted = [request for adapted, request in scorer.script.scored if adapted]
    assert adapted
    assert await scorer_refused(queen, scorer, job.id)
    await trainer.stop()
    await scorer.stop()


async def scorer_refused(queen: QueenHarness, scorer: ScriptedScorer, job_id: str) -> bool:
    from queen_server.finetune.models import FineTunedModel

    row = await queen.state.fine_tuning.store.attempt_row(job_id)
    model = FineTunedModel(name=f"ft:{ECHO_MODEL}::x" + "0" * 8, base=ECHO_MODEL,
                           owner=row.owner, job_id=job_id, created=0,
                           sha256=row.adapter_sha256, size_bytes=row.adapter_size_bytes)
    status, _ = await fetch_adapter(scorer.http_url,
                                    model.ref(queen.state.fine_tuning.secret, scorer.pubkey))
    return status == 401


async def test_with_no_other_scorer_the_trainer_checks_its_own_adapter_and_says_so(queen):
    trainer = await ScoringTrainer(queen.ws_url).start()
    _, client, job, _ = await start(queen)
    done = await settled(client, job.id)
    assert done.status == "succeeded", done.error
    assert len(trainer.script.scored) == 2 * HELD
    events = await messages_of(client, job.id)
    assert any("the worker that trained it" in event.message for event in events)
    await trainer.stop()


async def test_a_scorer_that_goes_away_is_replaced_by_another(queen):
    trainer = await ScriptedTrainer(queen.ws_url).start()
    gone = await ScriptedScorer(queen.ws_url, ScoreScript(behaviour="vanish")).start()
    honest = await ScriptedScorer(queen.ws_url).start()
    # the operator trusts the one that will vanish: it is asked first
    queen.state.settings.trusted_auditors = [gone.pubkey]
    _, client, job, _ = await start(queen)
    done = await settled(client, job.id)
    assert done.status == "succeeded", done.error
    assert gone.closed.is_set()
    assert len(honest.script.scored) == 2 * HELD
    events = [event.message for event in await messages_of(client, job.id)]
    assert sum(message.startswith("Checking the adapter") for message in events) == 2
    await trainer.stop()
    await honest.stop()


@pytest.mark.parametrize("behaviour", ["vanish", "uneven"])
async def test_with_no_scorer_to_believe_the_job_fails_cleanly_and_nothing_is_charged(
        queen, behaviour):
    trainer = await ScriptedTrainer(queen.ws_url).start()
    scorer = await ScriptedScorer(queen.ws_url, ScoreScript(behaviour=behaviour)).start()
    secret, client, job, before = await start(queen)
    done = await settled(client, job.id)
    assert done.status == "failed"
    assert done.error.code == "adapter_unchecked"
    assert "could not be checked" in done.error.message
    assert await available_when(queen, secret, before) == before
    assert queen.state.fine_tuning.runner.not_learned == {}
    await trainer.stop()
    await scorer.stop()


async def test_a_validation_file_is_the_held_out_set_and_the_training_file_is_served_whole(
        queen):
    trainer = await ScriptedTrainer(queen.ws_url).start()
    scorer = await ScriptedScorer(queen.ws_url).start()
    validation = b"".join(line(100 + index) + b"\n" for index in range(12))
    _, client, job, _ = await start(queen, validation=validation)
    done = await settled(client, job.id)
    assert done.status == "succeeded", done.error
    assert trainer.data == [DATA]
    assert trainer.orders[0].examples == EXAMPLES
    asked = {request.answer for adapted, request in scorer.script.scored if not adapted}
    assert len(asked) == 12  # all of them: 12 is within the bound of 16
    assert all(answer.startswith("Fact 1") for answer in asked)
    await trainer.stop()
    await scorer.stop()


async def test_a_trainer_whose_adapters_do_not_learn_gets_no_more_jobs_even_after_a_restart(
        tmp_path, db_url):
    """Counted against the worker (issue 37): past ``finetune_max_not_learned`` failed checks
    it is not given another job, by this queen or the next on the same database."""
    settings = {"auth": "keys", "db": db_url, "files_dir": tmp_path / "files", "escrow_jobs": 0,
                "finetune_dispatch_interval_s": 0.2, "finetune_progress_timeout_s": 5,
                "finetune_upload_min_bytes": 64 * 1024, "finetune_check_timeout_s": 5,
                "finetune_max_not_learned": 1}
    async with running_queen(tmp_path / "one", **settings) as queen:
        trainer = await ScriptedTrainer(queen.ws_url).start()
        scorer = await ScriptedScorer(queen.ws_url, ScoreScript(-2.0, -2.0)).start()
        _, client, job, _ = await start(queen)
        done = await settled(client, job.id)
        assert done.error.code == "adapter_not_learned"
        _, client, second, _ = await start(queen)  # queued: its only trainer is out
        runner = queen.state.fine_tuning.runner
        assert await runner.dispatch() == 0
        assert len(trainer.orders) == 1
        assert (await client.fine_tuning.jobs.retrieve(second.id)).status == "queued"
        key = trainer.key
        await trainer.stop()
        await scorer.stop()
    async with running_queen(tmp_path / "two", **settings) as queen:
        runner = queen.state.fine_tuning.runner
        await queen.wait_until(lambda: runner.not_learned.get(trainer.pubkey) == 1, 5,
                               "the count read back from the database")
        trainer = await ScriptedTrainer(queen.ws_url, key=key).start()
        fresh = await ScriptedTrainer(queen.ws_url).start()
        _, client, job, _ = await start(queen)
        await queen.wait_until(lambda: len(fresh.orders) == 1, 30, "the other trainer's job")
        assert trainer.orders == []
        await trainer.stop()
        await fresh.stop()
