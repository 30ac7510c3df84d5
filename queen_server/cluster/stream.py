"""The receiving end of one cross-replica job as a sans-I/O state machine, and the sending end's
sequence counter.

Pub/sub on one Redis connection delivers a channel's messages in order, but it also drops them
silently while a connection is down, and a subscriber that fell behind loses some on purpose
(``cluster.bus``). So every event of a job carries a sequence number, and the receiver checks
it: events come out strictly in order, a small out-of-order window is held, and anything that
means an event may be missing ends the stream with a typed outcome instead of a silently
shorter answer:

- ``Gap``: an event past the window arrived while an earlier one is still missing, or the bus
  said it may have lost messages (``reset``), or the stream went idle with a hole in it;
- ``Idle``: nothing arrived before the idle deadline (the serving replica or its worker went
  quiet; the serving replica sends keep-alives while it has nothing else to say).

There is no clock inside: the caller passes ``now`` (any monotonic clock) and asks
``deadline()`` when to look again. The payloads are opaque to this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

P = TypeVar("P")

# How far ahead of the next expected event one may arrive and be held, waiting for the hole.
DEFAULT_WINDOW = 32


@dataclass(frozen=True, slots=True)
class Gap:
    """Events may be missing: ``expected`` is the first sequence number not received."""

    expected: int
    reason: str


@dataclass(frozen=True, slots=True)
class Idle:
    """No event for ``idle_s`` seconds (since ``since``)."""

    since: float
    idle_s: float


Failure = Gap | Idle


class Sequencer:
    """The sending side: one counter per job, from 0."""

    __slots__ = ("next_seq",)

    def __init__(self) -> None:
        self.next_seq = 0

    def take(self) -> int:
        seq = self.next_seq
        self.next_seq = seq + 1
        return seq


class ReplyStream(Generic[P]):
    """One job's events as they arrive over the bus, put back in order and checked.

    ``feed`` returns the payloads now deliverable in order (possibly none, possibly several
    when a hole was filled). After the final payload is delivered the stream is ``done`` and
    nothing else matters; after a failure it is ``failed`` and every later feed returns [].
    ``idle_s`` may change as the job goes on (``set_idle``): a short one until the serving
    replica accepts the job, a longer one after.
    """

    __slots__ = ("_held", "done", "expected", "failed", "idle_s", "last_at", "window")

    def __init__(self, now: float, idle_s: float, window: int = DEFAULT_WINDOW) -> None:
        if idle_s <= 0 or window < 0:
            raise ValueError("idle_s must be positive and window not negative")
        self.expected = 0
        self.idle_s = idle_s
        self.window = window
        self.last_at = now
        self.done = False
        self.failed: Failure | None = None
        self._held: dict[int, tuple[P, bool]] = {}

    @property
    def open(self) -> bool:
        return not self.done and self.failed is None

    def set_idle(self, idle_s: float, now: float) -> None:
        self.idle_s = idle_s
        self.last_at = now

    def feed(self, seq: int, payload: P, now: float, *, final: bool = False) -> list[P]:
        """Take event ``seq``; ``final``: it is the job's last (a result or an error)."""
        if not self.open or seq < self.expected or seq in self._held:
            return []  # after the end, or a duplicate: nothing new
        self.last_at = now
        if seq > self.expected:
            if seq - self.expected > self.window:
                self._fail(Gap(self.expected, f"event {seq} arrived while event "
                                              f"{self.expected} is still missing"))
                return []
            self._held[seq] = (payload, final)
            return []
        out = [payload]
        self.expected += 1
        if final:
            self._finish()
            return out
        held = self._held
        while held:
            item = held.pop(self.expected, None)
            if item is None:
                break
            out.append(item[0])
            self.expected += 1
            if item[1]:
                self._finish()
                break
        return out

    def reset(self, reason: str) -> Failure | None:
        """The bus may have lost messages (a reconnect, a subscriber that fell behind): an
        open stream fails with a ``Gap``; a finished one is unaffected."""
        if self.open:
            self._fail(Gap(self.expected, reason))
        return self.failed if not self.done else None

    def check(self, now: float) -> Failure | None:
        """The stream's failure, if it has one now: past the idle deadline, it fails (as a
        ``Gap`` if an event was held waiting for a hole, else ``Idle``)."""
        if self.open and now - self.last_at >= self.idle_s:
            if self._held:
                self._fail(Gap(self.expected, f"event {self.expected} never arrived"))
            else:
                self._fail(Idle(self.last_at, self.idle_s))
        return self.failed

    def deadline(self) -> float:
        """When ``check`` would next fail the stream, were nothing to arrive."""
        return self.last_at + self.idle_s

    def _finish(self) -> None:
        self.done = True
        self._held.clear()

    def _fail(self, failure: Failure) -> None:
        self.failed = failure
        self._held.clear()
