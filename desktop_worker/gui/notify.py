"""When the tray pops a notification: the deciding logic, pure (no Qt, clock passed in).

* the first job served (once per app run, and not if the queen already settled jobs for us);
* a payout sent (a payout seen as ``paid`` that was not paid at the last look; the first look
  only takes note of what is there);
* disconnected from the queen for over a minute (once per outage);
* errors that need the owner (always);
* sats waiting with no payout address set (once per app run: the policy lives as long as the
  app, and a reminder at each launch is wanted until the owner sets one);
* the queen's audits flagged this worker (once per app run; told again only if the flag was
  seen cleared and then came back), and the flag cleared after that;
* an engine process crashed (at most once every ``crash_every_s``: a model that keeps crashing
  is told once, and its log lines say the rest).

On a queen that says it does not pay (``queen_pays(False)``), the first-job notice promises no
earnings; ``None`` (an older queen that does not say) keeps the usual wording.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from desktop_worker.gui.services.audit import AuditStanding, audit_text
from desktop_worker.gui.services.sandbox import crash_text
from desktop_worker.gui.units import sats
from shared_schema import PayoutView


@dataclass(frozen=True)
class Notice:
    title: str
    message: str
    level: str = "info"  # info, warning, error


class NotificationPolicy:
    def __init__(self, disconnect_after_s: float = 60.0, crash_every_s: float = 600.0) -> None:
        self.disconnect_after_s = disconnect_after_s
        self.crash_every_s = crash_every_s
        self._crash_told: float | None = None
        self._served = False
        self._paid: set[int] | None = None
        self._connected_once = False
        self._lost_since: float | None = None
        self._lost_told = False
        self._pays: bool | None = None
        self._address_told = False
        self._flag_told = False

    def queen_pays(self, pays: bool | None) -> None:
        """What the queen said in its welcome (None: an older queen that does not say)."""
        self._pays = pays

    def already_served(self, jobs_settled: int) -> None:
        """The queen's count of settled jobs: a worker with some has served its first job."""
        if jobs_settled > 0:
            self._served = True

    def job_finished(self, outcome: str) -> Notice | None:
        if outcome != "ok" or self._served:
            return None
        self._served = True
        if self._pays is False:
            return Notice("First job served", "Your computer just answered its first request. "
                          "This queen does not pay its workers, so it earns nothing here.")
        return Notice("First job served", "Your computer just answered its first request. "
                      "Earnings show in the Earnings tab once the queen settles them.")

    def sats_waiting(self, owed_msat: int, has_payout_address: bool) -> Notice | None:
        """Sats are owed (pending or available) but there is nowhere to send them: told once."""
        if (owed_msat <= 0 or has_payout_address or self._pays is False
                or self._address_told):
            return None
        self._address_told = True
        return Notice("Add a payout address", f"The queen owes you {sats(owed_msat)} but "
                      "you have set no Lightning payout address, so it cannot pay you. Add one "
                      "in Settings.", "warning")

    def audit(self, standing: AuditStanding | None) -> Notice | None:
        """The queen's audit standing, at each earnings read. A flag is told once (the header
        and the Earnings tab keep saying it); once told, a standing seen not flagged says the
        flag is gone. None (nothing readable, or another queen's) changes nothing."""
        if standing is None:
            return None
        if standing.flagged:
            if self._flag_told:
                return None
            self._flag_told = True
            return Notice("The queen stopped sending you work", audit_text(standing), "error")
        if not self._flag_told:
            return None
        self._flag_told = False
        return Notice("Flag cleared", "The queen's checks no longer flag this worker: it can "
                      "send you work again.")

    def payouts(self, payouts: Iterable[PayoutView]) -> list[Notice]:
        paid = {p.id: p for p in payouts if p.state == "paid"}
        if self._paid is None:
            self._paid = set(paid)
            return []
        new = [paid[i] for i in sorted(set(paid) - self._paid)]
        self._paid |= set(paid)
        return [Notice("Payout sent", f"{p.amount_msat // 1000:,} sats were paid to your "
                       "Lightning address.") for p in new]

    def link(self, state: str, now: float) -> Notice | None:
        """The link's state changed (``LinkClient`` states). Returns a notice on reconnecting
        after an outage the owner was told about."""
        if state == "connected":
            told = self._lost_told
            self._connected_once = True
            self._lost_since = None
            self._lost_told = False
            if told:
                return Notice("Reconnected", "Apiary is connected to the queen again.")
            return None
        if state in ("stopped", "refused"):
            self._lost_since = None
            self._lost_told = False
            self._connected_once = False
            return None
        if self._connected_once and self._lost_since is None:
            self._lost_since = now
        return None

    def tick(self, now: float) -> Notice | None:
        """Called every few seconds: tells once when the queen has been gone too long."""
        if self._lost_since is None or self._lost_told:
            return None
        if now - self._lost_since < self.disconnect_after_s:
            return None
        self._lost_told = True
        minutes = int((now - self._lost_since) // 60)
        return Notice("Disconnected", f"Apiary has not reached the queen for {minutes} minute"
                      f"{'s' if minutes != 1 else ''}. It keeps retrying.", "warning")

    def engine_crashed(self, model: str, reason: str, now: float) -> Notice | None:
        if self._crash_told is not None and now - self._crash_told < self.crash_every_s:
            return None
        self._crash_told = now
        return Notice("A model's engine restarted", crash_text(model, reason), "warning")

    def error(self, message: str) -> Notice:
        return Notice("Apiary needs your attention", message, "error")
