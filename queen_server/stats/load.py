"""A worker's speed per stream by how many jobs it runs at once (issue 36): what a new stream
would get there, from the queen's own measurements.

A batched worker runs several streams in one llama.cpp batch, and each gets less than one stream
alone would. So a finished job's seconds per completion token are recorded under the number of
jobs its worker was running when it started (itself included), in buckets: 1, 2, 3-4, 5-8, 9 and
more. A job that ran alone feeds the worker's unloaded record (``ema.Speed``, the one the pages,
the database and the other replicas see); the loaded buckets are kept here, in memory, by the
replica that holds the worker (it is the only one that routes to it).

``speed_at`` is what a new stream would get on a worker running ``jobs - 1`` jobs: the record of
``jobs``'s bucket; else the nearest known bucket below, scaled by ``jobs`` over that bucket's
fewest jobs (as if batching gained nothing more: pessimistic); else the nearest known bucket
above as it is (it was measured under more load: pessimistic too); else None (no record at all).

Pure: no I/O, no clock.
"""

from __future__ import annotations

from queen_server.stats.ema import ALPHA, ema

# The fewest jobs of each bucket: bucket ``i`` holds loads from ``FLOORS[i]`` to the next floor.
FLOORS = (1, 2, 3, 5, 9)


def bucket_of(jobs: int) -> int:
    """The bucket of a load of ``jobs`` jobs at once (0 for one job, or none)."""
    if jobs <= 2:
        return max(0, jobs - 1)
    if jobs <= 4:
        return 2
    return 3 if jobs <= 8 else 4


class LoadSpeeds:
    """One worker's seconds per completion token on one size class, per loaded bucket (EMAs;
    bucket 0, one job alone, is the worker's unloaded ``Speed`` and is not kept here)."""

    __slots__ = ("s_per_token",)

    def __init__(self) -> None:
        self.s_per_token: list[float | None] = [None] * len(FLOORS)

    def __repr__(self) -> str:
        return f"<LoadSpeeds {self.s_per_token[1:]}>"

    def record(self, jobs: int, s_per_token: float, alpha: float = ALPHA) -> None:
        """Fold in one job that started with ``jobs`` jobs running (itself included; > 1)."""
        bucket = bucket_of(jobs)
        if bucket == 0 or not s_per_token > 0:
            return
        self.s_per_token[bucket] = ema(self.s_per_token[bucket], s_per_token, alpha)


def speed_at(jobs: int, unloaded: float | None, loaded: LoadSpeeds | None) -> float | None:
    """Seconds per token a new stream would get as the ``jobs``-th job at once on a worker
    whose unloaded record is ``unloaded`` and loaded records ``loaded`` (see the module doc).
    O(buckets)."""
    bucket = bucket_of(jobs)
    if bucket == 0 and unloaded is not None:
        return unloaded  # the common case: an idle worker
    known = loaded.s_per_token if loaded is not None else None
    for below in range(bucket, -1, -1):
        value = unloaded if below == 0 else known[below] if known is not None else None
        if value is not None:
            return value if below == bucket else value * max(jobs, 1) / FLOORS[below]
    if known is not None:
        for above in range(bucket + 1, len(FLOORS)):
            if (value := known[above]) is not None:
                return value
    return None
