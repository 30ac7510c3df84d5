"""When a worker whose payouts keep failing is tried again: exponential backoff, capped.

A payout fails when the worker's LNURL service is down, hostile or wrong, or when the payment
finds no route. Retrying every pass would hammer a broken service (and fill the ``payouts``
table) for nothing, so the next try waits ``base * 2**(n - 1)`` seconds after the latest of
``n`` failures in a row, at most ``max``. A paid (or otherwise settled) payout ends the run.

The history is read from the ``payouts`` rows themselves (state, detail, updated_at): no extra
column. A payout failed by reconciliation because the queen stopped before fetching its invoice
(``INTERRUPTED``) says nothing about the worker's service, so it neither counts nor ends a run.
Pure: the runner loads the rows and asks.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

__all__ = ["INTERRUPTED", "Attempt", "next_attempt_at", "retry_delay_s"]

INTERRUPTED = "interrupted before an invoice was fetched"
_MAX_DOUBLINGS = 60  # 2**60 times any base is past any cap; keeps the float finite


@dataclass(frozen=True, slots=True)
class Attempt:
    """One earlier payout of a worker, as the backoff needs it."""

    state: str
    detail: str
    updated_at: datetime


def retry_delay_s(failures: int, base_s: float, max_s: float) -> float:
    """Seconds to wait after ``failures`` failures in a row (0 after none)."""
    if failures <= 0:
        return 0.0
    return min(max_s, base_s * 2.0 ** min(failures - 1, _MAX_DOUBLINGS))


def next_attempt_at(
    newest_first: Iterable[Attempt], *, base_s: float, max_s: float
) -> datetime | None:
    """When the worker may be paid again, or None when now is fine (no failures in a row).
    ``newest_first``: the worker's payouts, newest first (a few dozen are plenty)."""
    failures = 0
    latest: datetime | None = None
    for attempt in newest_first:
        if attempt.state != "failed":
            break
        if attempt.detail == INTERRUPTED:
            continue
        failures += 1
        latest = latest or _aware(attempt.updated_at)
    if latest is None:
        return None
    return latest + timedelta(seconds=retry_delay_s(failures, base_s, max_s))


def _aware(moment: datetime) -> datetime:
    """SQLite hands back naive datetimes for what was stored in UTC."""
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)
