"""Speeds under load (issue 36): the buckets, what a new stream would get, and the swarm stats
recording each job under the load it started with."""

import pytest

from queen_server.stats.load import FLOORS, LoadSpeeds, bucket_of, speed_at
from queen_server.stats.swarm import SwarmStats


def test_the_buckets_are_1_2_3_to_4_5_to_8_and_9_up():
    assert [bucket_of(jobs) for jobs in range(0, 12)] == [0, 0, 1, 2, 2, 3, 3, 3, 3, 4, 4, 4]
    assert [bucket_of(floor) for floor in FLOORS] == [0, 1, 2, 3, 4]
    assert bucket_of(10_000) == 4


def test_a_known_bucket_is_read_as_it_is():
    loaded = LoadSpeeds()
    loaded.record(4, 0.03)
    assert speed_at(1, 0.01, loaded) == 0.01
    assert speed_at(3, 0.01, loaded) == 0.03
    assert speed_at(4, 0.01, loaded) == 0.03


def test_an_unknown_bucket_scales_the_nearest_known_one_below():
    loaded = LoadSpeeds()
    loaded.record(2, 0.015)
    # 6 jobs: bucket 5-8 unknown, 3-4 unknown, 2 known at 0.015: 0.015 * 6 / 2.
    assert speed_at(6, 0.01, loaded) == pytest.approx(0.045)
    # Nothing loaded known: the unloaded record, shared among the streams.
    assert speed_at(4, 0.01, None) == pytest.approx(0.04)
    assert speed_at(2, 0.01, LoadSpeeds()) == pytest.approx(0.02)


def test_with_nothing_below_the_nearest_bucket_above_is_taken_as_it_is():
    loaded = LoadSpeeds()
    loaded.record(8, 0.05)
    assert speed_at(1, None, loaded) == 0.05
    assert speed_at(3, None, loaded) == 0.05
    assert speed_at(3, None, None) is None
    assert speed_at(1, None, LoadSpeeds()) is None


def test_a_loaded_record_is_an_ema_and_nonsense_teaches_nothing():
    loaded = LoadSpeeds()
    loaded.record(3, 0.04)
    loaded.record(4, 0.02, alpha=0.5)
    assert loaded.s_per_token[2] == pytest.approx(0.03)
    loaded.record(1, 0.5)  # one job alone is the unloaded record's, not kept here
    loaded.record(6, 0.0)
    loaded.record(6, -1.0)
    assert loaded.s_per_token == [None, None, pytest.approx(0.03), None, None]


def test_the_stats_keep_the_unloaded_record_apart_from_the_loaded_ones():
    stats = SwarmStats(clock=lambda: 1000.0)
    # Alone: 10 tokens in 0.1 s after a 0.1 s first token: 0.01 s/token.
    stats.job_done("j1", "w", "w", "m", "tiny", 5, 10, 0.2, 0.1)
    # With 4 jobs at once: 0.04 s/token per stream.
    stats.job_done("j2", "w", "w", "m", "tiny", 5, 10, 0.5, 0.1, jobs=4)
    # The shared, persisted record (pages, placement, other replicas) stays the unloaded one.
    assert stats.speeds_for("tiny") == {"w": pytest.approx(0.01)}
    assert stats.workers["w"].speeds["tiny"].samples == 1
    assert stats.workers["w"].jobs == 2
    # What routing reads: per load.
    assert stats.speed_at("tiny", "w", 1) == pytest.approx(0.01)
    assert stats.speed_at("tiny", "w", 3) == pytest.approx(0.04)
    assert stats.speed_at("tiny", "w", 2) == pytest.approx(0.02)  # scaled from alone
    assert stats.speed_at("tiny", "w", 8) == pytest.approx(0.04 * 8 / 3)
    assert stats.speed_at("tiny", "nobody", 1) is None
    assert stats.speed_at("other-class", "w", 1) is None


def test_a_worker_only_ever_loaded_has_no_unloaded_record_but_a_speed():
    stats = SwarmStats(clock=lambda: 1000.0)
    stats.job_done("j1", "w", "w", "m", "tiny", 5, 10, 0.5, 0.1, jobs=2)
    assert stats.speeds_for("tiny") == {}
    assert stats.speed_at("tiny", "w", 1) == pytest.approx(0.04)
    assert stats.speed_at("tiny", "w", 2) == pytest.approx(0.04)
