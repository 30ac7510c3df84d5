"""Sampled tokens to the text a client sees: UTF-8 assembly and stop strings, pure.

A token is bytes, not text: a character may be split across tokens, and the text of a token may
be the start of a stop string, which must never be sent. ``TextStream`` takes one token's bytes
at a time and says which text can go out now; text is released only at token boundaries, so
each released token carries the exact text it contributed (its log probability goes out with
it, and the tokens' texts joined are the content).
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(slots=True)
class Released(Generic[T]):
    """What may be sent after a token: the tokens whose text is final, each with its text
    (empty for a token that only began a character), and whether a stop string was reached."""

    tokens: list[tuple[T, str]]
    stopped: bool = False

    @property
    def text(self) -> str:
        return "".join(text for _, text in self.tokens)


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many characters at the end of ``text`` could be the start of a stop string."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest


class TextStream(Generic[T]):
    """Incremental UTF-8 decoding with stop-string hold-back for one choice."""

    def __init__(self, stops: tuple[str, ...] = ()) -> None:
        self.stops = tuple(stop for stop in stops if stop)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending: list[tuple[T, str]] = []  # decoded, not yet released
        self.stopped = False

    def push(self, piece: bytes, tag: T) -> Released[T]:
        """Add one token's bytes; returns the tokens that can be released now."""
        if self.stopped:
            return Released([], True)
        self._pending.append((tag, self._decoder.decode(piece)))
        held = "".join(text for _, text in self._pending)
        for stop in self.stops:
            at = held.find(stop)
            if at >= 0:
                self.stopped = True
                return Released(self._cut(at), True)
        keep_from = len(held) - held_back(held, self.stops)
        # Release whole tokens that end before the held-back tail.
        released: list[tuple[T, str]] = []
        end = 0
        for tag_, text in self._pending:
            if end + len(text) > keep_from:
                break
            end += len(text)
            released.append((tag_, text))
        del self._pending[:len(released)]
        return Released(released)

    def _cut(self, at: int) -> list[tuple[T, str]]:
        """The pending tokens' texts up to ``at`` characters (the start of a stop string)."""
        out: list[tuple[T, str]] = []
        end = 0
        for tag, text in self._pending:
            if end >= at:
                break
            out.append((tag, text[:at - end]))
            end += len(text)
        self._pending.clear()
        return out

    def finish(self) -> Released[T]:
        """The end of the choice: release everything held (an unfinished character is
        dropped, as llama.cpp's own completion does)."""
        out = self._pending
        self._pending = []
        self._decoder.reset()
        return Released(out, self.stopped)
