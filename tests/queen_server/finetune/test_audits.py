"""Answers of fine-tuned (``ft:``) models are audited with base plus adapter (issue 37), against
a real queen (real database) and scripted workers over real websockets and HTTP: the auditor is
a holder of the base with ``lora`` whose score job carries the model's ``Job.adapter`` with a
token that opens the adapter to that auditor only; a holder of the base without ``lora`` is
never asked; a cheat serving ``ft:`` answers is flagged; a deleted model's waiting cases are
dropped. Model groups do not serve ``ft:`` models (a group's head loads no adapter), so no
group case is tested here."""

from __future__ import annotations

import hashlib
from typing import Any

import httpx
import pytest

from queen_server.finetune.models import adapter_url
from shared_schema import Job
from shared_schema.audits import SCORE_URL
from shared_schema.capabilities import AUDITOR, LORA, SCORE
from shared_schema.training import ADAPTER_NAME
from tests.queen_server.audits.test_service import Auditor, score_result
from tests.queen_server.finetune.test_training import settled, start_job
from tests.support.queen import QueenHarness, running_queen
from tests.support.trainers import AdapterServer, ScriptedTrainer
from tests.support.workers import ECHO_MODEL, ECHO_SHA256

HELLO = [{"role": "user", "content": "the capital of zorbania"}]


class LoraAuditor(AdapterServer):
    """An audit-only worker holding the base's file with ``lora``: it fetches each score job's
    adapter with the job's token (as ``AdapterServer`` does), then scores as scripted."""

    def __init__(self, ws_url: str, *, honest: bool = True, **kwargs: Any) -> None:
        super().__init__(ws_url, capabilities=[LORA, SCORE, AUDITOR], sha256=ECHO_SHA256,
                         **kwargs)
        self.honest = honest
        self.scored: list[Job] = []

    async def _run(self, job: Job) -> None:
        if job.openai_url != SCORE_URL:
            await super()._run(job)
            return
        self.scored.append(job)
        if await self._adapter_fetched(job):
            await self._send(score_result(job, self.honest))


@pytest.fixture
async def queen(tmp_path, db_url):
    # Every answer audited; the echo base is pinned by the operator (on no hub here).
    async with running_queen(tmp_path, auth="keys", db=db_url, files_dir=tmp_path / "files",
                             escrow_jobs=0, finetune_dispatch_interval_s=0.2,
                             finetune_progress_timeout_s=5, finetune_max_attempts=2,
                             finetune_upload_min_bytes=64 * 1024, audit_new_rate=1.0,
                             audit_base_rate=1.0, finetune_check_examples=0,  # test_check
                             local_model_pins={ECHO_MODEL: [ECHO_SHA256]}) as queen:
        yield queen


async def trained(queen: QueenHarness) -> tuple[Any, str, bytes]:
    """A succeeded job's owner (SDK client), its model's name and adapter; the trainer gone."""
    trainer = await ScriptedTrainer(queen.ws_url, sha256=ECHO_SHA256).start()
    _, client, job, _ = await start_job(queen)
    done = await settled(client, job.id)
    assert done.status == "succeeded", done.error
    await trainer.stop()
    await queen.wait_until(lambda: len(queen.state.registry) == 0)
    return client, done.fine_tuned_model, trainer.uploads[ADAPTER_NAME]


def trust(queen: QueenHarness, *workers: Any) -> None:
    queen.state.audits.trusted = frozenset(worker.pubkey for worker in workers)


async def audited(queen: QueenHarness, client: Any, name: str) -> None:
    answer = await client.chat.completions.create(model=name, messages=HELLO, temperature=0)
    assert answer.model == name
    await queen.wait_until(lambda: queen.state.audits.idle, 5, "audited")


async def test_an_ft_answer_is_audited_by_a_lora_holder_of_the_base_with_its_adapter(queen):
    client, name, adapter = await trained(queen)
    adapter_sha256 = hashlib.sha256(adapter).hexdigest()
    # Trusted both, the best record both: the one without lora holds the base's very file.
    plain = Auditor(queen.ws_url, audit_only=True)
    lora = LoraAuditor(queen.ws_url)
    trust(queen, plain, lora)
    await plain.start()
    server = await AdapterServer(queen.ws_url, sha256=ECHO_SHA256).start()
    # With only the holder without lora here, the answer's case waits for a lora auditor.
    await client.chat.completions.create(model=name, messages=HELLO, temperature=0)
    assert not queen.state.audits.idle
    await lora.start()
    await queen.wait_until(lambda: queen.state.audits.idle, 5, "audited")
    for _ in range(2):
        await audited(queen, client, name)
    assert plain.scored == []
    assert plain.jobs == []
    assert len(lora.scored) == 3
    for job in lora.scored:
        assert job.openai_req["model"] == name
        assert job.openai_req["request"]["model"] == name
        assert job.openai_req["answer"].strip() == "echo: the capital of zorbania"
        assert job.adapter is not None
        assert (job.adapter.name, job.adapter.base) == (name, ECHO_MODEL)
        assert job.adapter.file.sha256 == adapter_sha256
    assert lora.fetched == {adapter_sha256: adapter}  # its token opened the adapter to it
    standing = queen.state.audits.standing(server.pubkey)
    assert (standing.audited, standing.failed) == (3, 0)
    rows = await queen.state.audits.store.recent(10)
    assert {(row.model, row.auditor_key, row.failed) for row in rows} == {
        (name, lora.pubkey, False)}

    # The auditor's token opens the adapter to that auditor only: not on another's path.
    ref = lora.scored[0].adapter
    job_id = ref.file.url.rsplit("/", 2)[-2]
    auth = {"Authorization": f"Bearer {ref.token}"}
    async with httpx.AsyncClient(base_url=queen.base_url, trust_env=False) as http:
        assert (await http.get(ref.file.url, headers=auth)).status_code == 200
        stolen = await http.get(adapter_url(job_id, server.pubkey), headers=auth)
        assert stolen.status_code in (401, 403, 404)

    card = await client.models.retrieve(name)
    assert card.model_extra["apiary"]["audited"] is True
    for worker in (plain, lora, server):
        await worker.stop()


async def test_a_cheat_serving_ft_answers_is_flagged_by_a_lora_auditor(queen):
    client, name, _ = await trained(queen)
    lora = LoraAuditor(queen.ws_url, honest=False)  # its scores say the answers are garbage
    trust(queen, lora)
    await lora.start()
    cheat = await AdapterServer(queen.ws_url, sha256=ECHO_SHA256).start()
    for _ in range(20):
        if queen.state.audits.standing(cheat.pubkey).state == "flagged":
            break
        await audited(queen, client, name)
    assert queen.state.audits.standing(cheat.pubkey).state == "flagged"
    assert queen.state.registry.get(cheat.pubkey).flagged  # out of routing
    rows = await queen.state.audits.store.recent(20, worker_key=cheat.pubkey)
    assert rows
    assert all(row.model == name and row.failed for row in rows)
    assert all(job.adapter is not None and job.adapter.name == name for job in lora.scored)
    await lora.stop()
    await cheat.stop()


async def test_a_deleted_ft_model_s_waiting_cases_are_dropped(queen):
    client, name, _ = await trained(queen)
    server = await AdapterServer(queen.ws_url, sha256=ECHO_SHA256).start()
    await client.chat.completions.create(model=name, messages=HELLO, temperature=0)
    audits = queen.state.audits
    assert not audits.idle  # its case waits: no auditor holds the base with lora
    await client.models.delete(name)
    await queen.wait_until(lambda: audits.idle, 5, "the deleted model's case dropped")
    lora = LoraAuditor(queen.ws_url)
    trust(queen, lora)
    await lora.start()
    await queen.wait_until(lambda: queen.state.registry.get(lora.pubkey) is not None, 5,
                           "the auditor joined")
    assert audits.idle
    assert lora.scored == []
    assert audits.standing(server.pubkey).audited == 0  # dropped, never judged
    await lora.stop()
    await server.stop()
