"""What the holders of each model say of its file: the sha256 and the size in bytes each one's
hello (or status) gave, counted per model.

The queen prices a model by its own reading of the file on the hub. A name it cannot read (a
file imported on a worker, a made-up name) used to cost the largest class whatever its file
was; these claims let the pricing bound it instead (``queen_server.quoting``): the largest file
any routable holder reports, or the queen's own reading of the same sha256 under a hub name.
A claim is a worker's word, so it is only ever used to *lower* a price from the class for
unverified models, and the largest claim wins, so that no holder can lower another's pay.

The registry keeps it current as workers are indexed and unindexed (only routable holders
count: a flagged, paused or held worker's claim leaves with it). Honest holders of one file
agree, so a model has few distinct claims; past ``MAX_DISTINCT`` of them (many files under one
name, or workers flooding it with made-up sizes) ``of`` gives none, and the model is priced as
unverified, so reading them stays O(1). ``stamp(model)`` changes whenever a model's claims do,
for callers that cache what they derive.
"""

from __future__ import annotations

import itertools
from collections import Counter

# (sha256 or None, size in bytes; 0: not said), as the holder's model descriptor gave them.
FileClaim = tuple[str | None, int]
MAX_DISTINCT = 64  # distinct claims of one model past which none is used


class FileClaims:
    def __init__(self) -> None:
        self._by_model: dict[str, Counter[FileClaim]] = {}
        self._stamps: dict[str, int] = {}
        self._clock = itertools.count(1)

    def add(self, model: str, claim: FileClaim) -> None:
        self._by_model.setdefault(model, Counter())[claim] += 1
        self._stamps[model] = next(self._clock)

    def remove(self, model: str, claim: FileClaim) -> None:
        counts = self._by_model.get(model)
        if counts is None or counts[claim] <= 0:
            return
        counts[claim] -= 1
        if counts[claim] <= 0:
            del counts[claim]
        if counts:
            self._stamps[model] = next(self._clock)
        else:
            del self._by_model[model], self._stamps[model]

    def of(self, model: str) -> list[FileClaim]:
        """The distinct claims of ``model``'s routable holders (empty: none holds it here, or
        more than ``MAX_DISTINCT`` distinct claims, which say nothing one can price by)."""
        counts = self._by_model.get(model)
        return list(counts) if counts and len(counts) <= MAX_DISTINCT else []

    def stamp(self, model: str) -> int:
        """A number that changes whenever ``model``'s claims change (0: it has none)."""
        return self._stamps.get(model, 0)
