"""Joining a job's streamed tokens into fewer chunk frames when they come faster than frames go.

Every chunk frame costs the queen the same to decode, check, book and relay whatever it holds
(issue 18 measured about 20 µs of queen CPU per streamed token at one token a frame). So while
one of a job's frames is being sent, the chunks the engine makes meanwhile wait here and go out
as ONE frame: their content deltas concatenated, their log-probability entries concatenated,
and ``Chunk.tokens`` saying how many chunks it stands for. When tokens are slower than frames
(the usual case on a free connection) every chunk goes out alone, as soon as it is made: this
adds no latency, it only uses a backlog that already exists.

Only chunks that say nothing but "more text of choice i" are joined. A chunk that opens a
message (``role``), ends one (``finish_reason``), carries tool calls, usage, a refusal or any
field this module does not know stays a frame of its own, and the chunks around it are never
joined across it, so the client reads the same message in the same order, only in fewer pieces.
A joined frame is capped (``max_tokens`` chunks, ``max_chars`` characters of content), so a
stalled connection never grows one frame without bound.

Pure and synchronous: no socket, no clock. The worker's link machine (``machine.Link``) keeps
one ``Coalescer`` per streamed job, and the scripted test worker uses the same class, so the
benchmark measures this rule.
"""

from __future__ import annotations

from collections import deque
from typing import Any

# What a worker joins into one frame at most, before the queen's own cap (the welcome's
# ``chunk_tokens``) is applied: enough to cut the queen's per-frame cost 30-fold under a
# backlog, small enough that a frame stays a few KB.
DEFAULT_MAX_TOKENS = 32
DEFAULT_MAX_CHARS = 4096

_CHOICE_KEYS = frozenset({"index", "delta", "finish_reason", "logprobs"})


def _joinable(data: dict[str, Any]) -> tuple[int, str, list[Any] | None] | None:
    """``(index, content, logprob entries or None)`` for a chunk that is only more text of one
    choice (what may be joined); None for any other chunk. (Its other top-level fields, an
    ``object`` or a ``model``, must equal those of the chunk it joins: ``_Frame.same_top``.)"""
    if "usage" in data:
        return None
    choices = data.get("choices")
    if not isinstance(choices, list) or len(choices) != 1:
        return None
    choice = choices[0]
    if not isinstance(choice, dict) or not _CHOICE_KEYS.issuperset(choice):
        return None
    if choice.get("finish_reason") is not None:
        return None
    index = choice.get("index", 0)
    delta = choice.get("delta")
    if type(index) is not int or not isinstance(delta, dict) or len(delta) != 1:
        return None
    content = delta.get("content")
    if not isinstance(content, str) or not content:
        return None
    logprobs = choice.get("logprobs")
    if logprobs is None:
        return index, content, None
    if not isinstance(logprobs, dict) or len(logprobs) != 1:
        return None
    entries = logprobs.get("content")
    if not isinstance(entries, list):
        return None
    return index, content, entries


class _Frame:
    """One frame waiting to go: its first chunk, and what later chunks added to it."""

    __slots__ = ("data", "entries", "index", "joinable", "pieces", "tokens")

    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data
        self.tokens = 1
        head = _joinable(data)
        self.joinable = head is not None
        self.index, first, self.entries = head if head is not None else (0, "", None)
        self.pieces = [first]

    def same_top(self, data: dict[str, Any]) -> bool:
        """Whether ``data`` has the same fields beside ``choices`` as this frame's first chunk
        (``object``, ``model``...), so that joining it loses none."""
        first = self.data
        if len(data) != len(first):
            return False
        for key, value in first.items():
            if key != "choices" and (key not in data or data[key] != value):
                return False
        return True

    def build(self) -> dict[str, Any]:
        """The frame's chunk: the first one as it was, or the joined one."""
        if self.tokens == 1:
            return self.data
        choice = dict(self.data["choices"][0])
        choice["delta"] = {"content": "".join(self.pieces)}
        if self.entries is not None:
            choice["logprobs"] = {"content": self.entries}
        out = dict(self.data)
        out["choices"] = [choice]
        return out


class Coalescer:
    """One streamed job's chunks on their way out: ``add`` each chunk as it is made, and take
    ``next_frame`` whenever the connection is free to send one."""

    __slots__ = ("_chars", "_frames", "max_chars", "max_tokens")

    def __init__(self, max_tokens: int = DEFAULT_MAX_TOKENS,
                 max_chars: int = DEFAULT_MAX_CHARS) -> None:
        """``max_tokens`` 1 joins nothing (a queen that does not read ``Chunk.tokens``)."""
        self.max_tokens = max(1, max_tokens)
        self.max_chars = max_chars
        self._frames: deque[_Frame] = deque()
        self._chars = 0  # content characters of the last waiting frame

    def __len__(self) -> int:
        """Frames waiting to go."""
        return len(self._frames)

    def add(self, data: dict[str, Any]) -> None:
        """A chunk the engine made. It joins the last waiting frame when both are only text of
        the same choice, logprobs on both or neither, and the frame stays under the caps; else
        it waits as a frame of its own. The chunk is the coalescer's from now on."""
        if self._frames and self.max_tokens > 1:
            last = self._frames[-1]
            if last.joinable and last.tokens < self.max_tokens:
                more = _joinable(data)
                if (more is not None and more[0] == last.index
                        and (more[2] is None) == (last.entries is None)
                        and self._chars + len(more[1]) <= self.max_chars
                        and last.same_top(data)):
                    last.pieces.append(more[1])
                    if more[2] is not None:
                        assert last.entries is not None
                        if last.tokens == 1:  # the first chunk's list is not ours to grow
                            last.entries = list(last.entries)
                        last.entries.extend(more[2])
                    last.tokens += 1
                    self._chars += len(more[1])
                    return
        frame = _Frame(data)
        self._frames.append(frame)
        self._chars = len(frame.pieces[0])

    def next_frame(self) -> tuple[dict[str, Any], int] | None:
        """The oldest waiting frame, ``(chunk, tokens)``, or None when nothing waits."""
        if not self._frames:
            return None
        frame = self._frames.popleft()
        if not self._frames:
            self._chars = 0
        return frame.build(), frame.tokens

    def drain(self) -> list[tuple[dict[str, Any], int]]:
        """Every waiting frame, oldest first (the job is ending: they go before its result)."""
        out = []
        while (frame := self.next_frame()) is not None:
            out.append(frame)
        return out
