"""Independent auditors under a real queen (issue 39): a Sybil pair of untrusted auditors
cannot flag an honest worker, two independent ones still flag a cheat, and an auditor
outvoted again and again audits no one and is shown so on the admin Audits page.

Each worker dials the queen from its own loopback address (``127.0.N.x``: a /24 of its own
unless a test puts two in one), and its first connection is recorded hours before the test
(``workers.first_seen``, as a worker that joined the swarm earlier has it). The auditors hold
the model without it loaded, so the audited worker (loaded) serves every request."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest

from queen_server.audits.decision import SprtParams, Standing
from queen_server.audits.independence import OUTVOTED_LIMIT
from queen_server.audits.store import Record
from queen_server.identity import public_id
from queen_server.storage.tables import WorkerRecord
from shared_schema import Usage
from tests.queen_server.audits.test_service import (
    WORDS,
    Auditor,
    ask,
    settings,
    standing,
    until_flagged,
)
from tests.support.queen import QueenHarness
from tests.support.queen import running_queen as queen_at
from tests.support.workers import ScriptedWorker

ADMIN = "admin-token-for-auditor-tests"
GOOD = Standing(SprtParams().lower, 30, 0, "good")  # an established worker's record


async def audited_worker(queen: QueenHarness, **kwargs: Any) -> ScriptedWorker:
    """The worker whose answers are audited: from 127.0.1.1, first seen 10 hours ago."""
    worker = ScriptedWorker(queen.ws_url, continues=True, source_host="127.0.1.1", **kwargs)
    return await (await seen(queen, worker, 10)).start()


async def seen(queen: QueenHarness, worker: ScriptedWorker, hours_ago: float) -> ScriptedWorker:
    """Record that ``worker`` first connected ``hours_ago`` (before it dials in now)."""
    store = queen.state.audits.store
    assert store is not None
    then = datetime.now(UTC) - timedelta(hours=hours_ago)
    async with store.engine.begin() as conn:
        await conn.execute(WorkerRecord.__table__.insert().values(
            key=worker.pubkey, public_id=public_id(worker.pubkey), ln_url=worker.ln_url,
            worker_version="", first_seen=then, last_seen=then))
    return worker


def auditor(queen: QueenHarness, host: str, **kwargs: Any) -> Auditor:
    """An untrusted auditor holding the model's file (not loaded) that dials from ``host``."""
    return Auditor(queen.ws_url, loaded=False, source_host=host, **kwargs)


async def metric(queen: QueenHarness, outcome: str) -> float:
    async with httpx.AsyncClient(base_url=queen.base_url, trust_env=False) as http:
        text = (await http.get("/metrics")).text
    found = re.search(rf'apiary_audits_total{{outcome="{outcome}"}} ([0-9.]+)', text)
    return float(found.group(1)) if found else 0.0


# The pair's two auditors, by what ties them: (source hosts, payout addresses, hours ago).
SYBIL_PAIRS = {
    "same /24": (("127.0.2.1", "127.0.2.2"), (None, None), (20, 30)),
    "same owner": (("127.0.2.1", "127.0.3.1"), ("sybil@getalby.com", "sybil@getalby.com"),
                   (20, 30)),
    "new in the same hour": (("127.0.2.1", "127.0.3.1"), (None, None), (20, 20.5)),
}


@pytest.mark.parametrize("tie", list(SYBIL_PAIRS))
async def test_a_sybil_pair_cannot_flag_an_honest_worker(tmp_path, tie):
    hosts, payouts, ages = SYBIL_PAIRS[tie]
    async with queen_at(tmp_path, **settings(audit_max_wait_s=1.5)) as queen:
        honest = await audited_worker(queen, max_jobs=4)
        sybils = [await (await seen(queen, auditor(queen, host, honest=False, ln_url=payout),
                                    age)).start()
                  for host, payout, age in zip(hosts, payouts, ages, strict=True)]
        client = queen.client()
        for _ in range(4):
            await ask(queen, client)
        await queen.wait_until(lambda: queen.state.audits.idle, 15, "the cases expired")
        # Both Sybils failed the honest worker's answers, and the second never confirmed the
        # first: the cases waited for an independent auditor, and none came.
        assert all(sybil.scored for sybil in sybils)
        assert await metric(queen, "not_independent") >= 4
        assert await metric(queen, "unconfirmed") == 4
        record = standing(queen, honest.pubkey)
        assert (record.state, record.audited, record.failed) == ("unknown", 0, 0)
        assert not queen.state.registry.get(honest.pubkey).flagged
        assert await queen.state.audits.store.recent(10) == []  # no verdict, no evidence
        for member in (honest, *sybils):
            await member.stop()


async def test_an_honest_auditor_is_asked_before_the_first_sybils_twin(tmp_path):
    """With an honest holder connected, the second opinion goes to it, not to the Sybil's
    twin: the honest worker is never failed, and the Sybil is outvoted each time."""
    async with queen_at(tmp_path, **settings(audit_max_wait_s=10)) as queen:
        honest = await audited_worker(queen, max_jobs=4)
        client = queen.client()
        first = await (await seen(queen, auditor(queen, "127.0.2.1", honest=False), 20)).start()
        await ask(queen, client)  # the only auditor: it fails the answer, which waits
        await queen.wait_until(lambda: first.scored, 5, "the first Sybil audited")
        twin = await seen(queen, auditor(queen, "127.0.2.2", honest=False), 30)
        # The twin has the better record (good standing, long): it would be asked first but
        # for independence.
        await queen.state.audits.store.save(twin.pubkey, Record(GOOD))
        await twin.start()
        fair = await (await seen(queen, auditor(queen, "127.0.3.1"), 40)).start()
        await queen.wait_until(lambda: queen.state.audits.idle, 10, "audited")
        assert fair.scored
        assert not twin.scored
        assert standing(queen, honest.pubkey).failed == 0
        store = queen.state.audits.store
        assert (await store.record(first.pubkey)).outvoted == 1
        for member in (honest, first, twin, fair):
            await member.stop()


async def test_a_cheats_own_twin_cannot_outvote_the_auditor_that_caught_it(tmp_path):
    """A cheat's twin on its /24 passes what the cheat served: the job counts for nothing,
    but the auditor that failed it keeps its record (the twin's word does not weigh)."""
    async with queen_at(tmp_path, **settings(audit_max_wait_s=10)) as queen:
        cheat = await audited_worker(queen)
        catcher = await (await seen(queen, auditor(queen, "127.0.4.1", honest=False),
                                    20)).start()  # its scores say: not this model's answer
        await ask(queen, queen.client())
        await queen.wait_until(lambda: catcher.scored, 5, "the cheat's answer audited")
        twin = await (await seen(queen, auditor(queen, "127.0.1.2"), 30)).start()
        await queen.wait_until(lambda: queen.state.audits.idle, 10, "second opinion")
        assert twin.scored
        assert await metric(queen, "disagreed") == 1
        assert (await queen.state.audits.store.record(catcher.pubkey)).outvoted == 0
        assert queen.state.audits.auditor_eligible(catcher.pubkey)
        for member in (cheat, catcher, twin):
            await member.stop()


async def test_an_independent_looking_sybil_pair_never_flags_an_honest_worker(tmp_path):
    """Two keys of one party that pass every independence test (their own /24s, payout
    addresses, first seen hours apart) fail every audit of an honest worker: their verdicts
    count, the worker's test reaches its flag line and is held there, and no flag comes from
    two accusers (``decision.MIN_ACCUSERS``)."""
    async with queen_at(tmp_path, **settings(audit_max_wait_s=10)) as queen:
        honest = await audited_worker(queen, max_jobs=4)
        sybils = [await (await seen(queen, auditor(queen, host, honest=False,
                                                   ln_url=f"sybil{n}@getalby.com"), age)).start()
                  for n, (host, age) in enumerate((("127.0.6.1", 20), ("127.0.7.1", 30)))]
        client = queen.client()
        params = SprtParams()
        while standing(queen, honest.pubkey).llr < params.upper:
            await ask(queen, client)
            await queen.wait_until(lambda: queen.state.audits.idle, 15, "audited")
        for _ in range(3):  # and more, held at the line
            await ask(queen, client)
            await queen.wait_until(lambda: queen.state.audits.idle, 15, "audited")
        record = standing(queen, honest.pubkey)
        assert record.failed >= 4
        assert record.state == "unknown"
        assert record.llr == params.upper
        assert not queen.state.registry.get(honest.pubkey).flagged
        for member in (honest, *sybils):
            await member.stop()


async def test_a_third_auditor_outvotes_an_independent_looking_sybil_pair(tmp_path):
    """The pair has the best records, so it is asked first and second, and agrees; an honest
    auditor is connected, so it gives the third opinion, passes the answer, and outvotes both:
    the job counts for nothing, and after ``OUTVOTED_LIMIT`` such jobs the pair audits no one."""
    async with queen_at(tmp_path, **settings(audit_max_wait_s=10)) as queen:
        service, store = queen.state.audits, queen.state.audits.store
        assert store is not None
        honest = await audited_worker(queen, max_jobs=4)
        sybils = []
        for n, (host, age) in enumerate((("127.0.6.1", 20), ("127.0.7.1", 30))):
            sybil = await seen(queen, auditor(queen, host, honest=False,
                                              ln_url=f"sybil{n}@getalby.com"), age)
            await store.save(sybil.pubkey, Record(GOOD))
            sybils.append(await sybil.start())
        fair = await (await seen(queen, auditor(queen, "127.0.8.1"), 40)).start()
        client = queen.client()
        for _ in range(OUTVOTED_LIMIT + 2):
            await ask(queen, client)
            await queen.wait_until(lambda: service.idle, 15, "audited")
        assert all(not service.auditor_eligible(sybil.pubkey) for sybil in sybils)
        assert all(len(sybil.scored) == OUTVOTED_LIMIT for sybil in sybils)
        assert len(fair.scored) == OUTVOTED_LIMIT + 2  # each third opinion, then alone
        assert await metric(queen, "disagreed") == OUTVOTED_LIMIT
        record = standing(queen, honest.pubkey)
        assert record.failed == 0
        assert record.state != "flagged"
        for member in (honest, *sybils, fair):
            await member.stop()


async def test_three_independent_auditors_still_flag_a_real_cheat(tmp_path):
    async with queen_at(tmp_path, **settings(audit_max_wait_s=10)) as queen:
        words = len(WORDS.split())
        cheat = await audited_worker(queen, claims=Usage(
            prompt_tokens=7, completion_tokens=3 * words, total_tokens=7 + 3 * words))
        auditors = [await (await seen(queen, auditor(queen, host), age)).start()
                    for host, age in (("127.0.4.1", 20), ("127.0.5.1", 30), ("127.0.8.1", 40))]
        await until_flagged(queen, queen.client(), cheat.pubkey)
        assert "counted" in standing(queen, cheat.pubkey).reasons[-1]
        assert all(member.scored for member in auditors)  # a third accuser was needed
        rows = await queen.state.audits.store.recent(10)
        assert rows
        assert all(row.failed and not row.auditor_trusted for row in rows)
        assert await metric(queen, "not_independent") == 0
        for member in (cheat, *auditors):
            await member.stop()


async def test_an_auditor_outvoted_past_the_limit_is_no_longer_chosen(tmp_path):
    async with queen_at(tmp_path, admin_token=ADMIN,
                        **settings(audit_base_rate=0.03, audit_max_wait_s=30)) as queen:
        service, store = queen.state.audits, queen.state.audits.store
        assert store is not None
        honest = await audited_worker(queen, max_jobs=4)
        liar = await seen(queen, auditor(queen, "127.0.2.1", honest=False), 20)
        # An established worker in good standing: chosen before a newcomer, rarely audited.
        await store.save(liar.pubkey, Record(GOOD))
        await liar.start()
        fair = await seen(queen, auditor(queen, "127.0.3.1"), 30)
        assert service.rate(liar.pubkey) == pytest.approx(0.03)
        client = queen.client()
        for outvoted in range(1, OUTVOTED_LIMIT + 1):
            await ask(queen, client)  # the liar alone audits: its failing verdict waits
            await queen.wait_until(lambda n=outvoted: len(liar.scored) == n, 5, "liar audited")
            fair = await auditor(queen, "127.0.3.1", key=fair.key).start()
            await queen.wait_until(lambda: service.idle, 10, "second opinion")
            await fair.stop()
            await queen.wait_until(lambda key=fair.pubkey: queen.state.registry.get(key) is None,
                                   5, "the fair auditor left")
            assert (await store.record(liar.pubkey)).outvoted == outvoted
        assert not service.auditor_eligible(liar.pubkey)
        assert service.rate(liar.pubkey) == 1.0  # audited as a newcomer again
        # Both connected: the liar, in good standing, would rank first; it is skipped.
        fair = await auditor(queen, "127.0.3.1", key=fair.key).start()
        await ask(queen, client)
        await queen.wait_until(lambda: service.idle, 10, "audited")
        assert len(liar.scored) == OUTVOTED_LIMIT
        assert fair.scored
        latest = (await store.recent(1))[0]
        assert (latest.auditor_key, latest.failed) == (fair.pubkey, False)
        assert standing(queen, honest.pubkey).failed == 0
        # The admin sees it: over the API, and on the Audits page.
        async with httpx.AsyncClient(base_url=queen.base_url, trust_env=False) as http:
            report = (await http.get("/admin/api/audits",
                                     headers={"Authorization": f"Bearer {ADMIN}"})).json()
            entry = next(s for s in report["standings"] if s["worker"] == public_id(liar.pubkey))
            assert (entry["outvoted"], entry["auditor_eligible"]) == (OUTVOTED_LIMIT, False)
            await http.post("/admin/login", data={"token": ADMIN, "next": "/admin"})
            html = (await http.get("/admin/audits")).text
        row = re.search(rf'<tr data-key="{public_id(liar.pubkey)}".*?</tr>', html, re.S)
        assert row is not None
        assert f'<td class="num">{OUTVOTED_LIMIT}</td>' in row.group(0)
        assert "no: outvoted too often" in row.group(0)
        fair_row = re.search(rf'<tr data-key="{public_id(fair.pubkey)}".*?</tr>', html, re.S)
        assert fair_row is None or "outvoted too often" not in fair_row.group(0)
        for member in (honest, liar, fair):
            await member.stop()
