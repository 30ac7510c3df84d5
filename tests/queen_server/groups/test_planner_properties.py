"""Properties of the group planner on random swarms of 1 to 8 workers, checked by brute force
over every subset with the plain greedy fit of ``oracle.py``: a plan's layer ranges are
contiguous and cover every layer once, no device holds more than its usable memory, no smaller
set of workers (of any one build, with a trusted head) would fit, a plan across LANs means no
set of its size on one LAN fits, every "no plan" reason is true, and the same swarm in any
order gives the same answer. Claims include garbage: negative, zero, NaN, infinite and absurd.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import combinations

from hypothesis import given, settings
from hypothesis import strategies as st

from queen_server.groups import Candidate, GroupPlan, NoPlan, NoPlanReason, plan_group, usable_mb
from shared_schema.fitting import MB
from shared_schema.gguf_shape import GgufShape
from tests.queen_server.groups.oracle import assert_sound, fits, group_fits

CAP = 48 * 1024  # max_credible_mb in these tests: a claim of 10**9 MB counts as 48 GB
GOOD = st.integers(4000, 40000)
CLAIMS = st.one_of(GOOD, st.integers(-2000, 2000),
                   st.sampled_from([0, math.nan, math.inf, -math.inf, 10**9]))


def _rarely(draw: st.DrawFn) -> bool:
    return draw(st.integers(0, 7)) == 0


@st.composite
def swarms(draw: st.DrawFn) -> list[Candidate]:
    size = draw(st.sampled_from([*range(2, 9), *range(2, 9), 1]))
    return [
        Candidate(
            key=f"w{draw(st.integers(0, 99)):02}-{i}",
            free_mb=tuple(draw(st.lists(CLAIMS if _rarely(draw) else GOOD, max_size=3,
                                        min_size=0 if _rarely(draw) else 1))),
            lan=draw(st.sampled_from([None, "", " ", "lan-a", "lan-b", "lan-b", "lan-c"])),
            rtt_ms=draw(st.one_of(st.none(), st.floats(0, 300), st.sampled_from([-1.0, math.nan]))),
            trusted=draw(st.booleans()),
            build=None if _rarely(draw) else draw(st.sampled_from(["b1", "b1", "b1", "b1", "b2"])),
            rpc=not _rarely(draw),
        )
        for i in range(size)
    ]


@st.composite
def cases(draw: st.DrawFn) -> tuple[GgufShape, list[Candidate]]:
    """A swarm, and a model sized against it: from 0.9 times its largest worker's usable
    memory to three quarters of all of it, so that every outcome (one worker, groups of 2 to 8, each
    reason) comes up."""
    pool = draw(swarms())
    rooms = [sum(usable_mb(c.free_mb, max_credible_mb=CAP)) for c in pool]
    least = max(1, max(rooms) * 9 // 10)
    target = draw(st.integers(least, max(least, sum(rooms) * 3 // 4)))
    weights = draw(st.lists(st.integers(0, 100), max_size=48,
                            min_size=draw(st.sampled_from([16, 16, 16, 1]))))
    scale = target * MB // max(1, sum(weights))
    shape = GgufShape(
        architecture="llama", block_count=len(weights), context_length=8192,
        embedding_length=4096, head_count=32, head_count_kv=draw(st.sampled_from([0, 8, 32])),
        layer_bytes=tuple(w * scale for w in weights),
        other_bytes=draw(st.integers(0, max(0, target // 8))) * MB, has_chat_template=True)
    return shape, pool


def _able(pool: Sequence[Candidate]) -> list[Candidate]:
    return [c for c in pool if c.rpc and c.build and sum(usable_mb(c.free_mb, max_credible_mb=CAP))]


def _any_fits(shape: GgufShape, pool: Sequence[Candidate], sizes: range, *, by_build: bool,
              trusted_only: bool) -> bool:
    builds = {c.build for c in pool} if by_build else {None}
    for build in builds:
        group = [c for c in pool if not by_build or c.build == build]
        for size in sizes:
            for subset in combinations(group, size):
                if group_fits(shape, subset, trusted_only=trusted_only, max_credible_mb=CAP):
                    return True
    return False


def _one_lan(subset: Sequence[Candidate]) -> bool:
    lan = subset[0].lan
    return lan is not None and lan.strip() != "" and all(c.lan == lan for c in subset)


@settings(max_examples=300, deadline=None)
@given(cases())
def test_every_answer_is_true(case: tuple[GgufShape, list[Candidate]]) -> None:
    shape, pool = case
    result = plan_group(shape, pool, max_credible_mb=CAP)
    alone = [c for c in sorted(pool, key=lambda c: c.key) if fits(shape, [c], max_credible_mb=CAP)]
    if isinstance(result, NoPlan) and result.reason is NoPlanReason.FITS_ONE_WORKER:
        assert alone
        assert result.worker == alone[0].key
        return
    assert not alone
    able = _able(pool)
    if isinstance(result, GroupPlan):
        assert_sound(result, shape, pool, max_credible_mb=CAP)
        size = len(result.members)
        assert not _any_fits(shape, able, range(2, size), by_build=True, trusted_only=True)
        members = [c for c in pool if c.key in result.keys]
        if not _one_lan(members):
            for subset in combinations([c for c in able if c.build == result.build], size):
                assert not (_one_lan(subset) and group_fits(
                    shape, subset, trusted_only=True, max_credible_mb=CAP))
        return
    if result.reason is NoPlanReason.TOO_FEW_CANDIDATES:
        assert len(able) < 2
        return
    sizes = range(2, 9)
    assert not _any_fits(shape, able, sizes, by_build=True, trusted_only=True)
    if result.reason is NoPlanReason.NO_TRUSTED_HEAD:
        assert _any_fits(shape, able, sizes, by_build=True, trusted_only=False)
    elif result.reason is NoPlanReason.BUILDS_DIFFER:
        assert not _any_fits(shape, able, sizes, by_build=True, trusted_only=False)
        assert _any_fits(shape, able, sizes, by_build=False, trusted_only=False)
    else:
        assert result.reason is NoPlanReason.NOT_ENOUGH_MEMORY
        assert not _any_fits(shape, able, sizes, by_build=False, trusted_only=False)


@settings(max_examples=150, deadline=None)
@given(cases(), st.randoms(use_true_random=False))
def test_the_same_swarm_in_any_order_gives_the_same_answer(
        case: tuple[GgufShape, list[Candidate]], rng: object) -> None:
    shape, pool = case
    shuffled = list(pool)
    rng.shuffle(shuffled)  # type: ignore[attr-defined]
    assert plan_group(shape, shuffled, max_credible_mb=CAP) == plan_group(
        shape, pool, max_credible_mb=CAP)


@settings(max_examples=100, deadline=None)
@given(st.lists(CLAIMS, max_size=4), st.integers(0, 10**6), st.floats(0, 1), st.integers(0, 4096))
def test_usable_memory_is_never_negative_nor_beyond_the_bound(
        claims: list[float], bound: int, fraction: float, reserve: int) -> None:
    usable = usable_mb(claims, max_credible_mb=bound, headroom_fraction=fraction,
                       reserve_mb=reserve)
    assert len(usable) == len(claims)
    assert all(0 <= mb <= bound for mb in usable)
    for claim, mb in zip(claims, usable, strict=True):
        if not math.isfinite(claim) or claim <= reserve:
            assert mb == 0
