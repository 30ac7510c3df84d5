"""Paying workers over Lightning, without ever paying twice or losing a record.

Each payout goes: record it (a ``payouts`` row and a ledger posting moving the worker's available
earnings to ``payouts:in_flight``, in one transaction), then get an invoice from the worker's
address (LNURL-pay, checked), store it, then pay it. The result settles the ledger: paid moves the
money to ``worker:<key>:paid``; failed returns it to the worker.

A crash can stop this anywhere. ``reconcile`` runs first on every pass: a payout still
``recorded`` never reached the backend (no invoice was stored), so its money is returned; one
``invoiced`` is asked about by its payment hash, and only a definite answer settles it. The
backend's ``pay`` checks the payment hash before paying, so a retry never pays twice.

One worker's payout never stops the others. Whatever its LNURL service answers (or does not),
``fetch_invoice`` ends in a ``LightningError``: that payout is failed with the reason (shown on
the worker's earnings page), its money returned, and the worker waits out a backoff
(``backoff.py``) before the next try. Any other exception there is a bug in the queen: it is
logged with its traceback, and still fails only that payout. Worker-supplied URLs are fetched
through ``guarded_client`` (no private addresses, DNS answers pinned), never through the
queen's own client, which may reach an LNbits on the operator's private network.

Several queen replicas on one PostgreSQL database each run this loop, and exactly one runs a
pass at a time: a pass holds a session-level advisory lock (``pg_try_advisory_lock``) on a
connection of its own for its whole length, and a replica that cannot take it skips its pass
(the holder is paying). A replica that dies mid-pass drops its connection, and with it the lock;
the next pass reconciles what it left. On SQLite (one queen) there is no lock.

A payout's reservation is one guarded step (``_record``): the worker's ``available`` and
``debt`` accounts are locked and read, the debt is repaid out of ``available`` first, and the
payout is recorded only if what is left still covers it; otherwise it is skipped (the next
pass pays what is there). A refund of the worker's job (``billing.clawback``) locks the same
accounts, so one of them always runs second and sees the other's effect.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from datetime import UTC, datetime

import httpx
from sqlalchemy import insert, select, text, update
from sqlalchemy.ext.asyncio import AsyncEngine

from queen_server.billing import ledger
from queen_server.billing.store import LedgerStore
from queen_server.payouts.backoff import INTERRUPTED, Attempt, next_attempt_at
from queen_server.payouts.lightning import (
    Invoice,
    LightningBackend,
    LightningError,
    LnbitsBackend,
    NoneBackend,
    Resolver,
    fetch_invoice,
    guarded_client,
    parse_payout_address,
    system_resolver,
)
from queen_server.settings import QueenSettings
from queen_server.storage.tables import AuditStandingRow, Payout, WorkerRecord

log = logging.getLogger(__name__)

QUEEN_BUG = "an internal error in the queen; it will be tried again"
_HISTORY = 64  # earlier payouts read per worker for its backoff
# The advisory lock every replica's payout pass takes (any constant unique to payouts).
PAYOUT_LOCK = 0x41706961_72790001


@dataclass(frozen=True, slots=True)
class PassReport:
    paid: int = 0
    failed: int = 0
    waiting: int = 0
    manual: int = 0
    skipped: int = 0  # a refund took the money between the pass's read and its reservation


def make_backend(settings: QueenSettings, client: httpx.AsyncClient) -> LightningBackend:
    if settings.lightning_backend == "lnbits":
        if not settings.lnbits_url or not settings.lnbits_admin_key:
            raise ValueError("APIARY_LIGHTNING_BACKEND=lnbits needs APIARY_LNBITS_URL and "
                             "APIARY_LNBITS_ADMIN_KEY")
        return LnbitsBackend(settings.lnbits_url, settings.lnbits_admin_key, client)
    return NoneBackend()


class PayoutRunner:
    def __init__(
        self,
        settings: QueenSettings,
        engine: AsyncEngine,
        store: LedgerStore,
        backend: LightningBackend,
        client: httpx.AsyncClient,
        *,
        resolver: Resolver = system_resolver,
    ) -> None:
        """``client`` is the queen's own (the backend's side); it is never handed a
        worker-supplied URL. ``resolver`` resolves LNURL hosts for the SSRF guard (tests
        inject one)."""
        self.settings = settings
        self.engine = engine
        self.store = store
        self.backend = backend
        self.client = client
        self.resolver = resolver
        self.manual = isinstance(backend, NoneBackend)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="payout runner")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _loop(self) -> None:
        while True:
            try:
                report = await self.run_once()
                if report != PassReport():
                    log.info("payout pass: %s", report)
            except Exception:
                log.exception("the payout pass failed; it runs again in %s s",
                              self.settings.payout_interval_s)
            await asyncio.sleep(self.settings.payout_interval_s)

    def lnurl_client(self) -> httpx.AsyncClient:
        """A fresh guarded client for worker-supplied URLs (close it after use)."""
        return guarded_client(allowed_hosts=self.settings.lnurl_insecure_hosts,
                              resolver=self.resolver, timeout_s=self.settings.lnurl_timeout_s)

    async def run_once(self) -> PassReport:
        """One pass; on PostgreSQL only while holding the payout lock (an empty report, with
        nothing done, when another replica holds it)."""
        if self.engine.dialect.name != "postgresql":
            return await self._pass()
        async with self.engine.connect() as lock:
            if not await lock.scalar(text("SELECT pg_try_advisory_lock(:key)"),
                                     {"key": PAYOUT_LOCK}):
                log.debug("another replica is running the payout pass; skipping this one")
                return PassReport()
            try:
                await lock.commit()  # the lock is the session's; no transaction stays open
                return await self._pass()
            finally:
                await lock.execute(text("SELECT pg_advisory_unlock(:key)"),
                                   {"key": PAYOUT_LOCK})
                await lock.commit()

    async def _pass(self) -> PassReport:
        reconciled = await self.reconcile()
        paid, failed, waiting = reconciled.paid, reconciled.failed, reconciled.waiting
        manual = skipped = 0
        threshold = self.settings.payout_threshold_sats * 1000
        due = await self._due(threshold)
        if not due:
            return reconciled
        async with self.lnurl_client() as client:
            for key, amount, ln_url in due:
                state = await self.pay(key, amount, ln_url, client=client)
                paid += state == "paid"
                failed += state == "failed"
                waiting += state == "invoiced"
                manual += state == "manual"
                skipped += state == "skipped"
        return PassReport(paid, failed, waiting, manual, skipped)

    async def _due(self, threshold: int) -> list[tuple[str, int, str]]:
        """``(worker key, amount, address)`` of each worker to pay now, by key: its available
        earnings less its debt over the threshold, with an address ("don't pay me"
        otherwise), past any backoff, and not flagged by audits (a flagged worker's payouts
        are held until an admin clears it)."""
        balances = await self.store.balances("worker:")
        net: dict[str, int] = {}
        for account, amount in balances.items():
            if account.endswith((":available", ledger.DEBT_SUFFIX)):
                key = account.split(":")[1]
                net[key] = net.get(key, 0) + amount
        due = {key: amount for key, amount in net.items() if amount >= threshold}
        if not due:
            return []
        async with self.engine.connect() as conn:
            rows = await conn.execute(select(WorkerRecord.key, WorkerRecord.ln_url)
                                      .where(WorkerRecord.key.in_(list(due))))
            addresses = {key: ln_url for key, ln_url in rows.all() if ln_url}
            held = await conn.execute(select(AuditStandingRow.worker_key).where(
                AuditStandingRow.worker_key.in_(list(due)), AuditStandingRow.state == "flagged"))
            for (key,) in held:
                log.info("worker %s is flagged by audits: its payout is held", key[:12])
                addresses.pop(key, None)
        now = datetime.now(UTC)
        ready = []
        for key in sorted(addresses.keys() & due.keys()):
            retry_at = await self._retry_at(key)
            if retry_at is not None and retry_at > now:
                log.debug("worker %s waits until %s after failed payouts", key[:12], retry_at)
                continue
            ready.append((key, due[key], addresses[key]))
        return ready

    async def _retry_at(self, worker_key: str) -> datetime | None:
        async with self.engine.connect() as conn:
            rows = (await conn.execute(
                select(Payout.state, Payout.detail, Payout.updated_at)
                .where(Payout.worker_key == worker_key)
                .order_by(Payout.id.desc()).limit(_HISTORY))).all()
        return next_attempt_at((Attempt(*row) for row in rows),
                               base_s=self.settings.payout_retry_base_s,
                               max_s=self.settings.payout_retry_max_s)

    async def pay(self, worker_key: str, amount_msat: int, ln_url: str, *,
                  client: httpx.AsyncClient | None = None) -> str:
        """One payout, from record to result; returns its state (``skipped``: the worker no
        longer has ``amount_msat`` past its debt, and nothing was recorded). ``client``: a
        guarded client for the worker's LNURL service (one is made for this payout when
        None)."""
        payout_id = await self._record(worker_key, amount_msat, ln_url)
        if payout_id is None:
            log.info("worker %s no longer has %d msat to pay out (a refund took some first); "
                     "skipped", worker_key[:12], amount_msat)
            return "skipped"
        if self.manual:
            await self._set(payout_id, "manual", detail="no Lightning backend: settle by hand")
            log.warning("payout %d of %d msat to worker %s is due; settle it by hand", payout_id,
                        amount_msat, worker_key[:12])
            return "manual"
        try:
            if client is None:
                async with self.lnurl_client() as own:
                    invoice = await self._invoice(ln_url, amount_msat, own)
            else:
                invoice = await self._invoice(ln_url, amount_msat, client)
        except LightningError as exc:
            log.warning("payout %d to worker %s failed before paying: %s", payout_id,
                        worker_key[:12], exc.message)
            await self._finish(payout_id, worker_key, amount_msat, "failed", exc.message)
            return "failed"
        except Exception:
            log.exception("BUG: getting the invoice of payout %d to worker %s raised; that "
                          "payout fails and the pass goes on", payout_id, worker_key[:12])
            await self._finish(payout_id, worker_key, amount_msat, "failed", QUEEN_BUG)
            return "failed"
        await self._set(payout_id, "invoiced", bolt11=invoice.bolt11,
                        payment_hash=invoice.payment_hash)
        try:
            result = await self.backend.pay(invoice, idempotency_key=f"payout:{payout_id}")
        except Exception:  # the payment may have gone out: only its status may settle it
            log.exception("BUG: the Lightning backend raised paying payout %d; it stays "
                          "invoiced and is asked about on the next pass", payout_id)
            return "invoiced"
        return await self._settle_by(payout_id, worker_key, amount_msat, result.status,
                                     result.detail)

    async def _invoice(self, ln_url: str, amount_msat: int,
                       client: httpx.AsyncClient) -> Invoice:
        address = parse_payout_address(ln_url, insecure_hosts=self.settings.lnurl_insecure_hosts)
        if address is None:
            raise LightningError("the worker has no payout address any more")
        return await fetch_invoice(address, amount_msat, client, comment="Apiary earnings",
                                   deadline_s=self.settings.lnurl_timeout_s)

    async def reconcile(self) -> PassReport:
        """Settle what an earlier pass (or a crash) left unfinished."""
        async with self.engine.connect() as conn:
            rows = (await conn.execute(select(Payout).where(
                Payout.state.in_(["recorded", "invoiced"])))).all()
        paid = failed = waiting = 0
        for row in rows:
            if row.state == "recorded":  # stopped before any invoice: nothing was sent
                await self._finish(row.id, row.worker_key, row.amount_msat, "failed",
                                   INTERRUPTED)
                failed += 1
                continue
            if self.manual:
                waiting += 1
                continue
            try:
                result = await self.backend.status(Invoice.from_bolt11(row.bolt11).payment_hash)
            except Exception:  # one payout's trouble must not stop the others' reconciling
                log.exception("BUG: reconciling payout %d raised; it stays invoiced", row.id)
                waiting += 1
                continue
            state = await self._settle_by(row.id, row.worker_key, row.amount_msat,
                                          result.status, result.detail)
            paid += state == "paid"
            failed += state == "failed"
            waiting += state == "invoiced"
        return PassReport(paid, failed, waiting)

    async def _settle_by(self, payout_id: int, worker_key: str, amount_msat: int, status: str,
                         detail: str) -> str:
        if status == "paid":
            await self._finish(payout_id, worker_key, amount_msat, "paid", detail)
            log.info("paid %d msat to worker %s (payout %d)", amount_msat, worker_key[:12],
                     payout_id)
            return "paid"
        if status == "failed":
            await self._finish(payout_id, worker_key, amount_msat, "failed", detail)
            log.warning("payout %d to worker %s failed: %s", payout_id, worker_key[:12], detail)
            return "failed"
        await self._set(payout_id, "invoiced", detail=f"{status}: {detail}"[:500])
        return "invoiced"  # pending or unknown: asked again on the next pass

    async def _record(self, worker_key: str, amount_msat: int, ln_url: str) -> int | None:
        """Reserve the payout: one transaction under the worker's accounts' locks that repays
        its debt out of ``available`` and moves ``amount_msat`` to ``payouts:in_flight``, with
        the payout's row. None, with nothing written, if ``available`` less the debt no
        longer covers it."""
        available, debt = ledger.worker_available(worker_key), ledger.worker_debt(worker_key)
        now = datetime.now(UTC)
        async with self.engine.begin() as conn:
            locked = await self.store.read_locked(
                conn, [available, debt, ledger.PAYOUTS_IN_FLIGHT])
            owed = max(0, -locked.balances[debt])
            if locked.balances[available] - owed < amount_msat:
                return None
            payout_id = (await conn.execute(insert(Payout).values(
                worker_key=worker_key, amount_msat=amount_msat, ln_url=ln_url,
                state="recorded", created_at=now, updated_at=now).returning(Payout.id)
            )).scalar_one()
            await self.store.apply_in(conn, [ledger.payout_start(
                worker_key, amount_msat, payout_id, repay_msat=owed)])
        if owed:
            log.info("worker %s repaid its %d msat debt before payout %d", worker_key[:12],
                     owed, payout_id)
        return payout_id

    async def _finish(self, payout_id: int, worker_key: str, amount_msat: int, state: str,
                      detail: str) -> None:
        posting = (ledger.payout_paid if state == "paid" else ledger.payout_failed)(
            worker_key, amount_msat, payout_id)
        async with self.engine.begin() as conn:
            await self.store.apply_in(conn, [posting])
            await conn.execute(update(Payout).where(Payout.id == payout_id).values(
                state=state, detail=detail[:500], updated_at=datetime.now(UTC)))

    async def _set(self, payout_id: int, state: str, **values: str | None) -> None:
        async with self.engine.begin() as conn:
            await conn.execute(update(Payout).where(Payout.id == payout_id).values(
                state=state, updated_at=datetime.now(UTC), **values))
