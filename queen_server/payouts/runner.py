"""Paying workers over Lightning, without ever paying twice or losing a record.

Each payout goes: record it (a ``payouts`` row and a ledger posting moving the worker's available
earnings to ``payouts:in_flight``, in one transaction), then get an invoice from the worker's
address (LNURL-pay, checked), store it, then pay it. The result settles the ledger: paid moves the
money to ``worker:<key>:paid``; failed returns it to the worker.

A crash can stop this anywhere. ``reconcile`` runs first on every pass: a payout still
``recorded`` never reached the backend (no invoice was stored), so its money is returned; one
``invoiced`` is asked about by its payment hash, and only a definite answer settles it. The
backend's ``pay`` checks the payment hash before paying, so a retry never pays twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from datetime import UTC, datetime

import httpx
from sqlalchemy import insert, select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from queen_server.billing import ledger
from queen_server.billing.store import LedgerStore
from queen_server.payouts.lightning import (
    Invoice,
    LightningBackend,
    LightningError,
    LnbitsBackend,
    NoneBackend,
    fetch_invoice,
    parse_payout_address,
)
from queen_server.settings import QueenSettings
from queen_server.storage.tables import Payout, WorkerRecord

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PassReport:
    paid: int = 0
    failed: int = 0
    waiting: int = 0
    manual: int = 0


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
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.store = store
        self.backend = backend
        self.client = client
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

    async def run_once(self) -> PassReport:
        reconciled = await self.reconcile()
        paid, failed, waiting, manual = reconciled.paid, reconciled.failed, reconciled.waiting, 0
        threshold = self.settings.payout_threshold_sats * 1000
        for key, amount, ln_url in await self._due(threshold):
            state = await self.pay(key, amount, ln_url)
            paid += state == "paid"
            failed += state == "failed"
            waiting += state == "invoiced"
            manual += state == "manual"
        return PassReport(paid, failed, waiting, manual)

    async def _due(self, threshold: int) -> list[tuple[str, int, str]]:
        balances = await self.store.balances("worker:")
        due = {account.split(":")[1]: amount for account, amount in balances.items()
               if account.endswith(":available") and amount >= threshold}
        if not due:
            return []
        async with self.engine.connect() as conn:
            rows = await conn.execute(select(WorkerRecord.key, WorkerRecord.ln_url)
                                      .where(WorkerRecord.key.in_(list(due))))
            addresses = dict(rows.all())
        return [(key, amount, addresses[key]) for key, amount in due.items()
                if addresses.get(key)]  # no address: "don't pay me"

    async def pay(self, worker_key: str, amount_msat: int, ln_url: str) -> str:
        """One payout, from record to result; returns its state."""
        payout_id = await self._record(worker_key, amount_msat, ln_url)
        if self.manual:
            await self._set(payout_id, "manual", detail="no Lightning backend: settle by hand")
            log.warning("payout %d of %d msat to worker %s is due; settle it by hand", payout_id,
                        amount_msat, worker_key[:12])
            return "manual"
        try:
            address = parse_payout_address(ln_url,
                                           insecure_hosts=self.settings.lnurl_insecure_hosts)
            assert address is not None
            invoice = await fetch_invoice(address, amount_msat, self.client,
                                          comment="Apiary earnings")
        except LightningError as exc:
            await self._finish(payout_id, worker_key, amount_msat, "failed", str(exc))
            return "failed"
        await self._set(payout_id, "invoiced", bolt11=invoice.bolt11,
                        payment_hash=invoice.payment_hash)
        result = await self.backend.pay(invoice, idempotency_key=f"payout:{payout_id}")
        return await self._settle_by(payout_id, worker_key, amount_msat, result.status,
                                     result.detail)

    async def reconcile(self) -> PassReport:
        """Settle what an earlier pass (or a crash) left unfinished."""
        async with self.engine.connect() as conn:
            rows = (await conn.execute(select(Payout).where(
                Payout.state.in_(["recorded", "invoiced"])))).all()
        paid = failed = waiting = 0
        for row in rows:
            if row.state == "recorded":  # stopped before any invoice: nothing was sent
                await self._finish(row.id, row.worker_key, row.amount_msat, "failed",
                                   "interrupted before an invoice was fetched")
                failed += 1
                continue
            if self.manual:
                waiting += 1
                continue
            result = await self.backend.status(Invoice.from_bolt11(row.bolt11).payment_hash)
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

    async def _record(self, worker_key: str, amount_msat: int, ln_url: str) -> int:
        now = datetime.now(UTC)
        async with self.engine.begin() as conn:
            payout_id = (await conn.execute(insert(Payout).values(
                worker_key=worker_key, amount_msat=amount_msat, ln_url=ln_url,
                state="recorded", created_at=now, updated_at=now).returning(Payout.id)
            )).scalar_one()
            await self.store.apply_in(conn, [ledger.payout_start(worker_key, amount_msat,
                                                                 payout_id)])
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
