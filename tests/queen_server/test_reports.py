"""The reports' pure parts: a worker's earnings history from its ledger credits, and a worker's
jobs per minute. (The reports themselves are checked through HTTP and the pages.)"""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta

from queen_server.reports import HISTORY_DAYS, RECENT_JOBS, earnings_history, per_minute
from queen_server.stats.swarm import JobRecord
from queen_server.storage.queries import LedgerCredit

TODAY = date(2026, 3, 10)


def at(days_ago: int, hour: int = 12) -> datetime:
    day = TODAY - timedelta(days=days_ago)
    return datetime(day.year, day.month, day.day, hour, tzinfo=UTC)


def test_earnings_per_day_cover_the_window_oldest_first_with_empty_days() -> None:
    credits = [
        LedgerCredit("settle:c", at(0, 23), 5),
        LedgerCredit("settle:b", at(0, 1), 7),
        LedgerCredit("refund:x", at(2), 100),  # a day's money, but no job
        LedgerCredit("settle:a", at(HISTORY_DAYS - 1), 11),
        LedgerCredit("settle:old", at(HISTORY_DAYS), 1000),  # before the window
    ]
    daily, _ = earnings_history(credits, TODAY)
    assert [d.day for d in daily] == [TODAY - timedelta(days=HISTORY_DAYS - 1 - i)
                                      for i in range(HISTORY_DAYS)]
    by_day = {d.day: d.earned_msat for d in daily}
    assert by_day[TODAY] == 12
    assert by_day[TODAY - timedelta(days=2)] == 100
    assert by_day[TODAY - timedelta(days=HISTORY_DAYS - 1)] == 11
    assert sum(by_day.values()) == 123


def test_earnings_per_job_newest_first_summed_over_accounts_and_capped() -> None:
    naive = datetime(2026, 3, 10, 9, 30)  # SQLite's naive UTC
    credits = [
        LedgerCredit("settle:new", naive, 20),
        LedgerCredit("settle:new", naive, 60),  # the same job's other account
        LedgerCredit("deposit:1:x", at(0), 500),
        *(LedgerCredit(f"settle:job{i}", at(1), i) for i in range(RECENT_JOBS + 5)),
    ]
    daily, jobs = earnings_history(credits, TODAY)
    assert len(jobs) == RECENT_JOBS
    assert (jobs[0].job_id, jobs[0].earned_msat) == ("new", 80)
    assert jobs[0].settled_at == naive.replace(tzinfo=UTC)
    assert [j.job_id for j in jobs[1:4]] == ["job0", "job1", "job2"]
    assert daily[-1].earned_msat == 580


def job(at_s: float, tokens: int) -> JobRecord:
    return JobRecord(id=f"job-{at_s}", worker_key="k", worker="w", model="m", prompt_tokens=1,
                     completion_tokens=tokens, seconds=1.0, ttft_s=None, outcome="ok", at=at_s)


def test_per_minute_counts_jobs_and_tokens_oldest_minute_first() -> None:
    jobs = [job(3725.0, 4), job(3600.0, 1), job(60.5, 10), job(3659.9, 2)]
    assert per_minute(jobs) == [{"t": 60, "jobs": 1, "tokens": 10},
                                {"t": 3600, "jobs": 2, "tokens": 3},
                                {"t": 3720, "jobs": 1, "tokens": 4}]
    assert per_minute([]) == []
