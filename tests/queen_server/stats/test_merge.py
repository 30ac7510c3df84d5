"""Merging the replicas' parts of a report (``stats.merge``): sums, percentiles weighted by
traffic, the hour's series, one row per worker, recent jobs interleaved; a part of the wrong
shape is skipped rather than failing the page."""

from __future__ import annotations

import bisect
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from queen_server.stats import merge


def test_a_small_sketch_is_the_samples_and_a_large_one_keeps_its_ends() -> None:
    assert merge.sketch([0.1, 0.2]) == {"count": 2, "points": [0.1, 0.2]}
    samples = sorted(i / 1000 for i in range(5000))
    found = merge.sketch(samples)
    assert found["count"] == 5000
    assert len(found["points"]) == merge.SKETCH_POINTS
    assert found["points"][0] == samples[0]
    assert found["points"][-1] == samples[-1]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.lists(st.floats(0.001, 60), min_size=1, max_size=3000), min_size=1,
                max_size=4))
def test_merged_percentiles_are_close_to_those_of_all_samples(parts: list[list[float]]) -> None:
    everything = sorted(x for part in parts for x in part)
    p50, p95 = merge.percentiles([merge.sketch(sorted(part)) for part in parts])
    assert p50 is not None
    assert p95 is not None
    # Within a few percent of the true quantile (ties count on either side).
    n = len(everything)
    for value, q in ((p50, 0.5), (p95, 0.95)):
        below = bisect.bisect_left(everything, value) / n
        upto = bisect.bisect_right(everything, value) / n
        assert below - 0.03 - 1 / n <= q <= upto + 0.03 + 1 / n


def test_a_busy_replica_weighs_more_than_a_quiet_one() -> None:
    busy = merge.sketch([1.0] * 1000)  # 1,000 answers at 1 s
    quiet = merge.sketch([9.0] * 10)  # 10 answers at 9 s
    p50, p95 = merge.percentiles([busy, quiet])
    assert p50 == 1.0
    assert p95 == 1.0
    assert merge.percentiles([]) == (None, None)
    assert merge.percentiles([None, {"count": "x"}, {"points": ["a"]}]) == (None, None)


def test_totals_sum_counts_and_models_and_skip_what_is_not_a_number() -> None:
    a = {"workers_online": 3, "workers_with_gpu": 2, "gpus": 2, "vram_total_mb": 16000,
         "tokens_per_s": 10.5, "jobs_per_min": 6.0,
         "models": {"m1": {"workers": 3, "loaded_on": 1}}}
    b = {"workers_online": 2, "gpus": "many", "vram_total_mb": float("nan"),
         "tokens_per_s": 1.5, "models": {"m1": {"workers": 2, "loaded_on": 2},
                                          "m2": {"workers": 1}, "m3": "junk"}}
    merged = merge.totals([a, b, "not a part", None])
    assert merged["workers_online"] == 5
    assert merged["gpus"] == 2
    assert merged["vram_total_mb"] == 16000
    assert merged["tokens_per_s"] == 12.0
    assert merged["jobs_per_min"] == 6.0
    assert merged["models"] == {"m1": {"workers": 5, "loaded_on": 3},
                                "m2": {"workers": 1, "loaded_on": 0}}


def test_series_are_summed_by_time_and_keep_the_newest_points() -> None:
    a = [{"t": 10, "workers": 1, "tokens_per_s": 1.0, "jobs": 1, "errors": 0},
         {"t": 20, "workers": 1, "tokens_per_s": 2.0, "jobs": 2, "errors": 1}]
    b = [{"t": 20, "workers": 2, "tokens_per_s": 3.0, "jobs": 1, "errors": 0},
         {"t": 30, "workers": 2, "tokens_per_s": 0.0, "jobs": 0, "errors": 0}, "junk"]
    merged = merge.series([a, b, None], points=2)
    assert merged == [{"t": 20, "workers": 3, "tokens_per_s": 5.0, "jobs": 3, "errors": 1},
                      {"t": 30, "workers": 2, "tokens_per_s": 0.0, "jobs": 0, "errors": 0}]


def test_a_worker_online_elsewhere_replaces_the_offline_record_kept_here() -> None:
    here = [{"public_id": "w1", "online": False, "last_seen": "2026-11-25T10:00:00+00:00",
             "jobs": 5},
            {"public_id": "w2", "online": False, "last_seen": "2026-11-25T11:00:00+00:00"}]
    there = [{"public_id": "w1", "online": True, "last_seen": "2026-11-25T09:00:00+00:00",
              "jobs": 9}]
    older = [{"public_id": "w2", "online": False, "last_seen": "2026-11-24T11:00:00+00:00"},
             {"no": "public id"}, "junk"]
    rows = merge.worker_rows(here, there, older)
    assert [(row["public_id"], row["online"]) for row in rows] == [("w1", True), ("w2", False)]
    assert rows[0]["jobs"] == 9
    assert rows[1]["last_seen"].startswith("2026-11-25")


def test_recent_jobs_are_interleaved_newest_first_and_capped() -> None:
    rng = random.Random(7)
    times = [f"2026-11-25T10:{m:02d}:{s:02d}+00:00" for m in range(10) for s in range(0, 60, 7)]
    rng.shuffle(times)
    parts = [[{"id": str(i), "at": at} for i, at in enumerate(times[k::3])] for k in range(3)]
    jobs = merge.recent_jobs([*parts, None, [{"id": "no time"}]], limit=20)
    assert len(jobs) == 20
    assert [job["at"] for job in jobs] == sorted(times, reverse=True)[:20]
