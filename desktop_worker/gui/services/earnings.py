"""The worker's earnings, read from its queen every ``interval_s`` (and on demand).

Until the first answer (or when the queen keeps no ledger) the views show zeros, labelled as
such through ``note``. Whether the queen pays at all comes from its ``welcome`` (``set_welcome``)
or, failing that, from the earnings answer: on a queen that says it does not pay, nothing is
fetched and the views say so instead of waiting for sats that never come.

A queen that audits its workers (issue 16) also says how this worker's audits went (``audit``:
unknown, good or flagged). It is read leniently (``services.audit.read_audit``: absent or
malformed means nothing to show) and kept with the queen URL it came from (``audit``), so a
flag from one queen is never shown for another.

A newer queen (issue 35) also says how it pays (``payout_mode``: automatically over Lightning,
by its operator's hand, or not at all; the operator's note; the address it pays) and how it
prices each of this worker's models and why (``prices``). The texts below say it in the
owner's words: who pays, how and when, and why a model earns what it earns.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from PySide6.QtCore import QObject, Signal

from desktop_worker.earnings import fetch_earnings_json, read_earnings
from desktop_worker.errors import WorkerError
from desktop_worker.gui.services.audit import AuditStanding, clean_reason, read_audit
from desktop_worker.gui.units import sats
from desktop_worker.identity import WorkerIdentity
from shared_schema import PayoutView, WorkerEarnings, WorkerModelPrice
from shared_schema.errors import ModelNameError
from shared_schema.model_names import parse_model_name
from shared_schema.openai_types import PAYOUT_MODES
from shared_schema.protocol import Welcome

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
        payout_address: Callable[[], str | None] = lambda: None,
        parent: QObject | None = None,
    ) -> None:
        super().__init__(parent)
        self._queen_url = queen_url
        self._identity = identity
        self.payout_address = payout_address
        # The last welcome's terms, and the queen URL they were given for (a new queen's
        # terms are unknown until it welcomes us).
        self._welcome: tuple[str, Welcome] | None = None
        self.interval_s = interval_s
        self.earnings = empty_earnings()
        self.fresh = False
        # The last audit standing read, and the queen URL it was read from.
        self._audit: tuple[str, AuditStanding] | None = None
        self._audit_unreadable = False
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
        """msat this job earned, once the queen has settled it (None: not known yet; 0 on a
        queen that does not pay, rather than "…" forever)."""
        earned = self.job_msat.get(request_id(job_id))
        if earned is None and self.pays is False:
            return 0
        return earned

    @property
    def pays(self) -> bool | None:
        """Whether the current queen pays its workers: its welcome's word, else the earnings
        answer's; None when neither said (an older queen, or not heard from yet)."""
        if self._welcome is not None and self._welcome[0] == self._queen_url():
            said = self._welcome[1].pays_workers
            if said is not None:
                return said
        return self.earnings.pays_workers if self.fresh else None

    @property
    def threshold_msat(self) -> int | None:
        """The payout threshold: from the welcome, else the earnings answer."""
        if self._welcome is not None and self._welcome[0] == self._queen_url():
            said = self._welcome[1].payout_threshold_msat
            if said is not None:
                return said
        return self.earnings.payout_threshold_msat if self.fresh else None

    @property
    def payout_mode(self) -> str | None:
        """How the current queen pays: "lightning", "manual" or "none"; None when it has not
        said (an older queen, or not heard from yet) or said something this app does not
        know."""
        said = self.earnings.payout_mode if self.fresh else None
        if said in PAYOUT_MODES:
            return said
        return "none" if self.pays is False else None

    @property
    def prices(self) -> dict[str, WorkerModelPrice]:
        """This worker's models as the current queen prices them, by name (empty until it
        has said: an older queen, not connected, or a queen that pays nothing)."""
        if not self.fresh or self.pays is False:
            return {}
        return {entry.name: entry for entry in self.earnings.models}

    @property
    def audit(self) -> AuditStanding | None:
        """This worker's audit standing at the current queen: None when it has not said (an
        older queen, an unusable answer, not heard from yet, or the standing came from
        another queen). Kept through a failed read, like the figures."""
        if self._audit is not None and self._audit[0] == self._queen_url():
            return self._audit[1]
        return None

    def set_welcome(self, welcome: Welcome) -> None:
        """The queen's terms arrived (each session): show them at once, and read the figures."""
        self._welcome = (self._queen_url(), welcome)
        self.republish()
        self.poke()

    def republish(self) -> None:
        """Show the last figures again (the terms or the payout address changed)."""
        if self.pays is False:
            self.note.emit("")
        self.updated.emit(self.earnings)

    async def refresh(self) -> WorkerEarnings | None:
        if self._welcome is not None and self._welcome[0] == self._queen_url() \
                and self._welcome[1].pays_workers is False:
            self.republish()  # nothing to read: this queen pays no one
            return None
        queen_url = self._queen_url()
        try:
            body = await fetch_earnings_json(queen_url, self._identity())
            # The figures are read apart from the audit part, so an audit this app cannot
            # read never costs the owner the figures.
            earnings = read_earnings({k: v for k, v in body.items() if k != "audit"})
        except WorkerError as exc:
            self.fresh = False
            if self.pays is False:
                self.republish()
                return None
            self.note.emit(f"Earnings not available right now: {exc}")
            return None
        self.earnings = earnings
        self.fresh = True
        standing = read_audit(body.get("audit"))
        unreadable = standing is None and "audit" in body
        if unreadable and not self._audit_unreadable:  # said once, not at every poll
            log.warning("the queen's audit standing is unreadable; not shown: %.200r",
                        body["audit"])
        self._audit_unreadable = unreadable
        self._audit = None if standing is None else (queen_url, standing)
        self.job_msat.update({job.job_id: job.earned_msat for job in earnings.recent_jobs})
        self.note.emit("")
        self.updated.emit(earnings)
        return earnings

    async def _loop(self) -> None:
        while True:
            self._wake.clear()
            await self.refresh()
            # Not asyncio.wait_for: on Python 3.11 it swallows a cancel that arrives as the
            # event is set (a poke right before Quit), and stop() would wait forever.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.interval_s):
                    await self._wake.wait()


# --- what the Earnings tab says (pure) --------------------------------------------------------

NOT_PAYING = "This queen does not pay its workers"
NOT_PAYING_DETAIL = (NOT_PAYING + ": it serves requests without keys or keeps no ledger, so the "
                     "jobs you serve here earn nothing. To earn sats, join a queen that pays "
                     "(Settings, Queen).")
PROOF_OF_WORK = "proof of work: your first job is unpaid"


def today_text(today_msat: int, pays: bool | None) -> str:
    """The header's and the tray's line: today's sats, or, on a queen that said it pays
    nothing, that instead of a zero."""
    return NOT_PAYING if pays is False else f"Today: {sats(today_msat)}"


def proof_of_work_row(earnings: WorkerEarnings) -> tuple[str, str, str]:
    """The Earnings table's pinned row for the first job (when, what, sats). The queen credits
    nothing for a new worker's first job, so it is never among ``recent_jobs``: this row says
    so instead of letting it vanish. ``jobs_settled`` tells whether it was served yet."""
    if earnings.jobs_settled > 0:
        return ("first job", PROOF_OF_WORK + " (done)", "0")
    return ("next job", PROOF_OF_WORK + " (the jobs after it earn)", "—")


def escrow_text(earnings: WorkerEarnings) -> str:
    """Where this worker stands: proof of work, escrow, or earning freely."""
    settled = f"{earnings.jobs_settled:,} job(s) settled."
    if earnings.jobs_settled == 0:
        return (f"{settled} Your first job is your proof of work and earns nothing; the ones "
                "after it earn sats.")
    if earnings.escrow_jobs_left:
        return (f"{settled} A new worker's next jobs are held in escrow: "
                f"{earnings.escrow_jobs_left:,} more until pending earnings become available.")
    return settled


def address_nudge(earnings: WorkerEarnings, has_address: bool) -> str:
    """The nudge shown when the queen pays but there is no payout address ("" when none)."""
    if has_address:
        return ""
    owed = earnings.available_msat + earnings.pending_msat
    if owed > 0:
        return ("You have no Lightning payout address, so the queen cannot pay what it owes "
                "you. Add one to be paid.")
    return "You have no Lightning payout address yet: add one so the queen can pay you."


# --- how this queen pays, and what each model earns (pure) -----------------------------------

MANUAL = "This queen's operator pays by hand: ask them how and when."
NO_TERMS = ""  # an older queen says nothing of how it pays: nothing is claimed for it
MAX_PRICE_LINES = 8  # models listed in the Earnings tab (a queen's list is its word: bounded)
UNVERIFIED_HINT = ("Add the model by its Hugging Face name so the queen can read its file and "
                   "price it by its size.")
HUB_RETRY_HINT = ("The queen tries the hub again later: once it reads the file, it prices the "
                  "model by its size.")
PRICE_WHY = {
    "operator": "this queen's operator set its price",
    "verified": "the queen read its file on the hub and prices it by its size",
    "same_file": "the queen knows this very file from the hub and prices it by its size",
    "file_size": "the queen could not read this model on the hub, so it prices it by the size "
                 "of your file",
    "unverified": "the queen could not read this model's file on the hub, so it prices it as "
                  "unverified: the class it gives every model it cannot check (by default its "
                  "dearest, which few developers choose)",
}


def payout_terms_text(mode: str | None, address: str | None, note: str | None) -> str:
    """Who pays this worker, and how, in one or two sentences ("" when the queen has not
    said). ``address`` is the one the queen holds (it is where payouts go); ``note`` is the
    operator's own word, shown as theirs."""
    shown_note = clean_reason(note)
    said = f" The operator says: \u201c{shown_note}\u201d" if shown_note else ""
    if mode == "none":
        return NOT_PAYING + "."
    if mode == "manual":
        return MANUAL + said
    if mode == "lightning":
        shown = clean_reason(address)
        where = (f"Paid to {shown} over Lightning, automatically." if shown else
                 "This queen pays automatically over Lightning, once you have a payout "
                 "address.")
        return where + said
    return NO_TERMS


PAYOUT_STATES = {
    "recorded": ("Starting", ""),
    "invoiced": ("Sending", "sent over Lightning, waiting for it to settle"),
    "paid": ("Paid", ""),
    "failed": ("Failed", "the queen tries again later"),
    "manual": ("Due by hand", "the operator pays this by hand: ask them if it has not arrived"),
}


def payout_cells(payout: PayoutView) -> tuple[str, str, str, str]:
    """A row of the Payouts table: when, how much, its state and what it means, in words (the
    queen's own detail is shown only for a failure, where it says what went wrong)."""
    state, meaning = PAYOUT_STATES.get(payout.state, (payout.state, ""))
    if payout.state == "failed" and (detail := clean_reason(payout.detail)):
        meaning = f"{detail}; {meaning}"
    return (payout.updated_at.strftime("%Y-%m-%d %H:%M"), sats(payout.amount_msat), state,
            meaning)


def price_cell(entry: WorkerModelPrice | None) -> str:
    """The Models tab's short price: "tiny: 0.16 sats per 1k tokens" ("—": not said)."""
    if entry is None:
        return "—"
    mark = " (unverified)" if entry.price.basis == "unverified" else ""
    return (f"{clean_reason(entry.price.size_class)}{mark}: "
            f"{sats(entry.earn_msat_per_1k_tokens)} per 1k tokens")


def price_text(entry: WorkerModelPrice) -> str:
    """What a model earns here and why, in the owner's words: "smollm2 earns you 0.16 sats
    per 1,000 tokens it writes (the tiny class): the queen could not read this model on the
    hub, so it prices it by the size of your file." """
    name, cls = clean_reason(entry.name), clean_reason(entry.price.size_class)
    earns = (f"{name} earns you {sats(entry.earn_msat_per_1k_tokens)} per 1,000 tokens "
             f"it writes (the {cls} class)")
    why = PRICE_WHY.get(entry.price.basis or "")
    return f"{earns}: {why}." if why else f"{earns}."


def what_to_do(entry: WorkerModelPrice) -> str:
    """For a model priced as unverified, what the owner can do about it ("" otherwise): add
    it by its hub name, or, when it has one (the hub was out of reach), wait."""
    if entry.price.basis != "unverified":
        return ""
    try:
        parse_model_name(entry.name)
    except ModelNameError:
        return UNVERIFIED_HINT
    return HUB_RETRY_HINT


def prices_text(prices: dict[str, WorkerModelPrice], pays: bool | None) -> str:
    """The Earnings tab's lines on this worker's models ("" when there is nothing to say)."""
    if pays is False or not prices:
        return ""
    names = sorted(prices)
    lines = [price_text(prices[name]) for name in names[:MAX_PRICE_LINES]]
    if len(names) > MAX_PRICE_LINES:
        lines.append(f"…and {len(names) - MAX_PRICE_LINES:,} more (the Models tab shows each).")
    return "\n".join(lines)


def price_line(entry: WorkerModelPrice | None, pays: bool | None) -> str:
    """The Models tab's line under a selected model: its price here and why."""
    if pays is False:
        return "This queen does not pay its workers, so this model earns nothing here."
    if entry is None:
        return ("Its price on your queen shows here while you earn (the queen prices the "
                "models it sees you hold).")
    hint = what_to_do(entry)
    return f"{price_text(entry)} {hint}" if hint else price_text(entry)
