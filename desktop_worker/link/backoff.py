"""Reconnection delays: exponential backoff with jitter, reset after a stable session; and the
rotation through a worker's queen URLs (replicas of one queen), which decides both which URL the
link dials next and how long it waits first. Pure: no sockets, no clock (durations come in)."""

from __future__ import annotations

import random
from collections.abc import Sequence


class Backoff:
    """Delays of about 1 s, 2 s, 4 s ... up to ``cap_s``, each scaled by a random factor in
    [0.5, 1.0] so that workers dropped together do not reconnect together (no storm).

    After a session that had been welcomed ends (``after_drop``) the first retry comes within
    ``first_s`` (a random point in it: a replica's workers spread over that second instead of
    arriving at once), so a worker whose queen replica died is back within seconds; the wait
    doubles only while sessions keep ending within ``stable_s`` of starting (a queen that
    welcomes and drops at once is not hammered)."""

    def __init__(
        self,
        base_s: float = 1.0,
        cap_s: float = 60.0,
        stable_s: float = 30.0,
        rng: random.Random | None = None,
        first_s: float = 1.0,
    ) -> None:
        self.base_s = base_s
        self.cap_s = cap_s
        self.stable_s = stable_s
        self.first_s = first_s
        self.rng = rng or random.Random()
        self.failures = 0
        self.short_sessions = 0  # welcomed sessions in a row that ended within stable_s

    def next_delay(self, session_s: float = 0.0) -> float:
        """The wait before the next attempt, given how long the last session lasted."""
        if session_s >= self.stable_s:
            self.failures = 0
        ceiling = min(self.cap_s, self.base_s * 2**self.failures)
        self.failures = min(self.failures + 1, 32)
        return ceiling * self.rng.uniform(0.5, 1.0)

    def after_drop(self, session_s: float) -> float:
        """The wait after a welcomed session of ``session_s`` seconds ended: within
        ``first_s``, doubling (to ``cap_s``) per short session in a row."""
        self.failures = 0  # the queen was reachable: a later failure starts from base_s
        self.short_sessions = 0 if session_s >= self.stable_s else min(
            self.short_sessions + 1, 32)
        ceiling = min(self.cap_s, self.first_s * 2 ** max(0, self.short_sessions - 1))
        return ceiling * self.rng.uniform(0.0, 1.0)

    def reset(self) -> None:
        self.failures = 0
        self.short_sessions = 0


class QueenRotation:
    """Which of a worker's queen URLs to dial, and the wait before each attempt.

    Every attempt that ends (a failed connect, a refusal, a dropped session) moves on to the
    next URL, so a dead replica is skipped. Failed attempts hop to the next URL at once (within
    ``hop_s``) until each URL has failed once in a row; only then does ``Backoff`` slow down.
    A session that had been welcomed goes to ``Backoff.after_drop`` (a retry within a second).
    With one URL (or one load-balanced name) this is the plain backoff, on that URL."""

    def __init__(
        self,
        urls: Sequence[str],
        backoff: Backoff,
        hop_s: float = 0.25,
        rng: random.Random | None = None,
    ) -> None:
        if not urls:
            raise ValueError("no queen URL to dial")
        self.urls = list(urls)
        self.backoff = backoff
        self.hop_s = hop_s
        self.rng = rng or random.Random()
        self.index = 0
        self.failed_in_a_row = 0

    @property
    def current(self) -> str:
        return self.urls[self.index]

    def after_attempt(self, *, welcomed: bool, session_s: float) -> float:
        """Move to the next URL and say how long to wait before dialling it."""
        self.index = (self.index + 1) % len(self.urls)
        if welcomed:
            self.failed_in_a_row = 0
            return self.backoff.after_drop(session_s)
        self.failed_in_a_row += 1
        if self.failed_in_a_row < len(self.urls):
            return self.hop_s * self.rng.uniform(0.0, 1.0)
        self.failed_in_a_row = 0
        return self.backoff.next_delay(session_s)
