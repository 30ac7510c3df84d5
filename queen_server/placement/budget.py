"""How many placements may start in an hour: for the whole queen, and for each caller.

A placement costs the swarm something before it serves anyone: the queen reads the hub to resolve
the name (a listing and a header), and a volunteer downloads a file of up to ``max_model_gb``.
``HourlyBudget`` counts such starts in a sliding hour (a log of their times per key, trimmed as
it is read), so that ``placements_per_hour`` bounds the swarm's downloads and
``placements_per_key_per_hour`` bounds what one caller (an API key, a development key, an
open-access client's address: ``http.generation.caller_of``) can make the queen do, failed and
refused resolutions included.

``HourlyBudget`` is pure bookkeeping: no clock of its own (the caller passes ``now``), no I/O,
O(limit) per call. Memory is bounded: each key keeps at most ``limit`` times, and at most
``max_keys`` keys are kept (the least recently used is forgotten first; a forgotten caller
starts afresh, which a flood from many addresses gains nothing by, since the queen-wide limits
still hold). ``PlacementLimits`` holds the two budgets and turns a spent one into the 429 the
client gets, with the wait in ``Retry-After``.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Protocol

from queen_server.errors import RateLimited

__all__ = ["WINDOW_S", "HourlyBudget", "PlacementLimits"]

WINDOW_S = 3600.0
MAX_KEYS = 10_000


class HourlyBudget:
    """Starts per key in the last ``window_s``; the limit is given per call, so that the
    settings stay the one place it is read from."""

    def __init__(self, *, window_s: float = WINDOW_S, max_keys: int = MAX_KEYS) -> None:
        self.window_s = window_s
        self.max_keys = max_keys
        self._log: OrderedDict[str, deque[float]] = OrderedDict()

    def wait_s(self, key: str, limit: int, now: float) -> float | None:
        """Seconds until ``key`` may start one more (None: it may now)."""
        times = self._recent(key, now)
        if times is None or len(times) < limit:
            return None
        return max(0.0, times[-limit] + self.window_s - now)

    def spend(self, key: str, now: float) -> float:
        """Count one start of ``key`` at ``now`` (its time, for ``refund``)."""
        times = self._recent(key, now)
        if times is None:
            times = self._log[key] = deque()
            while len(self._log) > self.max_keys:
                self._log.popitem(last=False)
        times.append(now)
        return now

    def refund(self, key: str, at: float) -> None:
        """Take back the start counted at ``at`` (nothing was spent after all)."""
        times = self._log.get(key)
        if times is None:
            return
        try:
            times.remove(at)
        except ValueError:
            return
        if not times:
            del self._log[key]

    def used(self, key: str, now: float) -> int:
        """Starts of ``key`` in the window."""
        times = self._recent(key, now)
        return len(times) if times is not None else 0

    def __len__(self) -> int:
        """Keys with starts kept (what memory this holds)."""
        return len(self._log)

    def _recent(self, key: str, now: float) -> deque[float] | None:
        times = self._log.get(key)
        if times is None:
            return None
        while times and now - times[0] >= self.window_s:
            times.popleft()
        if not times:
            del self._log[key]
            return None
        self._log.move_to_end(key)
        return times


class LimitSettings(Protocol):
    @property
    def placements_per_hour(self) -> int: ...
    @property
    def placements_per_key_per_hour(self) -> int: ...


QUEEN = ""  # the queen's own key in ``PlacementLimits.queen``


class PlacementLimits:
    """Placements per hour: ``queen``, the fetches sent for new placements
    (``placements_per_hour``); ``callers``, the placements each caller started, failed and
    refused ones included (``placements_per_key_per_hour``)."""

    def __init__(self, settings: LimitSettings, clock: Callable[[], float]) -> None:
        self.settings = settings
        self.clock = clock
        self.queen = HourlyBudget()
        self.callers = HourlyBudget()

    def spend_queen(self, model: str, *, check_only: bool = False) -> float:
        """Count a new placement against ``placements_per_hour`` (its time, returned, for
        ``refund_queen``); ``check_only``: raise if none is left, count nothing (before the
        hub is read, so a client naming many models cannot make the queen read it past the
        limit)."""
        now = self.clock()
        wait = self.queen.wait_s(QUEEN, self.settings.placements_per_hour, now)
        if wait is not None:
            seconds = int(wait) + 1
            raise RateLimited(
                f"This queen has placed {self.queen.used(QUEEN, now)} new models in the last "
                f"hour, its limit (APIARY_PLACEMENTS_PER_HOUR); '{model}' can be placed in "
                f"{seconds} s.", code="placement_limit", headers={"Retry-After": str(seconds)})
        if not check_only:
            self.queen.spend(QUEEN, now)
        return now

    def refund_queen(self, at: float) -> None:
        """No fetch went out for the placement counted at ``at``."""
        self.queen.refund(QUEEN, at)

    def charge(self, caller: str, model: str) -> None:
        """Count a placement ``caller`` starts against ``placements_per_key_per_hour``; 429
        with the wait when it has none left."""
        limit = self.settings.placements_per_key_per_hour
        now = self.clock()
        wait = self.callers.wait_s(caller, limit, now)
        if wait is not None:
            seconds = int(wait) + 1
            raise RateLimited(
                f"This caller has started {limit} placements of models no worker held in the "
                f"last hour, its limit (APIARY_PLACEMENTS_PER_KEY_PER_HOUR); '{model}' can be "
                f"asked for in {seconds} s. Models workers already serve are not limited.",
                code="placement_limit_per_key", headers={"Retry-After": str(seconds)})
        self.callers.spend(caller, now)
