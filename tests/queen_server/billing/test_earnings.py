"""Workers read their own earnings, signed with their key; bad payout addresses are refused."""

from __future__ import annotations

import time

import httpx
import pytest

from desktop_worker.earnings import earnings_authorization, fetch_earnings, queen_http_url
from desktop_worker.errors import LinkError
from desktop_worker.identity import WorkerIdentity
from queen_server.billing.pricing import PriceTable
from queen_server.lightning import NoneBackend
from queen_server.payouts import PayoutRunner
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
            costs = []
            for _ in range(3):
                answer = await client.chat.completions.create(model=ECHO_MODEL, messages=USER)
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
        stale = await http.get("/worker/earnings", headers={
            "Authorization": earnings_authorization(identity, time.time() - 3600)})
        forged_header = earnings_authorization(other).replace(other.pubkey, identity.pubkey)
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
