"""The "In demand" rows, widget-free: what fits this machine, the earnings estimate and its
units, the plain-words line, and hostile or odd demand."""

from __future__ import annotations

from pathlib import Path

import pytest

from desktop_worker.gui.services.demand import (
    NO_ESTIMATE,
    SpeedMeter,
    demand_line,
    demand_rows,
    estimate_text,
    sats_per_hour,
    wizard_models,
)
from desktop_worker.hardware import NullGpuDetector, SystemInfo, detect_hardware
from shared_schema import Demand
from tests.support.hardware_fixtures import FixedSystemProbe, fixture_path, recorded_machine
from tests.support.on_demand import model_demand

MB = 1 << 20
GB = 1 << 30


md = model_demand


@pytest.fixture
def rtx3060(tmp_path: Path):  # 11,264 MB of VRAM usable
    return recorded_machine(fixture_path("gaming_rtx3060"), tmp_path)


def cpu_only(tmp_path: Path, ram_mb: int = 16_000, threads: int = 8):
    info = SystemInfo(cpu_count=threads, total_ram_mb=ram_mb, available_ram_mb=ram_mb,
                      disk_free_gb=100)
    return detect_hardware(tmp_path, nvidia=NullGpuDetector(), opencl=NullGpuDetector(),
                           system=FixedSystemProbe(info))


def test_units_one_sat_per_1k_tokens_at_100_tokens_per_second_is_360_sats_an_hour():
    # 1,000 msat per 1,000 tokens = 1 msat per token; 100 tokens/s * 3,600 s = 360,000 msat.
    assert sats_per_hour(1000, 100.0) == pytest.approx(360.0)
    assert sats_per_hour(0, 100.0) == 0


def test_the_speed_is_measured_as_bandwidth_and_scaled_to_the_model_size():
    meter = SpeedMeter()
    assert meter.tokens_per_s(GB) is None  # nothing measured yet
    assert meter.record(completion_tokens=400, seconds=10.0, size_bytes=GB)  # 40 tok/s on 1 GB
    assert meter.tokens_per_s(GB) == pytest.approx(40.0)
    assert meter.tokens_per_s(4 * GB) == pytest.approx(10.0)  # 4x the bytes: a quarter
    assert meter.tokens_per_s(GB // 2) == pytest.approx(80.0)


@pytest.mark.parametrize(("tokens", "seconds", "size", "outcome"), [
    (400, 10.0, GB, "error"),  # failed
    (3, 0.1, GB, "ok"),  # too short to say anything
    (400, 0.0, GB, "ok"),  # no time
    (400, float("nan"), GB, "ok"),
    (400, float("inf"), GB, "ok"),
    (400, 10.0, None, "ok"),  # a model of unknown size
    (400, 10.0, 0, "ok"),
])
def test_jobs_that_say_nothing_about_speed_are_not_measured(tokens, seconds, size, outcome):
    meter = SpeedMeter()
    assert not meter.record(tokens, seconds, size, outcome)
    assert not meter.measured


def test_rows_fit_the_gpu_are_not_held_and_are_sorted_by_expected_earnings(rtx3060):
    demand = Demand(models=[
        md("cheap/a:Q4", earn_msat_per_1k_tokens=100),
        md("rich/b:Q4", earn_msat_per_1k_tokens=2000),
        md("huge/c:Q8", memory_mb=40_000, earn_msat_per_1k_tokens=50_000),  # not in 11 GB
        md("mine/d:Q4", earn_msat_per_1k_tokens=9000),  # held already
        md("quiet/e:Q4", requests_per_min=0, queued=0),  # nobody asks
        md("big/f:Q4", size_bytes=8 * GB, memory_mb=9000, earn_msat_per_1k_tokens=2000),
    ])
    rows = demand_rows(demand, rtx3060, held={"mine/d:Q4"})
    assert [r.name for r in rows] == ["rich/b:Q4", "big/f:Q4", "cheap/a:Q4"]


def test_the_disk_room_and_the_owner_vram_cap_leave_models_out(rtx3060):
    demand = Demand(models=[md("a/small:Q4", size_bytes=GB, memory_mb=1500),
                            md("a/big:Q4", size_bytes=5 * GB, memory_mb=6000)])
    assert [r.name for r in demand_rows(demand, rtx3060, room_bytes=2 * GB)] == ["a/small:Q4"]
    assert [r.name for r in demand_rows(demand, rtx3060, cap_mb=4000)] == ["a/small:Q4"]


def test_a_cpu_only_machine_is_offered_small_models_only(tmp_path):
    demand = Demand(models=[md("tiny/a:Q8", size_bytes=150 * MB, memory_mb=700),
                            md("mid/b:Q4", size_bytes=4 * GB, memory_mb=5500)])
    rows = demand_rows(demand, cpu_only(tmp_path, threads=8))  # 3,072 MB for 8 threads
    assert [r.name for r in rows] == ["tiny/a:Q8"]


def test_a_null_memory_figure_falls_back_to_the_file_size_and_unknown_both_is_left_out(rtx3060):
    demand = Demand(models=[md("no/mem:Q4", memory_mb=None, size_bytes=GB),
                            md("too/big:Q4", memory_mb=None, size_bytes=20 * GB),
                            md("no/facts:Q4", memory_mb=None, size_bytes=None)])
    rows = demand_rows(demand, rtx3060)
    assert [r.name for r in rows] == ["no/mem:Q4"]
    assert rows[0].need_mb == 1740  # advice.need_mb(1 GiB): int(1,024 * 1.2) + 512


def test_fifty_huge_models_give_an_empty_list(rtx3060):
    demand = Demand(models=[md(f"huge/m{i}:F16", size_bytes=400 * GB, memory_mb=900_000)
                            for i in range(50)])
    assert demand_rows(demand, rtx3060) == []


def test_no_demand_or_no_hardware_yet_gives_no_rows(rtx3060):
    assert demand_rows(None, rtx3060) == []
    assert demand_rows(Demand(models=[md("a/b:Q4")]), None) == []
    assert demand_rows(Demand(), rtx3060) == []


def test_a_copy_of_another_file_is_offered_to_replace(rtx3060):
    demand = Demand(models=[md("a/b:Q4", sha256="a" * 64)])
    assert demand_rows(demand, rtx3060, held={"a/b:Q4": "a" * 64}) == []
    [row] = demand_rows(demand, rtx3060, held={"a/b:Q4": "b" * 64})
    assert row.replaces
    assert "Add replaces" in row.line


def test_the_estimate_with_a_measured_speed(rtx3060):
    meter = SpeedMeter()
    meter.record(500, 10.0, GB)  # 50 tokens/s on a 1 GB file
    demand = Demand(models=[md("a/one:Q4", size_bytes=GB, earn_msat_per_1k_tokens=2000),
                            md("a/two:Q4", size_bytes=2 * GB, earn_msat_per_1k_tokens=2000)])
    one, two = demand_rows(demand, rtx3060, speed=meter)
    assert one.tokens_per_s == pytest.approx(50.0)
    assert one.sats_per_hour == pytest.approx(360.0)  # 2 msat/token * 50/s * 3600 / 1000
    assert one.estimate == "up to 360 sats/h"
    assert two.sats_per_hour == pytest.approx(180.0)
    assert "2 sats per 1,000 tokens" in one.estimate_tip
    assert "measured" in one.estimate_tip


def test_the_estimate_before_any_measurement_says_so_and_shows_the_price():
    text, tip, rate = estimate_text(md("a/b:Q4", earn_msat_per_1k_tokens=1500), None)
    assert text == f"{NO_ESTIMATE} (1.5 sats per 1,000 tokens)"
    assert "serve a few first" in tip
    assert rate is None


def test_a_queen_that_does_not_pay_says_not_paid():
    text, _tip, rate = estimate_text(md("a/b:Q4", earn_msat_per_1k_tokens=0), 50.0)
    assert text == "not paid"
    assert rate is None


def test_small_rates_keep_a_decimal():
    text, _tip, rate = estimate_text(md("a/b:Q4", earn_msat_per_1k_tokens=10), 20.0)
    assert rate == pytest.approx(0.72)
    assert text == "up to 0.7 sats/h"


@pytest.mark.parametrize(("kw", "expected"), [
    (dict(requests_per_min=12, queued=3, holders=0, loading=0),
     "12 requests/min, 3 waiting, nobody serves it yet"),
    (dict(requests_per_min=0.4, queued=0, unmet_per_min=0.2, holders=1, loading=0),
     "0.4 requests/min, 0.2/min found nobody free, 1 worker serves it"),
    (dict(requests_per_min=30, queued=0, unmet_per_min=0, holders=4, loading=1),
     "30 requests/min, 4 workers serve it, 1 downloading it"),
    (dict(requests_per_min=2, queued=0, unmet_per_min=0, holders=0, loading=2),
     "2 requests/min, 2 downloading it"),
])
def test_the_plain_words_line(kw, expected):
    assert demand_line(md("a/b:Q4", **kw)) == expected


def test_the_wizard_gets_the_best_rows_with_the_pin(rtx3060):
    demand = Demand(models=[md(f"a/m{i}:Q4", earn_msat_per_1k_tokens=100 * (i + 1),
                               sha256=f"{i:064x}", revision=f"{i:040x}") for i in range(5)])
    models = wizard_models(demand_rows(demand, rtx3060))
    assert [m.name for m in models] == ["a/m4:Q4", "a/m3:Q4", "a/m2:Q4"]
    assert models[0].sha256 == f"{4:064x}"
    assert models[0].revision == f"{4:040x}"
    assert "in demand" in models[0].label
