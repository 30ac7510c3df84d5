"""The audit service under a real queen: scripted workers answer, scripted auditors re-score
(honest or lying), and the queen samples, judges, flags, refunds, forfeits and clears.

The auditors here speak the real ``score`` wire shape (``shared_schema.audits.ScoreData``);
the real re-scoring on SmolLM2 is tested on the worker (``tests/desktop_worker/engine``) and
end to end (``tests/e2e/test_audits.py``)."""

from __future__ import annotations

from typing import Any

import pytest

from queen_server.audits.decision import Standing
from queen_server.billing import ledger
from queen_server.identity import public_id
from shared_schema import Job, Result, Usage
from shared_schema.audits import SCORE_URL
from shared_schema.capabilities import AUDITOR, CHOICES, SCORE
from tests.support.queen import running_queen
from tests.support.workers import ECHO_MODEL, ECHO_SHA256, ScriptedWorker

WORDS = "one two three four five six seven eight"
# The prompt tokens a ScriptedWorker honestly claims; the scripted auditors count the same.
PROMPT_TOKENS = 7
MESSAGES = [{"role": "user", "content": WORDS}]


def scores(tokens: int, temperature: float, honest: bool) -> dict[str, Any]:
    """A score result: honest answers are the model's top choice (greedy) or sampled at its
    expectation; a cheat's sit far below."""
    miss = 0.0 if honest else 3.0
    data: dict[str, Any] = {
        "object": "apiary.score", "prompt_tokens": PROMPT_TOKENS, "answer_tokens": tokens,
        "logprobs": [-0.1 - miss] * tokens, "argmax": [honest] * tokens,
        "best_logprobs": [-0.1] * tokens, "end_logprob": -0.05 - miss,
        "end_best_logprob": -0.05, "temperature": temperature, "sampled": None,
        "constraints_replayed": True}  # an auditor of issue 39's: it scores continuations
    if temperature > 0:
        data["sampled"] = {"logprobs": [-1.0 - miss] * tokens, "expected": [-1.0] * tokens,
                           "variances": [1.0] * tokens, "end": [-0.5 - miss, -0.5, 0.5]}
    return data


class Auditor(ScriptedWorker):
    """A worker holding the echo model's file that answers score jobs as scripted."""

    def __init__(self, ws_url: str, *, honest: bool = True, malformed: bool = False,
                 audit_only: bool = False, **kwargs: Any) -> None:
        extra = [SCORE, AUDITOR] if audit_only else [SCORE]
        super().__init__(ws_url, continues=True, capabilities=extra, **kwargs)
        self.honest = honest
        self.malformed = malformed
        self.scored: list[Job] = []

    async def _run(self, job: Job) -> None:
        if job.openai_url != SCORE_URL:
            await super()._run(job)
            return
        self.scored.append(job)
        await self._send(score_result(job, self.honest, malformed=self.malformed))


def score_result(job: Job, honest: bool, *, malformed: bool = False) -> Result:
    """A scripted auditor's result for score job ``job``."""
    answer = job.openai_req["answer"]
    temperature = job.openai_req["request"].get("temperature", 1.0)
    data = scores(len(answer.split()), temperature, honest)
    if malformed:
        data["logprobs"] = data["logprobs"][:-1]  # one short: not a score of this answer
    return Result(id=job.id, data=data, usage=Usage(prompt_tokens=20, total_tokens=20))


async def trusted_auditor(queen, **kwargs: Any) -> Auditor:
    """An audit-only auditor the operator trusts (as APIARY_TRUSTED_AUDITORS names it)."""
    auditor = Auditor(queen.ws_url, audit_only=True, **kwargs)
    queen.state.audits.trusted = frozenset({auditor.pubkey})
    return await auditor.start()


async def audited(queen, client, temperature: float = 0.0, **kwargs: Any) -> None:
    """One request, and every audit it caused finished."""
    await ask(queen, client, temperature, **kwargs)
    await queen.wait_until(lambda: queen.state.audits.idle, 5, "audited")


async def until_flagged(queen, client, key: str, temperature: float = 0.0,
                        **kwargs: Any) -> None:
    while standing(queen, key).state != "flagged":
        await audited(queen, client, temperature, **kwargs)


def settings(**overrides: Any) -> dict[str, Any]:
    # The echo model is on no hub here: the operator pins it, or it could not be audited.
    return {"audit_new_rate": 1.0, "audit_base_rate": 1.0,
            "local_model_pins": {ECHO_MODEL: [ECHO_SHA256]}, **overrides}


async def ask(queen, client, temperature: float = 0.0, **kwargs: Any):
    return await client.chat.completions.create(model=ECHO_MODEL, messages=MESSAGES,
                                                temperature=temperature, **kwargs)


def standing(queen, key: str) -> Standing:
    return queen.state.audits.standing(key)


async def test_an_auditor_the_operator_did_not_name_gets_no_work(tmp_path):
    async with running_queen(tmp_path, **settings(trusted_auditors="")) as queen:
        worker = await ScriptedWorker(queen.ws_url, continues=True).start()
        auditor = await Auditor(queen.ws_url, audit_only=True).start()
        # Not trusted: an audit-only worker the operator did not name gets no work at all.
        client = queen.client()
        await ask(queen, client)
        assert auditor.scored == []
        assert auditor.jobs == []
        await worker.stop()
        await auditor.stop()


async def test_a_trusted_auditor_audits_and_honest_work_reaches_good_standing(tmp_path):
    async with running_queen(tmp_path, **settings()) as queen:
        auditor = await trusted_auditor(queen)
        worker = await ScriptedWorker(queen.ws_url, continues=True).start()
        client = queen.client()
        for temperature in (0.0, 0.7, 1.0) * 4:
            await audited(queen, client, temperature)
        record = standing(queen, worker.pubkey)
        assert record.state == "good"
        assert record.audited == 12
        assert record.failed == 0
        assert all(job.openai_req["model"] == ECHO_MODEL for job in auditor.scored)
        first = auditor.scored[0].openai_req
        assert first["kind"] == "chat"
        assert first["request"]["messages"] == MESSAGES
        assert "one two" in first["answer"]  # the text the client was delivered
        assert queen.state.registry.get(worker.pubkey).trust < 1.0  # weighs more in routing
        assert len([job for job in auditor.jobs if job.openai_url != SCORE_URL]) == 0
        rows = await queen.state.audits.store.recent(20)
        assert len(rows) == 12
        assert all(row.auditor_trusted and not row.failed for row in rows)
        # Both prompt counts are on the evidence: the billed claim and the auditor's count.
        assert {(row.claimed_prompt_tokens, row.prompt_tokens) for row in rows} == {
            (PROMPT_TOKENS, PROMPT_TOKENS)}
        metrics = (await (await _http(queen)).get("/metrics")).text
        assert 'apiary_audits_total{outcome="passed"} 12.0' in metrics
        assert "apiary_audit_tokens_total 240.0" in metrics
        await worker.stop()
        await auditor.stop()


async def _http(queen):
    import httpx

    return httpx.AsyncClient(base_url=queen.base_url, trust_env=False)


async def test_a_cheat_is_flagged_out_of_routing_refunded_and_forfeits_its_escrow(tmp_path):
    async with running_queen(tmp_path, auth="keys", escrow_jobs=20, **settings()) as queen:
        auditor = await trusted_auditor(queen, honest=False)
        cheat = await ScriptedWorker(queen.ws_url, continues=True).start()
        billing = queen.state.billing
        secret, record = await billing.keys.create("dev")
        await billing.ledger.post(ledger.deposit(record.id, 100_000, "deposit:test"))
        await billing.refresh()
        client = queen.client(api_key=secret)
        await until_flagged(queen, client, cheat.pubkey, 0.7, max_tokens=50)
        flagged = standing(queen, cheat.pubkey)
        assert flagged.audited == 2  # no single job flags; two certain misses do
        assert queen.state.registry.get(cheat.pubkey).flagged
        # Out of routing: the cheat held the only routable copy of the model.
        with pytest.raises(Exception, match="not served"):
            await ask(queen, client)
        money = await billing.ledger.balances()
        rows = await queen.state.audits.store.recent(10)
        assert all(row.failed and row.refunded for row in rows)
        refunded = sum(row.charged_msat for row in rows)
        assert refunded > 0
        # The developer got the audited answers back; the first (proof-of-work) job was
        # charged and not refunded only if it was not audited: here both jobs were audited.
        assert money[ledger.key_available(record.id)] == 100_000
        assert money.get(ledger.worker_pending(cheat.pubkey), 0) == 0
        assert (await billing.ledger.check()).clean
        # Refunds are idempotent.
        for row in rows:
            assert await billing.refund(row.request_id) == 0
        # Still flagged after reconnecting.
        await cheat.stop()
        again = await ScriptedWorker(queen.ws_url, continues=True, key=cheat.key).start()
        await queen.wait_until(lambda: queen.state.registry.get(cheat.pubkey) is not None)
        assert queen.state.registry.holders(ECHO_MODEL) == set()
        # The earnings answer tells the worker in plain terms.
        view = queen.state.audits.view(cheat.pubkey)
        assert view.state == "flagged"
        assert view.payouts_held
        assert view.flagged_reason
        # An admin clears it: routed again.
        assert await queen.state.audits.clear(cheat.pubkey)
        assert not queen.state.registry.get(cheat.pubkey).flagged
        assert standing(queen, cheat.pubkey).state == "unknown"
        assert not await queen.state.audits.clear(cheat.pubkey)  # nothing left to clear
        await again.stop()
        await auditor.stop()


async def test_usage_inflation_is_caught_by_the_count(tmp_path):
    async with running_queen(tmp_path, **settings()) as queen:
        auditor = await trusted_auditor(queen)
        words = len(WORDS.split())
        liar = await ScriptedWorker(queen.ws_url, continues=True, claims=Usage(
            prompt_tokens=7, completion_tokens=3 * words, total_tokens=7 + 3 * words)).start()
        client = queen.client()
        await until_flagged(queen, client, liar.pubkey)
        assert "counted" in standing(queen, liar.pubkey).reasons[-1]
        await liar.stop()
        await auditor.stop()


async def test_a_prompt_inflater_is_flagged_and_the_client_refunded(tmp_path):
    """A worker that always claims the queen's byte bound of prompt tokens (what the queen
    bills at most) with an honest answer: flagged on the auditor's count, its jobs refunded."""
    async with running_queen(tmp_path, auth="keys", **settings()) as queen:
        auditor = await trusted_auditor(queen)
        words = len(WORDS.split())
        bound = queen.state.settings.template_allowance_tokens + len(WORDS) + len("user") + 8
        inflater = await ScriptedWorker(queen.ws_url, continues=True, claims=Usage(
            prompt_tokens=bound, completion_tokens=words, total_tokens=bound + words)).start()
        billing = queen.state.billing
        secret, record = await billing.keys.create("dev")
        await billing.ledger.post(ledger.deposit(record.id, 100_000, "deposit:test"))
        await billing.refresh()
        client = queen.client(api_key=secret)
        answer = await ask(queen, client)
        assert answer.usage.prompt_tokens == bound  # the whole claim was billed: at the bound
        await queen.wait_until(lambda: queen.state.audits.idle, 5, "audited")
        await until_flagged(queen, client, inflater.pubkey)
        flagged = standing(queen, inflater.pubkey)
        assert flagged.failed == flagged.audited == 2
        assert flagged.reasons[-1] == (f"claimed {bound} prompt tokens; the auditor counted "
                                       f"{PROMPT_TOKENS}")
        rows = await queen.state.audits.store.recent(10)
        assert {(row.claimed_prompt_tokens, row.prompt_tokens) for row in rows} == {
            (bound, PROMPT_TOKENS)}
        assert all(row.failed and row.refunded and row.charged_msat > 0 for row in rows)
        money = await billing.ledger.balances()
        assert money[ledger.key_available(record.id)] == 100_000  # every audited job refunded
        assert (await billing.ledger.check()).clean
        await inflater.stop()
        await auditor.stop()


async def test_a_lying_auditor_needs_a_second_opinion(tmp_path):
    async with running_queen(tmp_path, **settings(audit_max_wait_s=30)) as queen:
        worker = await ScriptedWorker(queen.ws_url, continues=True, max_jobs=4).start()
        liar = await Auditor(queen.ws_url, honest=False).start()
        client = queen.client()
        # The lying auditor is the only one: ask until it has judged one of the worker's
        # answers (answers it served itself wait for an auditor).
        for _ in range(20):
            await ask(queen, client)
            if liar.scored:
                break
        await queen.wait_until(lambda: liar.scored, 5, "the liar audited")
        # Its failed verdict waits for a second opinion, which the honest auditor gives.
        honest = await Auditor(queen.ws_url, honest=True).start()
        await queen.wait_until(lambda: queen.state.audits.idle, 10, "audited")
        metrics = (await (await _http(queen)).get("/metrics")).text
        assert 'outcome="disagreed"' in metrics
        assert honest.scored
        # Nobody is flagged, no job failed.
        for key in (worker.pubkey, liar.pubkey, honest.pubkey):
            assert standing(queen, key).state != "flagged"
        rows = await queen.state.audits.store.recent(50)
        assert rows
        assert not any(row.failed for row in rows)
        for member in (worker, liar, honest):
            await member.stop()


async def test_a_malformed_score_counts_for_nothing(tmp_path):
    async with running_queen(tmp_path, **settings()) as queen:
        auditor = await trusted_auditor(queen, malformed=True)
        worker = await ScriptedWorker(queen.ws_url, continues=True).start()
        await ask(queen, queen.client())
        await queen.wait_until(lambda: queen.state.audits.idle, 5, "audit ended")
        assert standing(queen, worker.pubkey).audited == 0
        assert await queen.state.audits.store.recent(5) == []
        await worker.stop()
        await auditor.stop()


async def test_audits_are_off_when_the_operator_says_so(tmp_path):
    async with running_queen(tmp_path, audits=False) as queen:
        auditor = await trusted_auditor(queen)
        worker = await ScriptedWorker(queen.ws_url, continues=True).start()
        await ask(queen, queen.client())
        assert auditor.scored == []
        assert not queen.state.audits.enabled
        await worker.stop()
        await auditor.stop()


async def test_the_admin_sees_the_evidence_and_clears_the_flag_over_http(tmp_path):
    async with running_queen(tmp_path, admin_token="secret-admin", **settings()) as queen:
        auditor = await trusted_auditor(queen, honest=False)
        cheat = await ScriptedWorker(queen.ws_url, continues=True).start()
        client = queen.client()
        await until_flagged(queen, client, cheat.pubkey)
        http = await _http(queen)
        admin = {"Authorization": "Bearer secret-admin"}
        assert (await http.get("/admin/api/audits")).status_code == 401
        report = (await http.get("/admin/api/audits", headers=admin)).json()
        assert report["sampled_share"] == 1.0
        assert report["audit_token_share"] > 0
        flagged = report["standings"][0]
        assert flagged["state"] == "flagged"
        assert flagged["worker"] == queen.state.registry.get(cheat.pubkey).public_id
        assert len(flagged["evidence"]) == 2
        assert all(row["auditor"] and row["failed"] and row["reason"]
                   for row in flagged["evidence"])
        assert cheat.pubkey not in str(report)  # keys are never shown, only public ids
        cleared = await http.post(f"/admin/api/audits/{flagged['worker']}/clear", headers=admin)
        assert cleared.json() == {"worker": flagged["worker"], "state": "unknown"}
        again = await http.post(f"/admin/api/audits/{flagged['worker']}/clear", headers=admin)
        assert again.status_code == 404
        assert again.json()["error"]["code"] == "worker_not_flagged"
        await http.aclose()
        await cheat.stop()
        await auditor.stop()


async def test_a_trusted_auditor_may_be_named_by_its_public_id(tmp_path):
    async with running_queen(tmp_path, **settings()) as queen:
        auditor = Auditor(queen.ws_url, audit_only=True)
        queen.state.audits.trusted = frozenset({public_id(auditor.pubkey)})
        await auditor.start()
        worker = await ScriptedWorker(queen.ws_url, continues=True).start()
        await audited(queen, queen.client())
        assert len(auditor.scored) == 1
        rows = await queen.state.audits.store.recent(5)
        assert rows[0].auditor_trusted
        await worker.stop()
        await auditor.stop()


async def test_each_choice_of_n_is_scored_and_a_claim_over_them_all_is_counted(tmp_path):
    """n > 1 (issue 39): the auditor scores every choice on its own (one score job each, the
    request with n 1); an honest worker's one claim for them all passes, an inflated one is
    caught on the auditor's counts summed."""
    async with running_queen(tmp_path, **settings()) as queen:
        auditor = await trusted_auditor(queen)
        words = len(WORDS.split()) + 1  # the echo's "echo:" and its words
        honest = await ScriptedWorker(queen.ws_url, continues=True,
                                      capabilities=["chat", "stream", CHOICES]).start()
        client = queen.client()
        await audited(queen, client, n=3)
        assert len(auditor.scored) == 3
        assert all("n" not in job.openai_req["request"] for job in auditor.scored)
        assert standing(queen, honest.pubkey).failed == 0
        assert standing(queen, honest.pubkey).audited == 1
        await honest.stop()
        liar = await ScriptedWorker(queen.ws_url, continues=True, claims=Usage(
            prompt_tokens=7, completion_tokens=3 * 3 * words, total_tokens=7 + 9 * words),
            capabilities=["chat", "stream", CHOICES]).start()
        await until_flagged(queen, client, liar.pubkey, n=3)
        assert "counted" in standing(queen, liar.pubkey).reasons[-1]
        await liar.stop()
        await auditor.stop()


async def test_each_workers_part_of_a_failover_is_audited_given_the_text_before_it(tmp_path):
    """A worker lost mid-answer is credited its part and audited on it; the twin that finished
    is audited on its own span, scored after the first one's text (issue 39)."""
    import asyncio

    async with running_queen(tmp_path, **settings()) as queen:
        auditor = await trusted_auditor(queen)
        first = await ScriptedWorker(queen.ws_url, behaviour="die_mid", continues=True).start()
        client = queen.client()
        request = asyncio.create_task(client.chat.completions.create(
            model=ECHO_MODEL, messages=MESSAGES, temperature=0, stream=True))
        async with asyncio.timeout(5):
            await first.job_arrived.wait()
        twin = await ScriptedWorker(queen.ws_url, continues=True).start()
        await queen.wait_until(lambda: len(queen.state.registry) == 3, what="twin connected")
        first.release.set()
        async with asyncio.timeout(15):
            stream = await request
            text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream
                            if chunk.choices])
        await queen.wait_until(lambda: queen.state.audits.idle and len(auditor.scored) == 2,
                               10, "both parts audited")
        parts = {job.openai_req.get("prefix", ""): job.openai_req["answer"]
                 for job in auditor.scored}
        assert "" in parts  # the first worker's part, from the start
        [prefix] = [key for key in parts if key]
        assert prefix + parts[prefix] == text  # the twin's span, after the first one's text
        assert parts[""] == prefix
        assert standing(queen, first.pubkey).audited == 1
        assert standing(queen, twin.pubkey).audited == 1
        await twin.stop()
        await auditor.stop()
