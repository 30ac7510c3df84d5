"""The payout estimate: pure, with the figures a real worker sees (issue 14: a SmolLM2 job earns
about 0.008 sats, so a 1,000-sat threshold is out of reach and the app must say so)."""

from __future__ import annotations

from datetime import date, timedelta

from desktop_worker.gui.services.payout_estimate import (
    daily_rate_msat,
    eta_text,
    payout_outlook,
)
from shared_schema import WorkerEarnings
from shared_schema.openai_types import DailyEarning

TODAY = date(2026, 5, 20)
THRESHOLD = 1_000_000  # 1,000 sats, the queen's default
SMOLLM2_JOB = 8  # msat: about 0.008 sats


def earnings(per_day: dict[int, int], *, available: int = 0, pending: int = 0,
             week: int | None = None) -> WorkerEarnings:
    """Earnings whose daily series has ``per_day[n]`` msat n days ago (30 days, oldest first)."""
    daily = [DailyEarning(day=TODAY - timedelta(days=n), earned_msat=per_day.get(n, 0))
             for n in range(29, -1, -1)]
    return WorkerEarnings(
        worker_id="w", jobs_settled=5, escrow_jobs_left=0, pending_msat=pending,
        available_msat=available, paid_msat=0, today_msat=per_day.get(0, 0),
        total_msat=sum(per_day.values()), daily=daily,
        week_msat=sum(v for n, v in per_day.items() if n < 7) if week is None else week)


def test_a_smollm2_worker_is_told_the_payout_is_more_than_a_year_away():
    # 100 jobs a day, every day this week: 0.8 sats a day, so 1,000 sats take 1,250 days.
    slow = earnings({n: 100 * SMOLLM2_JOB for n in range(7)}, available=2_000)
    outlook = payout_outlook(slow, THRESHOLD, TODAY)
    assert outlook is not None
    assert "1,000 sats" in outlook.threshold
    assert "2 sats" in outlook.threshold  # what is owed now
    assert outlook.eta == "At this rate, the next payout comes in more than a year."
    busy = earnings({n: 500 * SMOLLM2_JOB for n in range(7)})
    assert daily_rate_msat(busy, TODAY) == 4_000
    assert eta_text(0, THRESHOLD, daily_rate_msat(busy, TODAY)).endswith("in about 8 months.")


def test_a_rate_that_reaches_the_threshold_in_days():
    # 300 sats a day for a week, 100 sats owed: 900 more sats is 3 days.
    steady = earnings({n: 300_000 for n in range(7)}, available=60_000, pending=40_000)
    assert payout_outlook(steady, THRESHOLD, TODAY).eta == (
        "At this rate, the next payout comes in about 3 days.")


def test_a_worker_that_began_today_is_not_diluted_by_the_days_before_it():
    started_today = earnings({0: 200_000})
    assert daily_rate_msat(started_today, TODAY) == 200_000
    assert eta_text(0, THRESHOLD, 200_000).endswith("in about 5 days.")


def test_old_earnings_outside_the_week_do_not_count():
    stale = earnings({10: 900_000, 20: 500_000})
    assert daily_rate_msat(stale, TODAY) == 0
    assert payout_outlook(stale, THRESHOLD, TODAY).eta == (
        "No recent earnings, so no estimate of the next payout yet.")


def test_an_older_queen_without_a_daily_series_uses_the_week():
    older = WorkerEarnings(worker_id="w", jobs_settled=3, escrow_jobs_left=0, pending_msat=0,
                           available_msat=0, paid_msat=0, today_msat=0, total_msat=70_000,
                           week_msat=70_000)
    assert daily_rate_msat(older, TODAY) == 10_000


def test_owed_past_the_threshold_is_due_now():
    due = earnings({0: 5}, available=THRESHOLD)
    assert "next payout pass" in payout_outlook(due, THRESHOLD, TODAY).eta


def test_short_spans_read_in_hours():
    assert eta_text(0, 1_000, 1_000_000).endswith("within the hour.")
    assert eta_text(0, 100_000, 200_000).endswith("in about 12 hours.")
    assert eta_text(0, 100_000, 100_000).endswith("in about 24 hours.")
    assert eta_text(0, 100_000, 2_000).endswith("in about 7 weeks.")


def test_no_threshold_no_outlook():
    assert payout_outlook(earnings({0: 1}), None, TODAY) is None
    assert payout_outlook(earnings({0: 1}), 0, TODAY) is None
