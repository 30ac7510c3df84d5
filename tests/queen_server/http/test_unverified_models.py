"""Unverifiable models (issue 39): a model the queen cannot pin to a file it read itself is
served, priced as unverified and never audited (no case is made, rather than one that waits
for an auditor holding a made-up file and expires), routed in a lower tier (a worker the audits
have not proven gets its answers only when no proven one is free), and ``/v1/models`` says so
in a shape the openai SDK reads. An operator pins a local name to sha256s: a holder of such a
file serves it and is audited; a worker claiming the pinned name with another file serves
nothing. A real queen, scripted workers over real websockets, the openai SDK."""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import pytest
from pydantic import ValidationError

from queen_server import reports
from queen_server.settings import QueenSettings
from tests.support.queen import QueenHarness, running_queen
from tests.support.workers import ECHO_MODEL, ScriptedWorker

LOCAL = "my-finetune.Q4_K_M"
GOOD_SHA, OTHER_SHA = "ab" * 32, "cd" * 32
# Every answer of a new worker is drawn for an audit: any case that is made shows.
AUDIT_ALL = {"audit_new_rate": 1.0, "audit_base_rate": 1.0}


def queued(queen: QueenHarness) -> float:
    value = queen.state.metrics.registry.get_sample_value("apiary_audits_total",
                                                          {"outcome": "queued"})
    return value or 0.0


async def card(queen: QueenHarness, name: str) -> dict[str, Any]:
    """The model's ``apiary`` extension as the openai SDK hands it over."""
    models = {model.id: model for model in (await queen.client().models.list()).data}
    extra = models[name].model_extra or {}
    return extra["apiary"]


async def ask(queen: QueenHarness, name: str) -> str:
    answer = await queen.client().chat.completions.create(
        model=name, messages=[{"role": "user", "content": "hello there"}], max_tokens=4)
    return answer.choices[0].message.content or ""


@pytest.mark.parametrize("name", [LOCAL, ECHO_MODEL], ids=["local name", "unreadable hub name"])
async def test_an_unverifiable_model_is_served_but_never_audited(tmp_path, name: str) -> None:
    async with running_queen(tmp_path, **AUDIT_ALL) as queen:
        worker = await ScriptedWorker(queen.ws_url, models=[name], sha256=OTHER_SHA).start()
        try:
            await queen.wait_until(lambda: name in queen.state.registry.model_names())
            assert queen.state.audits.enabled
            for _ in range(3):
                assert await ask(queen, name)
            assert len(worker.jobs) == 3
            assert queued(queen) == 0  # no case made (it could only have expired)
            apiary = await card(queen, name)
            assert (apiary["verified"], apiary["audited"]) == (False, False)
            assert apiary["price"]["basis"] != "verified"
            rows = [row for row in await _admin_models(queen) if row["id"] == name]
            assert rows[0]["audited"] == "no"
        finally:
            await worker.stop()


async def test_a_pinned_local_name_is_served_and_audited_only_on_its_pinned_file(
        tmp_path) -> None:
    """The hostile side: a worker claims the operator's pinned local name with another file.
    It is not verified: it gets none of the name's jobs, no audit is made against its file,
    and alone it cannot serve the name at all."""
    async with running_queen(tmp_path, local_model_pins={LOCAL: [GOOD_SHA.upper()]},
                             **AUDIT_ALL) as queen:
        catalog = queen.state.catalog
        hostile = await ScriptedWorker(queen.ws_url, models=[LOCAL], sha256=OTHER_SHA).start()
        honest = await ScriptedWorker(queen.ws_url, models=[LOCAL], sha256=GOOD_SHA).start()
        try:
            await queen.wait_until(lambda: len(queen.state.registry.holders(LOCAL)) == 2)
            for _ in range(4):
                assert await ask(queen, LOCAL)
            assert (len(honest.jobs), len(hostile.jobs)) == (4, 0)
            assert queued(queen) >= 1  # the honest answers are audited, on the pinned file
            assert catalog.audit_file(LOCAL, GOOD_SHA) == GOOD_SHA
            assert catalog.audit_file(LOCAL, OTHER_SHA) is None
            apiary = await card(queen, LOCAL)
            assert (apiary["verified"], apiary["audited"]) == (True, True)
            [row] = [row for row in await _admin_models(queen) if row["id"] == LOCAL]
            assert (row["verified"], row["audited"]) == ("operator", "yes")
            assert row["pinned_files"] == [GOOD_SHA[:12] + "…"]

            await honest.stop()
            await queen.wait_until(lambda: len(queen.state.registry.holders(LOCAL)) == 1)
            with pytest.raises(openai.NotFoundError) as refused:
                await ask(queen, LOCAL)
            assert refused.value.body["code"] == "model_not_found"  # type: ignore[index]
            assert hostile.jobs == []
        finally:
            await hostile.stop()
            await honest.stop()


def test_local_pins_are_checked_when_the_queen_starts() -> None:
    with pytest.raises(ValidationError, match="not a sha256"):
        QueenSettings(local_model_pins={LOCAL: ["not-a-hash"]})
    with pytest.raises(ValidationError, match="no sha256"):
        QueenSettings(local_model_pins={LOCAL: []})


async def _admin_models(queen: QueenHarness) -> list[dict[str, Any]]:
    return await reports.models(queen.state)


async def test_an_unverifiable_model_goes_to_a_proven_worker_before_a_newcomer(tmp_path) -> None:
    """Nobody can audit its answers, so a newcomer (no standing yet) gets them only while the
    worker in good standing is busy, though its speed record is a hundred times better; for a
    model the audits check, that speed wins."""
    from queen_server.audits.decision import SprtParams, Standing
    from queen_server.audits.store import Record
    from queen_server.stats.ema import Speed

    async with running_queen(tmp_path, **AUDIT_ALL) as queen:
        store = queen.state.audits.store
        assert store is not None
        proven = ScriptedWorker(queen.ws_url, models=[LOCAL], sha256=OTHER_SHA, max_jobs=1,
                                behaviour="gated")
        newcomer = ScriptedWorker(queen.ws_url, models=[LOCAL], sha256=OTHER_SHA, max_jobs=1)
        await store.save(proven.pubkey, Record(Standing(SprtParams().lower, 30, 0, "good")))
        size_class = queen.state.price_of(LOCAL).size_class
        for worker, s_per_token in ((proven, 1.0), (newcomer, 0.01)):
            queen.state.stats.index_speed(worker.pubkey, size_class,
                                          Speed(completion_s_per_token=s_per_token))
        await proven.start()
        await newcomer.start()
        try:
            await queen.wait_until(lambda: len(queen.state.registry.holders(LOCAL)) == 2)
            assert queen.state.registry.get(proven.pubkey).trust < 1.0
            unaudited = queen.state.registry.free.unaudited
            assert unaudited is not None
            assert unaudited(LOCAL)
            first = asyncio.create_task(ask(queen, LOCAL))  # the proven worker takes it
            await queen.wait_until(lambda: len(proven.jobs) == 1, 5, "the proven worker's job")
            assert await ask(queen, LOCAL)  # it is busy: the newcomer serves this one
            assert (len(proven.jobs), len(newcomer.jobs)) == (1, 1)
            proven.release.set()
            assert await first
            for _ in range(3):  # both free again: the proven worker first, every time
                assert await ask(queen, LOCAL)
            assert (len(proven.jobs), len(newcomer.jobs)) == (4, 1)
        finally:
            await proven.stop()
            await newcomer.stop()
