"""Which of a batched context's sequence slots a new prompt takes, and how much of it is already
computed there (issue 36). Pure: the batch engine (``engine.batch``) does the llama.cpp part.

Every slot is one llama.cpp sequence id. A slot keeps the tokens it computed after its sequence
ends (a prompt and its answer: the next turn of that chat starts with them), until a new
sequence takes the slot or the cache needs the room. A new prompt reuses the longest prefix
that any slot of the same ``scope`` holds: a free slot's is trimmed to it in place, a busy
slot's (the first choice of ``n``, or another of the caller's streams) is copied into the slot
taken (llama.cpp copies that sequence's cache, and the copy is trimmed: nothing is
recomputed). Scopes are the queen's hash of the
caller: one caller's prompts never shorten another's first token (a timing side channel), and
with no scope a job reuses nothing but its own choices' prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True)
class Slot:
    """One sequence id and the tokens whose cells it holds (positions 0 to ``len - 1``)."""

    seq_id: int
    tokens: list[int] = field(default_factory=list)
    scope: str | None = None
    last_used: float = 0.0
    busy: bool = False


@dataclass(frozen=True, slots=True)
class Reuse:
    """The slot a prompt takes, the slot whose cells it starts from (the same one, or another
    to copy from), and how many of the prompt's leading tokens those cells hold."""

    target: Slot
    source: Slot | None
    common: int


def common_prefix(cached: Sequence[int], tokens: Sequence[int]) -> int:
    """How many leading tokens two sequences share."""
    limit = min(len(cached), len(tokens))
    if limit == 0:
        return 0
    same = np.asarray(cached[:limit], dtype=np.int64) == np.asarray(tokens[:limit],
                                                                      dtype=np.int64)
    return limit if bool(same.all()) else int(np.argmin(same))


def plan_reuse(slots: Sequence[Slot], tokens: Sequence[int], scope: str | None) -> Reuse | None:
    """The slot ``tokens`` take (None: every slot is busy) and what it reuses. At least the
    last token is always computed again: its logits are the first step's."""
    best: Slot | None = None
    common = 0
    if scope is not None:
        limit = len(tokens) - 1
        for slot in slots:
            if slot.scope != scope or not slot.tokens:
                continue
            shared = min(common_prefix(slot.tokens, tokens), limit)
            # Between equals, a free slot (nothing to copy), then the most recent.
            if shared > common or (shared == common and shared > 0 and best is not None
                                   and (best.busy, -best.last_used)
                                   > (slot.busy, -slot.last_used)):
                best, common = slot, shared
    if best is not None and not best.busy:
        return Reuse(best, best, common)
    free = [slot for slot in slots if not slot.busy]
    if not free:
        return None
    # A slot with nothing cached first, the lowest id (llama.cpp decodes the running
    # sequences in one piece while their ids run consecutively), then the least recently used.
    target = min(free, key=lambda slot: (bool(slot.tokens),
                                         slot.last_used if slot.tokens else slot.seq_id))
    if best is None or common == 0:
        return Reuse(target, None, 0)
    return Reuse(target, best, common)


def evictable(slots: Sequence[Slot]) -> Slot | None:
    """The free slot whose cached cells go first when the cache is full: least recently used."""
    cached = [slot for slot in slots if not slot.busy and slot.tokens]
    return min(cached, key=lambda slot: slot.last_used) if cached else None
