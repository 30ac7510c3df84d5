"""The worker's earnings, read from its queen every ``interval_s`` (and on demand).

Until the first answer (or when the queen keeps no ledger) the views show zeros, labelled as
such through ``note``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from PySide6.QtCore import QObject, Signal

from desktop_worker.earnings import fetch_earnings
from desktop_worker.errors import WorkerError
from desktop_worker.identity import WorkerIdentity
from shared_schema import WorkerEarnings

log = logging.getLogger(__name__)


def empty_earnings() -> WorkerEarnings:
    return WorkerEarnings(worker_id="", jobs_settled=0, escrow_jobs_left=0, pending_msat=0,
                          available_msat=0, paid_msat=0, today_msat=0, total_msat=0)


def request_id(job_id: str) -> str:
    """The queen's request id of a job (its job ids are ``<request id>.<attempt>``)."""
    head, dot, attempt = job_id.rpartition(".")
    return head if dot and attempt.isdigit() else job_id


class EarningsService(QObject):
    updated = Signal(object)  # WorkerEarnings
    note = Signal(str)  # why the figures may be stale or zero ("" when fresh)

    def __init__(
        self,
        queen_url: Callable[[], str],
        identity: Callable[[], WorkerIdentity],
        *,
        interval_s: float = 30.0,
        parent: QObject | None = None,
    ) -> None:
        super().__init__(parent)
        self._queen_url = queen_url
        self._identity = identity
        self.interval_s = interval_s
        self.earnings = empty_earnings()
        self.fresh = False
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self.job_msat: dict[str, int] = {}

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def poke(self) -> None:
        """Refresh soon (after a job, or when the Earnings tab opens)."""
        self._wake.set()

    def earned_for(self, job_id: str) -> int | None:
        """msat this job earned, once the queen has settled it (None: not known yet)."""
        return self.job_msat.get(request_id(job_id))

    async def refresh(self) -> WorkerEarnings | None:
        try:
            earnings = await fetch_earnings(self._queen_url(), self._identity())
        except WorkerError as exc:
            self.fresh = False
            self.note.emit(f"Earnings not available right now: {exc}")
            return None
        self.earnings = earnings
        self.fresh = True
        self.job_msat.update({job.job_id: job.earned_msat for job in earnings.recent_jobs})
        self.note.emit("")
        self.updated.emit(earnings)
        return earnings

    async def _loop(self) -> None:
        while True:
            self._wake.clear()
            await self.refresh()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval_s)
