"""The payout backoff: exponential, capped, ended by a settled payout, blind to interruptions."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from queen_server.payouts.backoff import INTERRUPTED, Attempt, next_attempt_at, retry_delay_s

T0 = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)


@pytest.mark.parametrize(("failures", "delay"),
                         [(0, 0), (1, 600), (2, 1200), (3, 2400), (8, 76_800), (9, 86_400),
                          (10_000, 86_400)])
def test_delay_doubles_up_to_the_cap(failures: int, delay: float) -> None:
    assert retry_delay_s(failures, 600, 86_400) == delay


def failed(minutes: int, detail: str = "bad answer") -> Attempt:
    return Attempt("failed", detail, T0 + timedelta(minutes=minutes))


def test_no_failures_no_wait() -> None:
    assert next_attempt_at([], base_s=600, max_s=86_400) is None
    paid = Attempt("paid", "", T0)
    assert next_attempt_at([paid, failed(-5)], base_s=600, max_s=86_400) is None


def test_failures_in_a_row_count_from_the_latest() -> None:
    history = [failed(30), failed(20), failed(0), Attempt("paid", "", T0), failed(-99)]
    assert next_attempt_at(history, base_s=600, max_s=86_400) == T0 + timedelta(
        minutes=30, seconds=2400)


def test_an_interruption_neither_counts_nor_ends_the_run() -> None:
    history = [failed(40, INTERRUPTED), failed(30), failed(20)]
    assert next_attempt_at(history, base_s=600, max_s=86_400) == T0 + timedelta(
        minutes=30, seconds=1200)
    assert next_attempt_at([failed(40, INTERRUPTED)], base_s=600, max_s=86_400) is None


def test_naive_times_from_sqlite_are_utc() -> None:
    naive = Attempt("failed", "x", datetime(2026, 5, 1, 12, 0))
    assert next_attempt_at([naive], base_s=60, max_s=600) == T0 + timedelta(seconds=60)
