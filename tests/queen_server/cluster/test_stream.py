"""The receiving end's ordering and checks (pure; no clock, no bus)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from queen_server.cluster.stream import Gap, Idle, ReplyStream, Sequencer


def test_the_sender_counts_from_zero() -> None:
    seq = Sequencer()
    assert [seq.take() for _ in range(4)] == [0, 1, 2, 3]


def test_in_order_events_come_straight_out_and_the_final_one_ends_it() -> None:
    stream: ReplyStream[str] = ReplyStream(now=0.0, idle_s=1.0)
    assert stream.feed(0, "a", 0.1) == ["a"]
    assert stream.feed(1, "b", 0.2, final=True) == ["b"]
    assert stream.done
    assert stream.feed(2, "late", 0.3) == []
    assert stream.reset("bus reset") is None  # a finished stream is not failed by a reset
    assert stream.check(99.0) is None


def test_a_held_event_waits_for_the_hole_and_duplicates_are_dropped() -> None:
    stream: ReplyStream[str] = ReplyStream(now=0.0, idle_s=1.0, window=4)
    assert stream.feed(2, "c", 0.0) == []
    assert stream.feed(2, "c", 0.0) == []  # a duplicate of a held one
    assert stream.feed(0, "a", 0.0) == ["a"]
    assert stream.feed(0, "a", 0.0) == []  # a duplicate of a delivered one
    assert stream.feed(3, "d", 0.0, final=True) == []
    assert stream.feed(1, "b", 0.0) == ["b", "c", "d"]
    assert stream.done


def test_an_event_past_the_window_is_a_gap() -> None:
    stream: ReplyStream[str] = ReplyStream(now=0.0, idle_s=1.0, window=4)
    stream.feed(0, "a", 0.0)
    assert stream.feed(6, "g", 0.0) == []
    assert stream.failed == Gap(1, "event 6 arrived while event 1 is still missing")
    assert stream.feed(1, "b", 0.0) == []  # nothing after a failure


def test_idle_past_the_deadline_and_a_hole_at_the_deadline() -> None:
    stream: ReplyStream[str] = ReplyStream(now=10.0, idle_s=2.0)
    assert stream.deadline() == 12.0
    assert stream.check(11.9) is None
    stream.feed(0, "a", 11.0)  # an event moves the deadline
    assert stream.check(12.5) is None
    assert stream.check(13.0) == Idle(11.0, 2.0)
    holed: ReplyStream[str] = ReplyStream(now=0.0, idle_s=1.0)
    holed.feed(1, "b", 0.0)
    failure = holed.check(1.0)
    assert isinstance(failure, Gap)
    assert failure.expected == 0


def test_a_reset_fails_an_open_stream_and_set_idle_moves_the_deadline() -> None:
    stream: ReplyStream[str] = ReplyStream(now=0.0, idle_s=1.0)
    stream.set_idle(5.0, now=3.0)
    assert stream.check(7.9) is None
    assert stream.reset("redis restarted") == Gap(0, "redis restarted")
    assert not stream.open


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="positive"):
        ReplyStream(now=0.0, idle_s=0.0)


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 60), window=st.integers(0, 8), data=st.data())
def test_any_arrival_order_gives_the_events_in_order_or_a_gap(
        n: int, window: int, data: st.DataObject) -> None:
    """Whatever order (with duplicates and losses) the events arrive in, what comes out is
    always a prefix of the events in order; a complete arrival within the window gives all of
    them and ends the stream; anything else ends in a failure once the deadline passes."""
    arrivals = data.draw(st.lists(st.integers(0, n - 1), max_size=3 * n))
    if data.draw(st.booleans()):
        arrivals = data.draw(st.permutations(list(range(n)))) + arrivals
    stream: ReplyStream[int] = ReplyStream(now=0.0, idle_s=1.0, window=window)
    out: list[int] = []
    for seq in arrivals:
        out += stream.feed(seq, seq, 0.0, final=seq == n - 1)
    assert out == list(range(len(out)))
    if stream.done:
        assert out == list(range(n))
    elif stream.failed is None:
        assert stream.check(1.0) is not None  # never left hanging, never silently short
