"""Routing: tiers, free slots, speed records, exclusions and the random tie-break."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

from queen_server.swarm.routing import TIER_CACHED, TIER_FETCH, TIER_LOADED, rank, tier

MODEL = "org/repo:Q4_K_M"
OTHER = "org/other:Q8_0"


@dataclass(frozen=True)
class View:
    key: str
    loaded: frozenset[str] = frozenset()
    cached: frozenset[str] = frozenset()
    can_fetch: bool = False
    free_slots: int = 1
    trust: float = 1.0
    uncovered: bool = False
    active_jobs: int = 0


def loaded(key: str, free_slots: int = 1) -> View:
    return View(key, frozenset({MODEL}), frozenset({MODEL}), free_slots=free_slots)


def cached(key: str, free_slots: int = 1) -> View:
    return View(key, frozenset(), frozenset({MODEL}), free_slots=free_slots)


def fetcher(key: str, free_slots: int = 1) -> View:
    return View(key, can_fetch=True, free_slots=free_slots)


def keys(workers: list[View]) -> list[str]:
    return [worker.key for worker in workers]


# --- tier --------------------------------------------------------------------------------------


def test_tier():
    assert tier(loaded("a"), MODEL) == TIER_LOADED
    assert tier(cached("a"), MODEL) == TIER_CACHED
    assert tier(fetcher("a"), MODEL) == TIER_FETCH
    assert tier(View("a"), MODEL) is None
    assert tier(loaded("a"), OTHER) is None
    # A fetcher that already holds the model ranks by what it holds.
    both = View("a", frozenset({MODEL}), frozenset({MODEL}), can_fetch=True)
    assert tier(both, MODEL) == TIER_LOADED
    assert tier(both, OTHER) == TIER_FETCH
    assert TIER_LOADED < TIER_CACHED < TIER_FETCH


# --- rank --------------------------------------------------------------------------------------


def test_loaded_before_cached_before_fetch():
    workers = [fetcher("f"), cached("c"), loaded("l")]
    # Even when the lower tiers are much faster.
    speeds = {"f": 0.001, "c": 0.01, "l": 1.0}
    assert keys(rank(MODEL, workers, speeds, random.Random(1))) == ["l", "c", "f"]


def test_free_slots_before_busy_within_a_tier():
    workers = [loaded("busy-fast", free_slots=0), loaded("free-slow", free_slots=2)]
    speeds = {"busy-fast": 0.01, "free-slow": 1.0}
    assert keys(rank(MODEL, workers, speeds, random.Random(1))) == ["free-slow", "busy-fast"]


def test_tier_outranks_free_slots():
    workers = [cached("cached-free", free_slots=3), loaded("loaded-busy", free_slots=0)]
    assert keys(rank(MODEL, workers, {}, random.Random(1))) == ["loaded-busy", "cached-free"]


def test_faster_ema_first():
    workers = [loaded("slow"), loaded("fast"), loaded("mid")]
    speeds = {"slow": 0.5, "fast": 0.02, "mid": 0.1}
    for seed in range(20):
        ranked = keys(rank(MODEL, workers, speeds, random.Random(seed)))
        assert ranked == ["fast", "mid", "slow"]


def test_excluded_keys_are_skipped():
    workers = [loaded("a"), loaded("b"), fetcher("c")]
    ranked = keys(rank(MODEL, workers, {}, random.Random(1), exclude={"a", "c"}))
    assert ranked == ["b"]
    assert rank(MODEL, workers, {}, random.Random(1), exclude=["a", "b", "c"]) == []


def test_workers_that_cannot_serve_are_left_out():
    workers = [View("nothing"), View("other", frozenset({OTHER}), frozenset({OTHER})), loaded("l")]
    assert keys(rank(MODEL, workers, {}, random.Random(1))) == ["l"]
    assert rank("no/such:model", [loaded("l"), cached("c")], {}, random.Random(1)) == []


def test_unknown_speed_is_scored_at_the_median():
    workers = [loaded("slow"), loaded("new"), loaded("fast"), loaded("mid")]
    speeds = {"slow": 0.9, "mid": 0.3, "fast": 0.01}  # median 0.3: the newcomer ties with mid
    seen = Counter()
    for seed in range(200):
        ranked = keys(rank(MODEL, workers, speeds, random.Random(seed), jitter=0.1))
        assert ranked[0] == "fast"
        assert ranked[-1] == "slow"
        seen[ranked[1]] += 1
    # Scored exactly like the median worker, the newcomer wins that tie about half the time.
    assert set(seen) == {"new", "mid"}
    assert 60 <= seen["new"] <= 140


def test_unknown_speed_without_jitter_lands_between_faster_and_slower():
    workers = [loaded("slow"), loaded("new"), loaded("fast")]
    speeds = {"slow": 1.0, "fast": 0.1, "other-worker": 0.2}  # median 0.2
    ranked = keys(rank(MODEL, workers, speeds, random.Random(1), jitter=0.0))
    assert ranked == ["fast", "new", "slow"]


def test_random_tie_break_spreads_load_among_equals():
    workers = [loaded("a"), loaded("b"), loaded("c")]
    speeds = {"a": 0.1, "b": 0.1, "c": 0.1}
    rng = random.Random(12345)
    trials = 3000
    firsts = Counter(keys(rank(MODEL, workers, speeds, rng))[0] for _ in range(trials))
    assert set(firsts) == {"a", "b", "c"}
    for key in "abc":
        assert trials / 3 * 0.8 <= firsts[key] <= trials / 3 * 1.2, firsts


def test_random_tie_break_spreads_load_among_newcomers():
    workers = [loaded("a"), loaded("b"), loaded("c")]
    rng = random.Random(99)
    firsts = Counter(keys(rank(MODEL, workers, {}, rng))[0] for _ in range(1500))
    for key in "abc":
        assert 400 <= firsts[key] <= 600, firsts


def test_random_tie_break_never_puts_a_much_faster_worker_behind():
    workers = [loaded("slow-1"), loaded("fast"), loaded("slow-2")]
    speeds = {"slow-1": 1.0, "fast": 0.1, "slow-2": 1.0}
    rng = random.Random(7)
    for _ in range(2000):
        assert keys(rank(MODEL, workers, speeds, rng))[0] == "fast"


def test_rank_is_deterministic_for_a_seed():
    workers = [loaded(str(i)) for i in range(10)]
    first = keys(rank(MODEL, workers, {}, random.Random(42)))
    again = keys(rank(MODEL, workers, {}, random.Random(42)))
    assert first == again
    assert sorted(first) == sorted(keys(workers))


# --- audit standing (issue 16) -------------------------------------------------------------------


def test_good_standing_outweighs_a_slightly_better_speed():
    workers = [View("good", frozenset({MODEL}), frozenset({MODEL}), trust=0.8), loaded("new")]
    speeds = {"good": 0.11, "new": 0.10}
    assert keys(rank(MODEL, workers, speeds, random.Random(1), jitter=0.0)) == ["good", "new"]


def test_an_uncovered_worker_ranks_with_the_busy_ones():
    workers = [View("uncovered", frozenset({MODEL}), frozenset({MODEL}), uncovered=True),
               loaded("busy", free_slots=0), loaded("free")]
    speeds = {"uncovered": 0.01, "busy": 0.5, "free": 0.9}
    ranked = keys(rank(MODEL, workers, speeds, random.Random(1), jitter=0.0))
    assert ranked[0] == "free"
    assert set(ranked[1:]) == {"uncovered", "busy"}


# --- prefix affinity and load (issue 36) ---------------------------------------------------------


def test_the_preferred_worker_comes_first_in_its_tier_even_when_slower():
    workers = [loaded("fast"), loaded("holder"), loaded("mid")]
    speeds = {"fast": 0.01, "holder": 0.5, "mid": 0.1}
    for seed in range(20):
        ranked = keys(rank(MODEL, workers, speeds, random.Random(seed), prefer="holder"))
        assert ranked == ["holder", "fast", "mid"]
    # Without a preference, speed decides as before.
    assert keys(rank(MODEL, workers, speeds, random.Random(1)))[0] == "fast"


def test_a_busy_preferred_worker_is_not_preferred():
    workers = [loaded("holder", free_slots=0), loaded("slow")]
    speeds = {"holder": 0.01, "slow": 0.9}
    assert keys(rank(MODEL, workers, speeds, random.Random(1), prefer="holder")) == [
        "slow", "holder"]


def test_a_preference_never_crosses_tiers():
    # It holds the prefix, but not the model loaded: a loaded worker still comes first.
    workers = [cached("holder"), loaded("loaded")]
    assert keys(rank(MODEL, workers, {}, random.Random(1), prefer="holder")) == [
        "loaded", "holder"]
    # Among the cached ones it comes first.
    workers = [cached("other"), cached("holder"), loaded("loaded")]
    speeds = {"other": 0.01, "holder": 1.0}
    assert keys(rank(MODEL, workers, speeds, random.Random(1), prefer="holder")) == [
        "loaded", "holder", "other"]


def test_an_unknown_or_excluded_preference_changes_nothing():
    workers = [loaded("a"), loaded("b")]
    speeds = {"a": 0.01, "b": 0.5}
    assert keys(rank(MODEL, workers, speeds, random.Random(1), prefer="gone")) == ["a", "b"]
    assert keys(rank(MODEL, workers, speeds, random.Random(1), prefer="b",
                     exclude={"b"})) == ["a"]


def busy_with(key: str, active_jobs: int, max_jobs: int = 8) -> View:
    return View(key, frozenset({MODEL}), frozenset({MODEL}), free_slots=max_jobs - active_jobs,
                active_jobs=active_jobs)


def test_a_batched_worker_is_ranked_by_what_a_new_stream_gets_there():
    # "batched" alone: 0.010 s/token; measured with 3-4 jobs at once: 0.030 s/token per stream.
    # It runs 3 jobs: a fourth gets 0.030, worse than an idle worker's 0.020.
    loads = {("batched", 4): 0.030, ("batched", 1): 0.010, ("idle", 1): 0.020}

    def speed_at(key: str, jobs: int) -> float | None:
        return loads.get((key, jobs))

    workers = [busy_with("batched", 3), busy_with("idle", 0)]
    speeds = {"batched": 0.010, "idle": 0.020}
    assert keys(rank(MODEL, workers, speeds, random.Random(1), jitter=0.0,
                     speed_at=speed_at)) == ["idle", "batched"]
    # Ranked by its unloaded record alone (the old rule) it would come first.
    assert keys(rank(MODEL, workers, speeds, random.Random(1), jitter=0.0)) == [
        "batched", "idle"]
    # Idle again, it is the faster one.
    workers = [busy_with("batched", 0), busy_with("idle", 0)]
    assert keys(rank(MODEL, workers, speeds, random.Random(1), jitter=0.0,
                     speed_at=speed_at)) == ["batched", "idle"]


def test_a_newcomer_running_jobs_shares_the_median_among_them():
    # No record: scored at the median (0.025), shared among the streams it would run (x3).
    workers = [busy_with("new", 2), busy_with("known", 0)]
    speeds = {"known": 0.05, "a": 0.01, "b": 0.02, "c": 0.03}
    assert keys(rank(MODEL, workers, speeds, random.Random(1), jitter=0.0,
                     speed_at=lambda key, jobs: speeds.get(key))) == ["known", "new"]
    workers = [busy_with("new", 0), busy_with("known", 0)]
    assert keys(rank(MODEL, workers, speeds, random.Random(1), jitter=0.0,
                     speed_at=lambda key, jobs: speeds.get(key))) == ["new", "known"]


def test_a_model_no_audit_can_check_goes_first_to_workers_the_audits_proved():
    """Issue 39: an unverifiable model's answers cannot be audited, so a newcomer (trust 1)
    ranks with the busy ones for it, behind a proven worker (good standing: trust below 1)
    even when slower; for a model the audits check, speed decides as before."""
    workers = [loaded("new"), View("proven", frozenset({MODEL}), frozenset({MODEL}), trust=0.8)]
    speeds = {"new": 0.01, "proven": 0.5}

    def order(unaudited: bool) -> list[str]:
        return keys(rank(MODEL, workers, speeds, random.Random(1), jitter=0.0,
                         unaudited=lambda _model: unaudited))

    assert order(unaudited=True) == ["proven", "new"]
    assert order(unaudited=False) == ["new", "proven"]
    only_new = [loaded("new")]  # alone, a newcomer still serves it
    assert keys(rank(MODEL, only_new, speeds, random.Random(1),
                     unaudited=lambda _model: True)) == ["new"]
