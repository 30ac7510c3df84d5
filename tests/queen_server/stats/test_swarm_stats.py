"""The EMA and the aggregates, with a clock the tests move by hand."""

import pytest

from queen_server.stats.ema import Speed, ema
from queen_server.stats.swarm import BUCKET_S, SwarmStats


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_ema_starts_at_the_first_sample_and_moves_by_alpha():
    assert ema(None, 4.0) == 4.0
    assert ema(4.0, 2.0, alpha=0.5) == 3.0


def test_a_streamed_job_teaches_prompt_and_completion_speeds_apart():
    speed = Speed()
    speed.record(prompt_tokens=100, completion_tokens=50, total_s=3.0, ttft_s=0.5)
    assert speed.prompt_s_per_token == pytest.approx(0.005)
    assert speed.completion_s_per_token == pytest.approx(0.05)
    assert speed.samples == 1


def test_a_plain_job_takes_the_prompt_share_out_of_its_total():
    speed = Speed(prompt_s_per_token=0.01)
    speed.record(prompt_tokens=100, completion_tokens=10, total_s=2.0, ttft_s=None)
    assert speed.completion_s_per_token == pytest.approx((2.0 - 1.0) / 10)
    assert speed.prompt_s_per_token == 0.01


@pytest.mark.parametrize(("prompt", "completion", "total", "ttft"),
                         [(10, 0, 1.0, 0.5), (10, 5, -1.0, None), (10, 5, 1.0, 2.0)])
def test_nonsense_samples_teach_nothing(prompt, completion, total, ttft):
    speed = Speed()
    speed.record(prompt, completion, total, ttft)
    assert speed.completion_s_per_token is None
    assert speed.samples == 0


def test_windows_count_the_last_minute_only():
    clock = Clock()
    stats = SwarmStats(clock)
    for _ in range(3):
        stats.job_done("j", "k", "w", "m", "tiny", 10, 20, 1.0, 0.1)
    assert stats.tokens_per_s() == pytest.approx(60 / 60)
    assert stats.jobs_per_min() == 3
    clock.now += 61
    assert stats.tokens_per_s() == 0
    assert stats.jobs_per_min() == 0


def test_ttft_percentiles_over_five_minutes():
    clock = Clock()
    stats = SwarmStats(clock)
    assert stats.ttft_percentiles() == (None, None)
    for ttft in range(1, 101):
        stats.job_done("j", "k", "w", "m", "tiny", 1, 1, ttft / 10 + 1, ttft / 10)
    p50, p95 = stats.ttft_percentiles()
    assert p50 == pytest.approx(5.05)
    assert 9.4 < p95 < 9.6
    clock.now += 301
    assert stats.ttft_percentiles() == (None, None)


def test_counters_failure_rate_and_speeds_for_routing():
    stats = SwarmStats(Clock())
    stats.job_done("a", "k1", "w1", "m", "tiny", 10, 10, 1.0, 0.5)
    stats.job_failed("b", "k1", "w1", "m", "worker_lost")
    stats.job_failed("c", "k1", "w1", "m", "timeout")
    worker = stats.workers["k1"]
    assert (worker.jobs, worker.failures, worker.timeouts) == (1, 1, 1)
    assert worker.failure_rate == pytest.approx(2 / 3)
    assert stats.speeds_for("tiny") == {"k1": pytest.approx(0.05)}
    assert stats.speeds_for("xl") == {}
    assert [job.outcome for job in stats.recent] == ["timeout", "worker_lost", "ok"]


def test_online_uptime_and_a_replaced_session():
    clock = Clock()
    stats = SwarmStats(clock)
    stats.connected("k", "w", "1.0")
    clock.now += 10
    stats.connected("k", "w", "1.1")  # the same key again: still one worker online
    assert stats.online == 1
    clock.now += 5
    assert stats.workers["k"].uptime_s(clock.now) == pytest.approx(15)
    stats.disconnected("k")
    stats.disconnected("k")
    assert stats.online == 0
    assert stats.workers["k"].uptime_s(clock.now + 100) == pytest.approx(15)
    assert stats.workers["k"].version == "1.1"


def test_series_has_an_hour_of_ten_second_points():
    clock = Clock(3600.0 * 1000)
    stats = SwarmStats(clock)
    stats.connected("k", "w", "1")
    stats.job_done("j", "k", "w", "m", "tiny", 5, 30, 1.0, 0.1)
    stats.job_failed("x", "k", "w", "m", "engine_failed")
    clock.now += 2 * BUCKET_S
    series = stats.series()
    assert len(series) == 360
    assert series[-1]["t"] == clock.now // BUCKET_S * BUCKET_S
    busy = series[-3]
    assert (busy["jobs"], busy["errors"], busy["tokens_per_s"]) == (1, 1, 30 / BUCKET_S)
    assert [point["workers"] for point in series[-3:]] == [1, 1, 1]
    assert series[0]["workers"] == 0
