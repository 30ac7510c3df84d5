"""The Logs tab's model, widget-free: repeated lines folded, and warnings said once per run.

A worker that cannot reach its queen, or probes a GPU it does not have, says the same thing
over and over; 27 identical lines hide the one that matters. ``LogFolder`` turns a stream of
lines into edits of the shown text: a line that repeats the one before (or a group of up to
``max_period`` lines that repeats the group before) is not shown again, and one counter line
under it says "… repeated 26 times". A group's lines are shown as they come (nothing is held
back) and taken back when the group turns out to be a repeat. Lines are compared by level,
logger and message, without the timestamp.

``OncePerRun`` is a ``logging.Filter`` for loggers whose warnings are about the machine, not
the moment (the keyring one at every Start): each distinct message passes once per process.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Append:
    """Show ``text`` as a new last line."""

    text: str


@dataclass(frozen=True)
class RemoveLast:
    """Take back the last ``count`` lines shown."""

    count: int


Edit = Append | RemoveLast


def repeated_text(times: int, period: int) -> str:
    if period == 1:
        return f"… repeated {times} time{'s' if times != 1 else ''}"
    return f"… the last {period} lines repeated {times} time{'s' if times != 1 else ''}"


@dataclass
class LogFolder:
    """Turns lines into ``Edit`` lists. ``feed(key, text)``: ``key`` is what makes two lines
    "the same" (level, logger, message), ``text`` is what is shown (with its time)."""

    max_period: int = 3
    _tail: list[str] = field(default_factory=list)  # keys of the last real lines shown
    _cycle: list[str] | None = None  # the group being repeated
    _pos: int = 0  # lines of the current repetition shown so far (tentatively)
    _repeats: int = 0  # whole repetitions folded into the counter
    _counter: bool = False  # the counter line is the last line before the tentative ones

    def reset(self) -> None:
        self._tail.clear()
        self._cycle = None
        self._pos = self._repeats = 0
        self._counter = False

    def feed(self, key: str, text: str) -> list[Edit]:
        if self._cycle is not None:
            if key == self._cycle[self._pos]:
                return self._continue(text)
            self._end_cycle()
        for period in range(1, self.max_period + 1):
            if len(self._tail) >= period and self._tail[-period] == key:
                self._cycle = self._tail[-period:]
                self._pos = 0
                self._repeats = 0
                self._counter = False
                return self._continue(text)
        return self._show(key, text)

    def _continue(self, text: str) -> list[Edit]:
        assert self._cycle is not None
        period = len(self._cycle)
        self._pos += 1
        if self._pos < period:
            return [Append(text)]  # tentative: taken back if the group completes
        # A whole repetition: take back its tentative lines and the old counter, count it.
        taken = (period - 1) + (1 if self._counter else 0)
        self._pos = 0
        self._repeats += 1
        self._counter = True
        edits: list[Edit] = [RemoveLast(taken)] if taken else []
        edits.append(Append(repeated_text(self._repeats, period)))
        return edits

    def _end_cycle(self) -> None:
        """The group stopped repeating: its tentative lines stay as ordinary lines."""
        assert self._cycle is not None
        shown = self._cycle[:self._pos]
        self._cycle = None
        self._pos = 0
        self._counter = False
        # The counter line breaks adjacency: only lines after it can start a new fold.
        self._tail = list(shown)

    def _show(self, key: str, text: str) -> list[Edit]:
        self._tail.append(key)
        del self._tail[:-self.max_period]
        return [Append(text)]


class OncePerRun(logging.Filter):
    """Lets each distinct message through once; later ones are dropped (a bounded memory)."""

    def __init__(self, limit: int = 256) -> None:
        super().__init__()
        self.limit = limit
        self._seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message in self._seen:
            return False
        if len(self._seen) < self.limit:
            self._seen.add(message)
        return True
