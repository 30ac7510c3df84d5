"""Workers read their own earnings, signed with their key; bad payout addresses are refused."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from sqlalchemy import update

from desktop_worker.earnings import earnings_authorization, fetch_earnings, queen_http_url
from desktop_worker.errors import LinkError
from desktop_worker.identity import WorkerIdentity
from queen_server.billing.pricing import PriceTable
from queen_server.payouts.lightning import NoneBackend
from queen_server.payouts.runner import PayoutRunner
from queen_server.storage.tables import LedgerTxn
from shared_schema import queen_origin
from tests.queen_server.billing.test_billing_api import USER, funded_key
from tests.support.processes import free_port
from tests.support.queen import running_queen
from tests.support.workers import ECHO_MODEL, ScriptedWorker

TINY = PriceTable().for_parameters(135_000_000)


def test_queen_http_url():
    assert queen_http_url("ws://127.0.0.1:8000/worker") == "http://127.0.0.1:8000"
    assert queen_http_url("wss://queen.example/worker") == "https://queen.example"


async def test_a_worker_reads_its_own_earnings(tmp_path):
    async with running_queen(tmp_path, auth="keys", escrow_jobs=1) as queen:
        worker = await ScriptedWorker(queen.ws_url).start()
        identity = WorkerIdentity(worker.key)
        try:
            secret, _ = await funded_key(queen, 10)
            client = queen.client(api_key=secret)
            costs, ids = [], []
            for _ in range(3):
                answer = await client.chat.completions.create(model=ECHO_MODEL, messages=USER)
                ids.append(answer.id)
                costs.append(TINY.cost_msat(answer.usage.prompt_tokens,
                                            answer.usage.completion_tokens))
            earnings = await fetch_earnings(queen.ws_url, identity)
            shares = [int(cost * queen.state.settings.worker_share) for cost in costs]
            assert earnings.jobs_settled == 3
            assert earnings.escrow_jobs_left == 0
            assert earnings.available_msat == shares[1] + shares[2]
            assert earnings.pending_msat == 0
            assert earnings.total_msat == earnings.today_msat == shares[1] + shares[2]
            assert earnings.worker_id == worker.welcome.worker_id
            assert earnings.recent_payouts == []
            # The history behind the app's chart and jobs table: 30 days ending today, and
            # what each settled job earned, newest first (the first job was unpaid).
            assert len(earnings.daily) == 30
            assert earnings.daily[-1].day == datetime.now(UTC).date()
            assert earnings.daily[-1].earned_msat == earnings.today_msat
            assert sum(d.earned_msat for d in earnings.daily[:-1]) == 0
            assert earnings.week_msat == earnings.today_msat
            assert [(j.job_id, j.earned_msat) for j in earnings.recent_jobs] == [
                (ids[2], shares[2]), (ids[1], shares[1])]
            # A payout (recorded for an admin: no Lightning backend here) shows up.
            billing = queen.state.billing
            runner = PayoutRunner(queen.state.settings, queen.state.db.engine, billing.ledger,
                                  NoneBackend(), None)
            await runner.pay(worker.pubkey, earnings.available_msat, "x@example.com")
            after = await fetch_earnings(queen.ws_url, identity)
            assert [(p.state, p.amount_msat) for p in after.recent_payouts] == [
                ("manual", earnings.available_msat)]
            assert after.available_msat == 0
        finally:
            await worker.stop()


@pytest.mark.parametrize("header", [None, "Bearer x", "Apiary-Worker abc", "Apiary-Worker a.b.c"])
async def test_unsigned_requests_are_refused(queen, header):
    async with httpx.AsyncClient(base_url=queen.base_url) as http:
        response = await http.get("/worker/earnings",
                                  headers={"Authorization": header} if header else {})
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "missing_worker_signature"


async def test_stale_or_forged_signatures_are_refused(queen):
    identity = WorkerIdentity(ScriptedWorker(queen.ws_url).key)
    other = WorkerIdentity(ScriptedWorker(queen.ws_url).key)
    async with httpx.AsyncClient(base_url=queen.base_url) as http:
        origin = queen_origin(queen.base_url)
        stale = await http.get("/worker/earnings", headers={
            "Authorization": earnings_authorization(identity, origin, time.time() - 3600)})
        forged_header = earnings_authorization(other, origin).replace(other.pubkey,
                                                                      identity.pubkey)
        forged = await http.get("/worker/earnings", headers={"Authorization": forged_header})
    assert stale.json()["error"]["code"] == "stale_worker_signature"
    assert forged.json()["error"]["code"] == "bad_worker_signature"


async def test_an_unreachable_queen_is_a_clear_error():
    identity = WorkerIdentity(ScriptedWorker("ws://unused").key)
    with pytest.raises(LinkError, match="cannot reach the queen"):
        await fetch_earnings(f"ws://127.0.0.1:{free_port()}/worker", identity)


async def test_a_bad_payout_address_is_refused_and_a_good_one_accepted(queen):
    with pytest.raises(RuntimeError, match="invalid_ln_url"):
        await ScriptedWorker(queen.ws_url, ln_url="my wallet please").start()
    good = await ScriptedWorker(queen.ws_url, ln_url="satoshi@walletofsatoshi.com").start()
    await good.stop()
    nobody = await ScriptedWorker(queen.ws_url, ln_url=None).start()  # don't pay me
    await nobody.stop()


async def test_earnings_history_buckets_by_utc_day(tmp_path):
    async with running_queen(tmp_path, auth="keys", escrow_jobs=0) as queen:
        worker = await ScriptedWorker(queen.ws_url).start()
        try:
            secret, _ = await funded_key(queen, 10)
            client = queen.client(api_key=secret)
            ids = [(await client.chat.completions.create(model=ECHO_MODEL, messages=USER)).id
                   for _ in range(3)]
            engine = queen.state.billing.ledger.engine
            moved = {ids[1]: 3, ids[2]: 10}  # settled 3 and 10 days ago
            async with engine.begin() as conn:
                for job_id, days in moved.items():
                    await conn.execute(
                        update(LedgerTxn).where(LedgerTxn.id == f"settle:{job_id}")
                        .values(created_at=datetime.now(UTC) - timedelta(days=days)))
            earnings = await fetch_earnings(queen.ws_url, WorkerIdentity(worker.key))
            by_job = {j.job_id: j.earned_msat for j in earnings.recent_jobs}
            assert ids[0] not in by_job  # a new worker's first job is unpaid
            assert earnings.today_msat == 0
            assert earnings.daily[-4].earned_msat == by_job[ids[1]] > 0
            assert earnings.daily[-11].earned_msat == by_job[ids[2]] > 0
            assert earnings.week_msat == by_job[ids[1]]
            assert earnings.total_msat == by_job[ids[1]] + by_job[ids[2]]
        finally:
            await worker.stop()
