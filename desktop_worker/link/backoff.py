"""Reconnection delays: exponential backoff with jitter, reset after a stable session."""

from __future__ import annotations

import random


class Backoff:
    """Delays of about 1 s, 2 s, 4 s ... up to ``cap_s``, each scaled by a random factor in
    [0.5, 1.0] so that workers dropped together do not reconnect together (no storm)."""

    def __init__(
        self,
        base_s: float = 1.0,
        cap_s: float = 60.0,
        stable_s: float = 30.0,
        rng: random.Random | None = None,
    ) -> None:
        self.base_s = base_s
        self.cap_s = cap_s
        self.stable_s = stable_s
        self.rng = rng or random.Random()
        self.failures = 0

    def next_delay(self, session_s: float = 0.0) -> float:
        """The wait before the next attempt, given how long the last session lasted."""
        if session_s >= self.stable_s:
            self.failures = 0
        ceiling = min(self.cap_s, self.base_s * 2**self.failures)
        self.failures = min(self.failures + 1, 32)
        return ceiling * self.rng.uniform(0.5, 1.0)

    def reset(self) -> None:
        self.failures = 0
