"""Per-caller admission: one caller (an API key, or an open-access client's address) cannot
fill the admission queue or hold every slot of the swarm, so another caller is still admitted
while one floods.

``CallerLimits`` counts, per caller, the requests in flight (from admission until the answer
ends: queued or running) and, of those, the ones waiting in the admission queue. It is pure
bookkeeping, O(1) per call, with no clock and no I/O; the ``Dispatcher`` turns a refusal into a
429. Memory is bounded by the callers with something in flight: a caller whose counts fall to
zero is dropped from the dict.

A request's place is an ``Admission`` ticket. Its ``leave`` is idempotent, so every path that
ends a request (an answer, an error, a cancel, a client gone, a stream's two ``finish`` calls)
may call it without counting twice.
"""

from __future__ import annotations

from dataclasses import dataclass

# Why a request was refused (``CallerLimits.try_enter`` and ``Admission.try_queue``).
IN_FLIGHT = "in_flight"
QUEUED = "queued"


@dataclass(slots=True)
class _Counts:
    in_flight: int = 0
    queued: int = 0


class Admission:
    """One admitted request's place in its caller's counts."""

    __slots__ = ("_left", "_limits", "_queued", "caller")

    def __init__(self, limits: CallerLimits, caller: str) -> None:
        self._limits = limits
        self.caller = caller
        self._queued = False
        self._left = False

    @property
    def queued(self) -> bool:
        return self._queued

    def try_queue(self, max_queued: int) -> bool:
        """Take a place in the admission queue; False when the caller already has
        ``max_queued`` waiting (0: no limit). A ticket already queued keeps its place."""
        if self._queued or self._left:
            return not self._left
        counts = self._limits._counts[self.caller]
        if max_queued and counts.queued >= max_queued:
            return False
        counts.queued += 1
        self._queued = True
        return True

    def unqueue(self) -> None:
        """Leave the admission queue (a worker was found, or the wait ended); idempotent."""
        if self._queued:
            self._queued = False
            self._limits._counts[self.caller].queued -= 1

    def leave(self) -> None:
        """The request ended: give back its place (and its queue place, if any); idempotent."""
        if self._left:
            return
        self.unqueue()
        self._left = True
        self._limits._leave(self.caller)


class CallerLimits:
    """Requests in flight and queued, per caller. Limits are given per call (0: no limit) so
    that the settings stay the one place they are read from."""

    def __init__(self) -> None:
        self._counts: dict[str, _Counts] = {}

    def try_enter(self, caller: str, *, max_in_flight: int,
                  max_queued: int) -> Admission | str:
        """Admit one request of ``caller``: its ``Admission``, or why not (``IN_FLIGHT`` when
        the caller already has ``max_in_flight`` requests under way; ``QUEUED`` when it already
        has ``max_queued`` waiting, since a new one would only wait behind them)."""
        counts = self._counts.get(caller)
        if counts is None:
            counts = self._counts[caller] = _Counts()
        elif max_in_flight and counts.in_flight >= max_in_flight:
            return IN_FLIGHT
        elif max_queued and counts.queued >= max_queued:
            return QUEUED
        counts.in_flight += 1
        return Admission(self, caller)

    def _leave(self, caller: str) -> None:
        counts = self._counts[caller]
        counts.in_flight -= 1
        if counts.in_flight <= 0 and counts.queued <= 0:
            del self._counts[caller]

    def in_flight(self, caller: str) -> int:
        counts = self._counts.get(caller)
        return counts.in_flight if counts is not None else 0

    def queued(self, caller: str) -> int:
        counts = self._counts.get(caller)
        return counts.queued if counts is not None else 0

    def __len__(self) -> int:
        """Callers with something in flight (the dict's size: what memory this holds)."""
        return len(self._counts)
