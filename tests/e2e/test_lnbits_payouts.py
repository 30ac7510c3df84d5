"""Payouts through a real LNbits (issue 40): the queen's wallet and the worker's are wallets of
one LNbits with its FakeWallet, the worker's Lightning address hands out its wallet's own
invoices, and LNbits itself says what it received. A queen killed between LNbits paying and the
queen recording it is reconciled against LNbits by the next queen, and nothing is paid twice.

LNbits runs from its own virtualenv (``tests/support/lnbits_server.py``); without it these tests
skip, naming the command that installs it."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import httpx
import pytest
from sqlalchemy import insert, select

from queen_server.billing import ledger
from queen_server.billing.store import LedgerStore
from queen_server.payouts.lightning import LnbitsBackend
from queen_server.payouts.runner import PayoutRunner
from queen_server.settings import QueenSettings
from queen_server.storage.engine import Database
from queen_server.storage.tables import Payout, WorkerRecord
from tests.support.http_server import ServedFake, TrackedHTTPServer
from tests.support.lnbits_server import (
    INSTALL_COMMAND,
    LnbitsAddress,
    LnbitsServer,
    Wallet,
    installed,
)
from tests.support.processes import free_port, queen_cli, queen_process

pytestmark = pytest.mark.timeout(240)

WORKER = "cd" * 32
EARNED = 5_000_000  # msat: 5,000 sats, over the 1,000-sat threshold
FUNDS_SATS = 100_000


@pytest.fixture(scope="module")
def lnbits(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LnbitsServer]:
    if not installed():
        pytest.skip(f"LNbits is not installed here: `{INSTALL_COMMAND}` installs it")
    with LnbitsServer(tmp_path_factory.mktemp("lnbits")) as server:
        yield server


@pytest.fixture
def wallets(lnbits: LnbitsServer) -> tuple[Wallet, Wallet]:
    """A funded queen wallet and an empty worker wallet, fresh for each test."""
    queen, worker = lnbits.wallet("queen"), lnbits.wallet("worker")
    lnbits.credit(queen, FUNDS_SATS)
    return queen, worker


async def seed(db_url: str, ln_url: str) -> Database:
    """The queen's database with one worker who earned 5,000 sats and gave ``ln_url``."""
    database = Database(db_url)
    await database.upgrade()
    now = datetime.now(UTC)
    async with database.engine.begin() as conn:
        await conn.execute(insert(WorkerRecord).values(
            key=WORKER, public_id="w1", ln_url=ln_url, worker_version="t", first_seen=now,
            last_seen=now))
    await LedgerStore(database.engine).post(ledger.Posting("earned:1", "charge", (
        (ledger.DEPOSITS, -EARNED), (ledger.worker_available(WORKER), EARNED))))
    return database


async def payouts(database: Database) -> list:
    async with database.engine.connect() as conn:
        return (await conn.execute(select(Payout).order_by(Payout.id))).all()


def received(lnbits: LnbitsServer, wallet: Wallet) -> list[dict]:
    """The payments LNbits says ``wallet`` received."""
    return [p for p in lnbits.payments(wallet) if p["amount"] > 0 and p["status"] == "success"]


async def test_earnings_reach_the_workers_lnbits_wallet_and_the_books_agree(
        tmp_path: Path, lnbits: LnbitsServer, wallets: tuple[Wallet, Wallet]) -> None:
    queen, worker = wallets
    with LnbitsAddress(lnbits, {"alice": worker}) as address:
        database = await seed(f"sqlite+aiosqlite:///{tmp_path / 'queen.sqlite3'}",
                              address.address("alice"))
        store = LedgerStore(database.engine)
        settings = QueenSettings(lnurl_insecure_hosts="127.0.0.1", payout_threshold_sats=1000)
        async with httpx.AsyncClient(timeout=30, trust_env=False) as http:
            runner = PayoutRunner(settings, database.engine, store,
                                  LnbitsBackend(lnbits.url, queen.admin_key, http), http)
            report = await runner.run_once()
            again = await runner.run_once()
        [payout] = await payouts(database)
        balances = await store.balances()
        report_check = await store.check()
        await database.close()
    assert (report.paid, again.paid) == (1, 0)
    assert (payout.state, payout.amount_msat) == ("paid", EARNED)
    # What LNbits says: the worker's wallet received exactly the payout, by its hash.
    [incoming] = received(lnbits, worker)
    assert (incoming["payment_hash"], incoming["amount"]) == (payout.payment_hash, EARNED)
    assert lnbits.balance_msat(worker) == EARNED
    assert lnbits.balance_msat(queen) == FUNDS_SATS * 1000 - EARNED
    # What the queen's books say agrees.
    assert balances.get(ledger.worker_available(WORKER), 0) == 0
    assert balances.get(ledger.worker_paid(WORKER), 0) == EARNED
    assert balances.get(ledger.PAYOUTS_IN_FLIGHT, 0) == 0
    assert report_check.clean, report_check


class KillSwitch(ServedFake):
    """A pass-through proxy in front of LNbits that, armed, lets the first outgoing payment
    reach LNbits, then calls ``on_paid`` (kill the queen) and hangs up without an answer:
    the queen dies between "sent" and "recorded"."""

    name = "lnbits-kill-switch"

    def __init__(self, target: str) -> None:
        super().__init__()
        self.target = target
        self.on_paid: Callable[[], None] | None = None
        self.paid = threading.Event()

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def _make_server(self) -> TrackedHTTPServer:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_args: object) -> None:
                pass

            def _relay(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in {"host", "content-length", "connection"}}
                answer = httpx.request(self.command, proxy.target + self.path, headers=headers,
                                       content=body, timeout=30, trust_env=False)
                paying = (self.command == "POST" and self.path.startswith("/api/v1/payments")
                          and json.loads(body or b"{}").get("out") is True)
                if paying and proxy.on_paid is not None and answer.status_code < 300:
                    on_paid, proxy.on_paid = proxy.on_paid, None
                    on_paid()
                    proxy.paid.set()
                    self.close_connection = True
                    return  # no answer: the queen that asked is dead
                self.send_response(answer.status_code)
                for key, value in answer.headers.items():
                    if key.lower() not in {"content-length", "transfer-encoding", "connection",
                                           "content-encoding"}:
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(answer.content)))
                self.end_headers()
                self.wfile.write(answer.content)

            do_GET = do_POST = _relay

        return TrackedHTTPServer(Handler, self.name)


async def wait_for(check: Callable[[], object], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


async def test_a_queen_killed_between_paying_and_recording_is_reconciled_never_paid_twice(
        tmp_path: Path, lnbits: LnbitsServer, wallets: tuple[Wallet, Wallet]) -> None:
    queen_wallet, worker = wallets
    db_url = f"sqlite+aiosqlite:///{tmp_path / 'queen.sqlite3'}"  # queen_process's database
    with LnbitsAddress(lnbits, {"alice": worker}) as address, \
            KillSwitch(lnbits.url) as switch:
        database = await seed(db_url, address.address("alice"))
        settings = {"lightning_backend": "lnbits", "lnbits_url": switch.url,
                    "lnbits_admin_key": queen_wallet.admin_key,
                    "lnurl_insecure_hosts": "127.0.0.1", "payout_threshold_sats": "1000",
                    "payout_interval_s": "0.5"}
        first = queen_process(tmp_path, free_port(), **settings)
        switch.on_paid = lambda: first.stop(kill=True)  # SIGKILL, the moment LNbits has paid
        first.start()
        try:
            await wait_for(switch.paid.is_set, 90, "the first queen to pay and be killed")
        finally:
            first.stop(kill=True)
        # LNbits paid; the queen never heard: its record still says "invoiced".
        assert [p["amount"] for p in received(lnbits, worker)] == [EARNED]
        [payout] = await payouts(database)
        assert payout.state == "invoiced"
        # The next queen reconciles it against LNbits, through the same (now harmless) proxy.
        second = queen_process(tmp_path, free_port(), **settings).start()
        try:
            async def paid() -> bool:
                return [p.state for p in await payouts(database)] == ["paid"]

            await wait_for(paid, 60, "the next queen to record the payout as paid")
        finally:
            second.stop()
        [payout] = await payouts(database)
        await database.close()
    [incoming] = received(lnbits, worker)
    assert (incoming["payment_hash"], incoming["amount"]) == (payout.payment_hash, EARNED)
    assert lnbits.balance_msat(worker) == EARNED
    assert lnbits.balance_msat(queen_wallet) == FUNDS_SATS * 1000 - EARNED
    check = queen_cli(tmp_path, "ledger", "check")
    assert check.returncode == 0, check.stdout + check.stderr
