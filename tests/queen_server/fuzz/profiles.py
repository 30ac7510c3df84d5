"""Hypothesis settings for the fuzz tests: bounded in CI, bigger on request.

The ``ci`` profile (the default) is derandomized: the same examples on every run, so a red CI
run is the code's fault, not the draw's. ``APIARY_FUZZ_PROFILE=large`` runs 10x the examples,
drawn at random each run; ``APIARY_FUZZ_EXAMPLES=N`` sets the count outright (random draws too).
No example database is written (the working tree stays clean); a failure prints the example
and a blob to replay it with ``@reproduce_failure``.
"""

from __future__ import annotations

import os
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from hypothesis import HealthCheck, settings

PROFILES = {"ci": 1, "large": 10}


def fuzz_settings(ci_examples: int) -> settings:
    profile = os.environ.get("APIARY_FUZZ_PROFILE", "ci")
    count = os.environ.get("APIARY_FUZZ_EXAMPLES")
    examples = int(count) if count else ci_examples * PROFILES[profile]
    return settings(
        max_examples=examples,
        derandomize=profile == "ci" and not count,
        deadline=None,
        database=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                               HealthCheck.large_base_example],
    )


def fuzz_timeout_s() -> int:
    """pytest-timeout's limit for one fuzz test: the usual 60 s in CI, more for bigger runs."""
    bigger = os.environ.get("APIARY_FUZZ_EXAMPLES") or os.environ.get("APIARY_FUZZ_PROFILE")
    return 3600 if bigger not in (None, "", "ci") else 60


def run_in_loop(loop: Any, coroutine: Any, timeout_s: float) -> None:
    """Run one example's coroutine on the test's event loop from Hypothesis's thread."""
    import asyncio

    future = asyncio.run_coroutine_threadsafe(coroutine, loop)
    try:
        future.result(timeout_s)
    except FutureTimeout:
        future.cancel()
        raise AssertionError(f"the example did not end in {timeout_s} s") from None
