"""The admission queue's order: per model, callers in turn, FIFO while it drains, newest first
while it stands; cancelled waiters never served; the expected wait it sheds by."""

from __future__ import annotations

import pytest

from queen_server.swarm.queueing import CONGESTION_S, MAX_SKIPS, Waiter, WaitQueue
from tests.queen_server.swarm.test_jobs_registry import MODEL, make_session

OTHER = "org/other:Q8_0"
WORKER = make_session("w", loaded=(MODEL, OTHER))


def waiter(caller: str, since: float, model: str = MODEL, accept=None) -> Waiter:
    return Waiter(model, caller, since, accept)


def served(queue: WaitQueue, now: float, count: int, models=(MODEL,)) -> list[Waiter]:
    taken = []
    for _ in range(count):
        chosen = queue.pop_for(WORKER, models, now)
        assert chosen is not None
        assert chosen.worker is WORKER
        taken.append(chosen)
    return taken


def test_fifo_while_the_queue_drains():
    queue = WaitQueue()
    first, second = waiter("a", 0.0), waiter("a", 0.1)
    queue.push(first)
    queue.push(second)
    assert served(queue, 0.2, 2) == [first, second]
    assert len(queue) == 0
    assert queue.pop_for(WORKER, [MODEL], 0.3) is None


def test_callers_take_turns_so_one_key_cannot_stand_in_front_of_another():
    queue = WaitQueue()
    flood = [waiter("flood", 0.01 * number) for number in range(10)]
    for entry in flood:
        queue.push(entry)
    lone = waiter("lone", 0.5)
    queue.push(lone)
    order = served(queue, 0.6, 3)
    assert order == [flood[0], lone, flood[1]]


def test_a_standing_queue_serves_newest_first():
    queue = WaitQueue()
    entries = [waiter("a", float(number) / 10) for number in range(5)]
    for entry in entries:
        queue.push(entry)
    now = CONGESTION_S + 0.5  # not empty for longer than the congestion interval
    assert queue.congested(MODEL, now)
    assert served(queue, now, 2) == [entries[4], entries[3]]
    newer = waiter("a", now)
    queue.push(newer)
    assert served(queue, now, 1) == [newer]
    served(queue, now, 3)
    assert not queue.congested(MODEL, now)
    # Emptied: the next burst is FIFO again.
    burst = [waiter("a", now + 0.1), waiter("a", now + 0.2)]
    for entry in burst:
        queue.push(entry)
    assert served(queue, now + 0.3, 2) == burst


def test_a_cancelled_waiter_is_never_served_and_is_not_counted():
    queue = WaitQueue()
    gone, stays = waiter("a", 0.0), waiter("a", 0.1)
    queue.push(gone)
    queue.push(stays)
    queue.cancel(gone, 0.2)
    queue.cancel(gone, 0.2)  # twice is harmless
    assert len(queue) == 1
    assert queue.waiting(MODEL) == 1
    assert served(queue, 0.3, 1) == [stays]
    assert gone.worker is None
    assert queue.pop_for(WORKER, [MODEL], 0.4) is None


def test_waiters_that_refuse_the_worker_keep_their_place():
    queue = WaitQueue()
    picky = waiter("a", 0.0, accept=lambda w: w.key == "other")
    easy = waiter("a", 0.1)
    queue.push(picky)
    queue.push(easy)
    assert served(queue, 0.2, 1) == [easy]
    assert queue.waiting(MODEL) == 1
    other = make_session("other", loaded=(MODEL,))
    assert queue.pop_for(other, [MODEL], 0.3) is picky


def test_the_skip_limit_bounds_the_work_for_one_slot():
    queue = WaitQueue()
    for number in range(MAX_SKIPS * 3):
        queue.push(waiter(f"c{number}", 0.0, accept=lambda _w: False))
    assert queue.pop_for(WORKER, [MODEL], 0.1) is None
    assert queue.waiting(MODEL) == MAX_SKIPS * 3


def test_a_worker_of_two_models_serves_the_queue_that_waited_longest():
    queue = WaitQueue()
    late = waiter("a", 5.0, model=MODEL)
    early = waiter("b", 1.0, model=OTHER)
    queue.push(late)
    queue.push(early)
    assert queue.pop_for(WORKER, [MODEL, OTHER], 5.1) is early
    assert queue.pop_for(WORKER, [MODEL, OTHER], 5.2) is late


def test_take_all_empties_a_model():
    queue = WaitQueue()
    entries = [waiter("a", 0.0), waiter("b", 0.0), waiter("c", 0.0, model=OTHER)]
    for entry in entries:
        queue.push(entry)
    assert set(queue.take_all(MODEL, 1.0)) == set(entries[:2])
    assert queue.waiting(MODEL) == 0
    assert len(queue) == 1


def test_expected_wait_is_the_queue_over_the_measured_service_rate():
    queue = WaitQueue()
    assert queue.expected_wait_s(MODEL, slots=2) is None  # nothing measured: nobody is shed
    queue.served(MODEL, 1.0)
    assert queue.expected_wait_s(MODEL, slots=0) is None
    for number in range(9):
        queue.push(waiter("a", float(number)))
    # 9 ahead plus this one, two slots freeing every second: 5 s.
    assert queue.expected_wait_s(MODEL, slots=2) == pytest.approx(5.0)
    queue.served(MODEL, 2.0)  # the mean moves by RATE_ALPHA toward a slower job
    assert queue.expected_wait_s(MODEL, slots=2) == pytest.approx(5.5)
