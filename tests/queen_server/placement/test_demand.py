"""The demand book with an injected clock: one-minute buckets over a window, unmet and queued
requests, mean waits, forgetting, a bound on the models it keeps, busiest first."""

from __future__ import annotations

import pytest

from queen_server.placement.demand import DemandBook, DemandRow


class Clock:
    def __init__(self, now: float = 6000.0) -> None:  # the start of a minute
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def book(clock: Clock) -> DemandBook:
    return DemandBook(window_s=300, clock=clock)


def row(book: DemandBook, name: str) -> DemandRow:
    rows = {r.name: r for r in book.rows()}
    return rows[name]


def test_requests_per_minute_are_averaged_over_the_window(book: DemandBook, clock: Clock):
    for _ in range(10):
        book.asked("m", met=True)
    clock.now += 60
    for _ in range(5):
        book.asked("m", met=False)
    got = row(book, "m")
    assert got.requests_per_min == pytest.approx(15 / 5)
    assert got.unmet_per_min == pytest.approx(5 / 5)
    assert got.queued == 0
    assert got.mean_wait_s == 0.0  # nobody said how long they waited


def test_requests_in_one_minute_share_a_bucket(book: DemandBook, clock: Clock):
    book.asked("m", met=True)
    clock.now += 59.9
    book.asked("m", met=True)
    assert len(book._models["m"].buckets) == 1
    clock.now += 0.1  # the next minute
    book.asked("m", met=True)
    assert len(book._models["m"].buckets) == 2


def test_old_minutes_leave_the_window(book: DemandBook, clock: Clock):
    book.asked("m", met=False)  # minute 0
    clock.now += 240
    book.asked("m", met=True)  # minute 4: both in the 5-minute window
    assert row(book, "m").requests_per_min == pytest.approx(2 / 5)
    assert row(book, "m").unmet_per_min == pytest.approx(1 / 5)
    clock.now += 60  # minute 5: minute 0 is out
    assert row(book, "m").requests_per_min == pytest.approx(1 / 5)
    assert row(book, "m").unmet_per_min == 0.0


def test_a_model_not_asked_for_in_the_window_is_forgotten(book: DemandBook, clock: Clock):
    book.asked("m", met=True)
    book.waited("m", 3.0)
    clock.now += 299
    assert [r.name for r in book.rows()] == ["m"]
    clock.now += 1
    assert book.rows() == []
    assert "m" not in book._models  # dropped, not just hidden


def test_a_queued_request_keeps_its_model_in_the_book(book: DemandBook, clock: Clock):
    book.queue("m", 1)
    clock.now += 3600
    got = row(book, "m")
    assert (got.queued, got.requests_per_min) == (1, 0.0)
    book.queue("m", -1)
    assert book.rows() == []


def test_queue_counts_never_go_negative(book: DemandBook):
    book.queue("m", -1)
    book.queue("m", -5)
    book.asked("m", met=True)
    assert row(book, "m").queued == 0
    book.queue("m", 1)
    book.queue("m", 1)
    book.queue("m", -1)
    assert row(book, "m").queued == 1
    book.queue("m", -3)
    assert row(book, "m").queued == 0
    book.queue("m", 1)
    assert row(book, "m").queued == 1  # a stray -1 earlier did not leave a debt


def test_mean_wait(book: DemandBook, clock: Clock):
    book.waited("m", 2.0)
    book.waited("m", 4.0)
    clock.now += 60
    book.waited("m", 9.0)
    book.waited("m", -5.0)  # a clock that stepped back counts as no wait
    assert row(book, "m").mean_wait_s == pytest.approx(15.0 / 4)
    clock.now += 240  # the first minute leaves the window
    assert row(book, "m").mean_wait_s == pytest.approx(9.0 / 2)


def test_busiest_first_and_queued_requests_count(book: DemandBook):
    for name, count in (("quiet", 1), ("busy", 15), ("middling", 4)):
        for _ in range(count):
            book.asked(name, met=True)
    book.queue("waiting", 1)
    book.queue("waiting", 1)  # 2 waiting outrank 4 requests in 5 minutes (0.8 a minute)
    assert [r.name for r in book.rows()] == ["busy", "waiting", "middling", "quiet"]


def test_ties_are_ordered_by_name(book: DemandBook):
    for name in ("b", "a", "c"):
        book.asked(name, met=True)
    assert [r.name for r in book.rows()] == ["a", "b", "c"]


def test_a_flood_of_names_stays_bounded(clock: Clock):
    book = DemandBook(window_s=300, max_models=100, clock=clock)
    book.asked("real/model:Q4", met=True)
    for i in range(20_000):
        book.asked(f"made-up/{i}:Q4", met=False)
        book.queue(f"made-up/{i}:Q4", 1)
        assert len(book._models) <= 100
    rows = book.rows()
    assert len(rows) == 100
    assert "real/model:Q4" not in {r.name for r in rows}  # the least recently asked went
    # Each model's buckets are bounded by the window too.
    for _ in range(50):
        clock.now += 60
        book.asked("made-up/19999:Q4", met=True)
    assert len(book._models["made-up/19999:Q4"].buckets) == 5


def test_asking_again_keeps_a_model_from_being_dropped(clock: Clock):
    book = DemandBook(window_s=300, max_models=3, clock=clock)
    for name in ("a", "b", "c"):
        book.asked(name, met=True)
    book.asked("a", met=True)  # a is now the most recent
    book.asked("d", met=True)  # b, the least recent, goes
    assert {r.name for r in book.rows()} == {"a", "c", "d"}


def test_a_short_window_is_one_minute(clock: Clock):
    book = DemandBook(window_s=10, clock=clock)
    assert book.minutes == 1
    book.asked("m", met=True)
    book.asked("m", met=True)
    assert row(book, "m").requests_per_min == 2.0
    clock.now += 60
    assert book.rows() == []
