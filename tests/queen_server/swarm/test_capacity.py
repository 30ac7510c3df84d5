"""The free-capacity index: the same choice as ``routing.rank`` on small swarms, a bounded look
at large ones, and a place that follows leases, releases and standings."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from queen_server.swarm.capacity import FULL_LOOK, FreeIndex, RandomSet, speed_class
from queen_server.swarm.eligibility import Scores
from queen_server.swarm.registry import Registry
from queen_server.swarm.routing import rank, tier, unproven_for
from queen_server.swarm.worker import Worker
from shared_schema import ModelDescriptor
from tests.queen_server.swarm.test_jobs_registry import (
    MODEL,
    DummyConnection,
    handle_on,
    make_legacy,
    make_session,
)

OTHER = "org/other:Q8_0"


def worker(key: str, holding: str, *, max_jobs: int = 1, uncovered: bool = False,
           trust: float = 1.0) -> Worker:
    models = [] if holding == "none" else [ModelDescriptor(name=MODEL,
                                                           loaded=holding == "loaded")]
    made = Worker(key=key, public_id=key, session_id=key, models=models, max_jobs=max_jobs)
    made.uncovered, made.trust = uncovered, trust
    return made


def test_speed_classes_are_ordered_and_ten_percent_wide():
    assert speed_class(0.01) < speed_class(0.02) < speed_class(1.0)
    assert speed_class(0.0100) == speed_class(0.0101)
    assert speed_class(0.0) < speed_class(1e-9)


def test_random_set_adds_discards_and_picks():
    items: RandomSet[int] = RandomSet()
    for number in range(10):
        items.add(number)
    items.add(3)
    items.discard(3)
    items.discard(42)
    assert sorted(items) == [0, 1, 2, 4, 5, 6, 7, 8, 9]
    rng = random.Random(1)
    assert {items.pick(rng) for _ in range(500)} == set(items)


# Speeds a factor of 2 apart, trust 1 or 0.5: any two scores are equal or classes apart, so the
# index's buckets order them exactly as rank's sort does.
SWARMS = st.lists(
    st.tuples(st.sampled_from(["loaded", "cached", "none"]), st.integers(0, 2),
              st.booleans(), st.sampled_from([None, 0.01, 0.02, 0.04, 0.08]),
              st.sampled_from([1.0, 0.5])),
    min_size=1, max_size=12)


@settings(max_examples=300, deadline=None)
@given(SWARMS, st.one_of(st.none(), st.integers(0, 11)), st.booleans())
def test_on_small_swarms_the_index_chooses_what_rank_puts_first(swarm, prefer_number,
                                                                 unaudited):
    """With routing's real score (``Scores``: the speed a new job gets at the load it joins,
    here twice the unloaded one for a second job), a preferred worker or none, and a model
    the audits check or one they cannot (issue 39: unproven workers rank as uncovered)."""
    check = (lambda _model: True) if unaudited else None
    speeds = {f"w{number}": entry[3] for number, entry in enumerate(swarm)
              if entry[3] is not None}

    def speed_at(key: str, jobs: int) -> float | None:
        unloaded = speeds.get(key)
        return None if unloaded is None else unloaded * jobs

    scores = Scores(lambda _class: speeds, lambda _model: "tiny",
                    lambda _class, key, jobs: speed_at(key, jobs))
    registry = Registry(FreeIndex(scores.score, jitter=0.0))
    registry.free.unaudited = check
    workers = []
    for number, (holding, busy, uncovered, _speed, trust) in enumerate(swarm):
        made = worker(f"w{number}", holding, max_jobs=2, uncovered=uncovered, trust=trust)
        registry.add(made, DummyConnection())
        for job in range(busy):
            registry.lease(made, handle_on(made, f"w{number}-{job}"))
        workers.append(made)
    prefer = f"w{prefer_number}" if prefer_number is not None else None
    ranked = [w for w in rank(MODEL, workers, speeds, random.Random(0), jitter=0.0,
                              prefer=prefer, speed_at=speed_at, unaudited=check)
              if w.free_slots > 0]
    chosen = registry.choose(MODEL, prefer=prefer)
    if not ranked:
        assert chosen is None
        return
    assert chosen is not None
    if ranked[0].key == prefer:
        assert chosen is ranked[0]
        return
    assert chosen.key != prefer

    def order(w: Worker) -> tuple:
        return (tier(w, MODEL), unproven_for(w, MODEL, check), registry.free.score(w, MODEL))

    assert order(chosen) == order(ranked[0])


def test_a_large_bucket_is_sampled_not_scanned():
    index = FreeIndex(rng=random.Random(3))
    calls = 0

    def score(w: Worker, _model: str) -> float:
        nonlocal calls
        calls += 1
        return 0.02
    index.score = score
    many = [worker(f"w{number}", "loaded") for number in range(5000)]
    for made in many:
        index.refresh(made, routable=True)
    calls = 0
    for _ in range(100):
        assert index.choose(MODEL) is not None
    assert calls <= 100 * 2  # two random choices compared per decision, not 5,000


def test_choices_spread_over_a_bucket_of_equals():
    index = FreeIndex(rng=random.Random(5))
    many = [worker(f"w{number}", "loaded") for number in range(100)]
    for made in many:
        index.refresh(made, routable=True)
    picked = {index.choose(MODEL).key for _ in range(2000)}  # type: ignore[union-attr]
    assert len(picked) > 90


def test_a_filter_that_refuses_the_draws_falls_back_to_the_bucket():
    index = FreeIndex(rng=random.Random(7))
    many = [worker(f"w{number}", "loaded") for number in range(FULL_LOOK * 50)]
    for made in many:
        index.refresh(made, routable=True)
    assert index.choose(MODEL, lambda w: w.key == "w123").key == "w123"  # type: ignore[union-attr]
    assert index.choose(MODEL, lambda w: False) is None


def test_fetchers_come_after_every_holder_and_serve_any_model():
    registry = Registry()
    legacy = make_legacy("legacy")
    holder = make_session("holder", cached=(MODEL,))
    registry.add(legacy, DummyConnection())
    registry.add(holder, DummyConnection())
    assert registry.choose(MODEL) is holder
    assert registry.choose(OTHER) is legacy
    registry.lease(holder, handle_on(holder))
    assert registry.choose(MODEL) is legacy


def test_the_index_follows_leases_releases_statuses_and_standing():
    registry = Registry()
    fast = make_session("fast", loaded=(MODEL,))
    slow = make_session("slow", loaded=(MODEL,))
    for made in (fast, slow):
        registry.add(made, DummyConnection())
    registry.free.score = lambda w, _m: 0.01 if w.key == "fast" else 0.1
    registry.free.jitter = 0.0
    registry.models_changed(fast)
    registry.models_changed(slow)
    assert registry.choose(MODEL) is fast
    handle = handle_on(fast)
    registry.lease(fast, handle)
    assert registry.choose(MODEL) is slow
    registry.release(handle.id)
    assert registry.choose(MODEL) is fast
    registry.set_standing(fast, trust=1.0, uncovered=True)  # ranks with the busy ones now
    assert registry.choose(MODEL) is slow
    registry.set_standing(fast, trust=1.0, uncovered=False)
    registry.set_paused(fast, "on battery")
    assert registry.choose(MODEL) is slow
    registry.set_paused(fast, None)
    registry.set_flagged(fast, True)
    assert registry.choose(MODEL) is slow
    registry.set_flagged(fast, False)
    registry.apply_status(fast, models=[ModelDescriptor(name=OTHER, loaded=True)])
    assert registry.choose(MODEL) is slow
    assert registry.choose(OTHER) is fast
    registry.remove(slow, "gone")
    assert registry.choose(MODEL) is None
    assert len(registry.free) == 1


def test_profiles_and_slots_follow_the_swarm_without_a_scan():
    registry = Registry()
    one = make_session("one", loaded=(MODEL,), max_jobs=2)
    two = make_session("two", cached=(MODEL,), capabilities=("chat", "tools"), max_jobs=3)
    registry.add(one, DummyConnection())
    registry.add(two, DummyConnection())
    assert registry.serves(MODEL)
    assert registry.slots(MODEL) == 5
    assert {caps for _, caps, _ in registry.profiles(MODEL)} == {
        frozenset({"chat"}), frozenset({"chat", "tools"})}
    registry.apply_status(two, max_jobs=1)
    assert registry.slots(MODEL) == 3
    registry.remove(one, "gone")
    registry.remove(two, "gone")
    assert not registry.serves(MODEL)
    assert registry.slots(MODEL) == 0
    assert registry.profiles(MODEL) == []
