"""The progress meter: when it reports, and the speed and ETA it computes."""

from __future__ import annotations

import pytest

from desktop_worker.errors import DownloadCancelled
from desktop_worker.store.progress import ProgressMeter, PullProgress
from shared_schema.hardware import DownloadProgress


class ManualClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_meter(
    reports: list[PullProgress], clock: ManualClock, total: int | None = 1000
) -> ProgressMeter:
    return ProgressMeter(
        "u/r:Q4", total, reports.append, min_interval_s=1.0, min_step_bytes=100, clock=clock
    )


def test_reports_at_start_then_by_step_then_at_the_end() -> None:
    reports: list[PullProgress] = []
    clock = ManualClock()
    meter = make_meter(reports, clock)

    meter.update(0)
    meter.update(50)  # too small a step, too soon
    meter.update(120)
    meter.update(150)
    clock.now += 1.5
    meter.update(160)  # a small step, but a second and a half later
    meter.finish()

    assert [r.downloaded_bytes for r in reports] == [0, 120, 160, 1000]
    assert [r.done for r in reports] == [False, False, False, True]
    assert all(r.total_bytes == 1000 and r.name == "u/r:Q4" for r in reports)


def test_speed_and_eta_count_only_this_download() -> None:
    reports: list[PullProgress] = []
    clock = ManualClock()
    meter = make_meter(reports, clock)

    meter.update(400)  # 400 bytes were already on disk (a resumed download)
    clock.now += 2.0
    meter.update(600)

    last = reports[-1]
    assert last.bytes_per_s == pytest.approx(100.0)  # 200 bytes in 2 s
    assert last.eta_s == pytest.approx(4.0)  # 400 bytes left at 100 B/s
    assert reports[0].bytes_per_s is None
    assert reports[0].eta_s is None


def test_finish_reports_total_and_zero_eta() -> None:
    reports: list[PullProgress] = []
    clock = ManualClock()
    meter = make_meter(reports, clock)
    meter.update(0)
    clock.now += 1.0
    meter.update(900)
    meter.finish()
    assert reports[-1].downloaded_bytes == 1000
    assert reports[-1].eta_s == 0.0
    assert reports[-1].done


def test_unknown_total_has_no_eta() -> None:
    reports: list[PullProgress] = []
    clock = ManualClock()
    meter = make_meter(reports, clock, total=None)
    meter.update(0)
    clock.now += 1.0
    meter.update(500)
    assert reports[-1].eta_s is None
    assert reports[-1].bytes_per_s == pytest.approx(500.0)


def test_a_failing_callback_does_not_break_the_download() -> None:
    def broken(_report: PullProgress) -> None:
        raise RuntimeError("display gone")

    meter = ProgressMeter("m", 10, broken)
    meter.update(5)
    meter.finish()
    assert meter.downloaded_bytes == 10


def test_a_callback_may_cancel() -> None:
    def cancel(_report: PullProgress) -> None:
        raise DownloadCancelled("stop")

    meter = ProgressMeter("m", 10, cancel)
    with pytest.raises(DownloadCancelled):
        meter.update(5)


def test_to_wire() -> None:
    report = PullProgress("u/r:Q4", 10, 100, 5.0, 18.0)
    assert report.to_wire() == DownloadProgress(
        name="u/r:Q4", downloaded_bytes=10, total_bytes=100, bytes_per_s=5.0
    )
