"""The group planner (issue 19) on recorded hardware of 1 to 8 workers (``hardware.json``), a
70B-class shape (80 blocks of 0.5 GB: about 43 GB with its KV cache at 4,096 tokens) and the
real SmolLM2 header; then every hostile input: absurd, negative, zero and non-numeric memory
claims, duplicate keys, a model with no layers.

Usable memory per device is its free memory less 10% and 512 MB: a 24 GB card reporting
23,500 MB free gives 20,638 MB, and the 70B shape needs 43,290 MB with the head's 1,050 MB
of non-block tensors, so two 4090s (41,276 MB) are not enough but a 4090 and a pair of 3090s
are.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import pytest

from queen_server.groups import (
    Candidate,
    GroupPlan,
    NoPlan,
    NoPlanReason,
    Route,
    plan_group,
    usable_mb,
)
from shared_schema.fitting import MB
from tests.queen_server.groups.oracle import (
    assert_sound,
    group_fits,
    llama70b,
    recorded,
    smollm2,
)

WORKERS = recorded()
BIG = llama70b()


@dataclass(frozen=True)
class Case:
    name: str
    keys: tuple[str, ...]
    reason: NoPlanReason | None = None
    members: tuple[str, ...] = ()  # the head first
    routes: tuple[Route, ...] = ()


CASES = [
    Case("one 4090 alone", ("ana-4090",), NoPlanReason.TOO_FEW_CANDIDATES),
    Case("a 4090 and a 3060 are 30 GB", ("ana-4090", "ana-3060"),
         NoPlanReason.NOT_ENOUGH_MEMORY),
    Case("two 4090s of different builds", ("ana-4090", "ivy-4090", "ana-3060"),
         NoPlanReason.BUILDS_DIFFER),
    Case("a 4090 and a pair of 3090s: the nearer head", ("ben-3090x2", "ana-4090"),
         members=("ana-4090", "ben-3090x2"), routes=(Route.LOCAL, Route.RELAYED)),
    Case("three cards with one layer to spare", ("ben-4060ti", "ana-3060", "ana-4090"),
         members=("ana-4090", "ana-3060", "ben-4060ti"),
         routes=(Route.LOCAL, Route.DIRECT, Route.RELAYED)),
    Case("the pair on one LAN beats a pair across two", (
        "ana-4090", "ana-3060", "ben-3090x2", "ben-4060ti"),
         members=("ben-3090x2", "ben-4060ti"), routes=(Route.LOCAL, Route.DIRECT)),
    Case("a 64 GB RAM box holds it alone", (
        "ana-4090", "ana-3060", "ben-3090x2", "ben-4060ti", "dan-ram64"),
         NoPlanReason.FITS_ONE_WORKER),
    Case("enough memory, nobody trusted", ("kim-3090", "ben-4060ti", "ana-3060"),
         NoPlanReason.NO_TRUSTED_HEAD),
    Case("two 32 GB RAM boxes (42 GB) fit only with the Mac's Metal build", (
        "eve-ram32-b", "eve-ram32", "fay-m2"), NoPlanReason.BUILDS_DIFFER),
    Case("six able of eight: the three nearest that fit", (
        "ana-3060", "ben-4060ti", "cat-laptop", "gus-3070", "kim-3090", "ana-4090",
        "hal-3070", "fay-m2"),
         members=("ana-4090", "ana-3060", "kim-3090"),
         routes=(Route.LOCAL, Route.DIRECT, Route.RELAYED)),
    Case("eight machines, three builds: the one set of three that fits", (
        "ana-3060", "ben-4060ti", "cat-laptop", "gus-3070", "hal-3070", "fay-m2", "ana-4090",
        "eve-ram32"), members=("ana-4090", "ana-3060", "ben-4060ti"),
         routes=(Route.LOCAL, Route.DIRECT, Route.RELAYED)),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_recorded_swarms(case: Case) -> None:
    pool = [WORKERS[k] for k in case.keys]
    plan = plan_group(BIG, pool)
    if case.reason is not None:
        assert isinstance(plan, NoPlan), plan
        assert plan.reason is case.reason, plan.detail
        assert plan.needed_mb == 43290
        return
    assert isinstance(plan, GroupPlan), plan
    assert plan.keys == case.members
    assert tuple(m.route for m in plan.members) == case.routes
    assert_sound(plan, BIG, pool)
    # fewest members: no smaller set of these workers fits with a trusted head
    for size in range(1, len(plan.members)):
        for subset in _subsets(pool, size):
            assert not group_fits(BIG, subset), [c.key for c in subset]
    # the same swarm in another order gives the same plan
    assert plan_group(BIG, list(reversed(pool))) == plan


def _subsets(pool: list[Candidate], size: int) -> list[list[Candidate]]:
    from itertools import combinations
    return [list(s) for s in combinations(pool, size)]


def test_one_layer_to_spare_is_split_without_overflowing_anyone() -> None:
    """4090 + 3060 + 4060 Ti hold 80 layers of 528 MB exactly (37 on the head after its
    1,050 MB of non-block tensors, 18, 25). Shares by room are 36.25, 18.37 and 25.37 layers:
    largest-remainder rounding gives 36/18/26, and 26 layers (13,728 MB) overflow the 4060 Ti's
    13,708 MB. The split checks each device after rounding."""
    pool = [WORKERS[k] for k in ("ana-4090", "ana-3060", "ben-4060ti")]
    plan = plan_group(BIG, pool)
    assert isinstance(plan, GroupPlan)
    assert [m.layers for m in plan.members] == [37, 18, 25]
    assert all(m.holds_bytes <= m.usable_bytes for m in plan.members)
    assert plan.members[0].holds_bytes == 37 * 528 * MB + 1050 * MB
    assert plan.kv_bytes_per_layer == 16 * MB
    assert plan.n_ctx == 4096


def test_shares_follow_usable_memory_when_there_is_room() -> None:
    """Two identical RAM boxes split an 80-layer model evenly; a box with half as much room
    again (31,888 MB usable against 21,088) takes half as many layers again."""
    twin = [Candidate(k, (24000,), lan="x", trusted=True, build="b", rpc=True) for k in "ab"]
    plan = plan_group(llama70b(layer_mb=256, other_mb=0), twin)
    assert isinstance(plan, GroupPlan)
    assert [m.layers for m in plan.members] == [40, 40]
    larger = Candidate("c", (36000,), lan="x", build="b", rpc=True)
    plan = plan_group(llama70b(other_mb=0), [twin[0], larger])
    assert isinstance(plan, GroupPlan)
    assert [m.layers for m in plan.members] == [32, 48]


def test_multi_gpu_member_is_split_per_device() -> None:
    """A member with two cards gets a layer count per card, each within that card's room."""
    pool = [WORKERS["ana-4090"], WORKERS["ben-3090x2"]]
    plan = plan_group(BIG, pool)
    assert isinstance(plan, GroupPlan)
    pair = plan.members[1]
    assert len(pair.device_layers) == 2
    assert all(n > 0 for n in pair.device_layers)
    assert all(n * 528 <= 20908 for n in pair.device_layers)
    assert pair.headroom_mb == 2 * (512 + 2380)


def test_the_real_smollm2_fits_one_worker_of_every_recorded_kind() -> None:
    shape = smollm2()
    for worker in WORKERS.values():
        plan = plan_group(shape, [worker])
        if worker.key == "max-liar" or sum(usable_mb(worker.free_mb)) > 0:
            assert isinstance(plan, NoPlan)
            assert plan.reason is NoPlanReason.FITS_ONE_WORKER
            assert plan.worker == worker.key


@pytest.mark.parametrize("members", [2, 3])
def test_the_real_smollm2_on_small_loopback_members(members: int) -> None:
    """What a loopback group test runs: SmolLM2 (30 blocks, 30 MB of non-block tensors)
    over members with just enough room, headroom off. Each gets a contiguous share."""
    shape = smollm2()
    room = (60 if members == 2 else 45,)
    pool = [Candidate(f"w{i}", room, lan="lo", rtt_ms=1.0, trusted=i == 0, build="b", rpc=True)
            for i in range(members)]
    plan = plan_group(shape, pool, n_ctx=512, headroom_fraction=0.0, reserve_mb=0)
    assert isinstance(plan, GroupPlan), plan
    assert len(plan.members) == members
    assert plan.head == "w0"
    assert all(m.layers > 0 for m in plan.members)
    assert_sound(plan, shape, pool, n_ctx=512, headroom_fraction=0.0, reserve_mb=0)


# hostile and bad inputs


def test_an_absurd_claim_is_clamped_to_what_the_queen_can_check() -> None:
    liar, small = WORKERS["max-liar"], WORKERS["ana-3060"]
    believed = plan_group(BIG, [liar, small])
    assert isinstance(believed, NoPlan)
    assert believed.reason is NoPlanReason.FITS_ONE_WORKER
    checked = plan_group(BIG, [liar, small], max_credible_mb=24576)
    assert isinstance(checked, NoPlan)
    assert checked.reason is NoPlanReason.NOT_ENOUGH_MEMORY
    with_pair = plan_group(BIG, [liar, small, WORKERS["kim-3090"]], max_credible_mb=24576)
    assert isinstance(with_pair, GroupPlan)
    assert with_pair.members[0].usable_bytes == (24576 - 512 - 2458) * MB


@pytest.mark.parametrize("claim", [
    (-24000,), (0,), (math.nan,), (math.inf,), (-math.inf,), (), (True,), ("24000",)])
def test_negative_zero_and_non_numeric_memory_counts_as_none(claim: tuple[object, ...]) -> None:
    bad = dataclasses.replace(WORKERS["ana-4090"], key="bad", free_mb=claim)  # type: ignore[arg-type]
    assert sum(usable_mb(bad.free_mb)) == 0
    pool = [bad, WORKERS["ana-4090"], WORKERS["ben-3090x2"]]
    plan = plan_group(BIG, pool)
    assert isinstance(plan, GroupPlan)
    assert "bad" not in plan.keys
    alone = plan_group(BIG, [bad, WORKERS["ana-4090"]])
    assert isinstance(alone, NoPlan)
    assert alone.reason is NoPlanReason.TOO_FEW_CANDIDATES


def test_a_device_with_nothing_usable_gets_no_layers() -> None:
    pair = dataclasses.replace(WORKERS["ben-3090x2"], free_mb=(23800, 300))
    plan = plan_group(BIG, [WORKERS["ana-4090"], pair, WORKERS["kim-3090"]])
    assert isinstance(plan, GroupPlan)
    for member in plan.members:
        if member.key == pair.key:
            assert member.device_layers[1] == 0


def test_duplicate_keys_are_refused() -> None:
    twin = dataclasses.replace(WORKERS["ben-3090x2"], key="ana-4090")
    with pytest.raises(ValueError, match="duplicate candidate keys: \\['ana-4090'\\]"):
        plan_group(BIG, [WORKERS["ana-4090"], twin])


@pytest.mark.parametrize("rtt", [None, -5.0, math.nan, math.inf, 1e12])
def test_a_bad_latency_counts_as_far_not_near(rtt: float | None) -> None:
    """Two equal pairs across LANs: the one whose member has a measured latency wins over one
    whose member's latency is unknown, negative or not a number."""
    head = Candidate("h", (23500,), lan="h-lan", rtt_ms=10.0, trusted=True, build="b", rpc=True)
    near = Candidate("z-near", (23800, 23800), lan="n", rtt_ms=40.0, build="b", rpc=True)
    odd = Candidate("a-odd", (23800, 23800), lan="o", rtt_ms=rtt, build="b", rpc=True)
    plan = plan_group(BIG, [head, odd, near])
    assert isinstance(plan, GroupPlan)
    assert plan.keys == ("h", "z-near")


def test_a_blank_lan_hint_is_no_lan() -> None:
    pool = [dataclasses.replace(WORKERS[k], lan=" ") for k in ("ben-3090x2", "ben-4060ti")]
    plan = plan_group(BIG, pool)
    assert isinstance(plan, GroupPlan)
    assert plan.members[1].route is Route.RELAYED


def test_unable_workers_never_join() -> None:
    """No rpc capability, or no build reported: left out, whatever their memory."""
    no_rpc = dataclasses.replace(WORKERS["ben-3090x2"], key="no-rpc", rpc=False)
    no_build = dataclasses.replace(WORKERS["ben-3090x2"], key="no-build", build=None)
    plan = plan_group(BIG, [WORKERS["ana-4090"], no_rpc, no_build])
    assert isinstance(plan, NoPlan)
    assert plan.reason is NoPlanReason.TOO_FEW_CANDIDATES


def test_a_model_with_no_layers_is_not_split() -> None:
    empty = dataclasses.replace(BIG, block_count=0, layer_bytes=())
    plan = plan_group(empty, [WORKERS["ana-4090"], WORKERS["ben-3090x2"]])
    assert isinstance(plan, NoPlan)
    assert plan.reason is NoPlanReason.NO_LAYERS


def test_too_many_members_needed_is_not_enough_memory() -> None:
    """Eleven 6 GB laptops (8 layers each, the head 6) hold it together, but a group stops at
    eight members unless told otherwise."""
    pool = [Candidate(f"g{i:02}", (5600,), lan="lan", trusted=i == 0, build="b", rpc=True)
            for i in range(11)]
    short = plan_group(BIG, pool)
    assert isinstance(short, NoPlan)
    assert short.reason is NoPlanReason.NOT_ENOUGH_MEMORY
    plan = plan_group(BIG, pool, max_members=11)
    assert isinstance(plan, GroupPlan)
    assert len(plan.members) == 11
    assert_sound(plan, BIG, pool)


def test_without_a_relay_only_one_lan_is_grouped() -> None:
    # The pair of 3090s is on another LAN than the 4090: grouped only through the queen.
    keys = ("ben-3090x2", "ana-4090")
    relayed = plan_group(BIG, [WORKERS[k] for k in keys])
    assert isinstance(relayed, GroupPlan)
    assert Route.RELAYED in {m.route for m in relayed.members}
    direct = plan_group(BIG, [WORKERS[k] for k in keys], relayed=False)
    assert isinstance(direct, NoPlan)
    assert direct.reason is NoPlanReason.NO_DIRECT_ROUTE
    # On one LAN the same workers are grouped, every link direct.
    same = [dataclasses.replace(WORKERS[k], lan="home") for k in keys]
    plan = plan_group(BIG, same, relayed=False)
    assert isinstance(plan, GroupPlan)
    assert [m.route for m in plan.members][1:] == [Route.DIRECT]
    # Workers with no LAN hint (LAN mode off) are never grouped directly.
    blind = [dataclasses.replace(WORKERS[k], lan=None) for k in keys]
    assert isinstance(plan_group(BIG, blind, relayed=False), NoPlan)


# a worker's devices and its pool's budget (``Candidate.alone_mb``)


def test_a_worker_whose_budget_holds_the_model_serves_it_alone_whatever_its_gpus() -> None:
    """A lone worker keeps in RAM the layers its GPU cannot hold: a model within its pool's
    budget is no group's, though its one GPU is far too small for it."""
    gamer = dataclasses.replace(WORKERS["ana-3060"], key="gamer", free_mb=(11_500,),
                                alone_mb=60_000.0)
    pool = [gamer, WORKERS["ana-4090"], WORKERS["ben-3090x2"]]
    alone = plan_group(BIG, pool)
    assert isinstance(alone, NoPlan)
    assert (alone.reason, alone.worker) == (NoPlanReason.FITS_ONE_WORKER, "gamer")
    # a budget too small for it (or none said): its GPU is what a group may use of it
    for budget in (30_000.0, None):
        planned = [dataclasses.replace(gamer, alone_mb=budget), *pool[1:]]
        plan = plan_group(BIG, planned)
        assert isinstance(plan, GroupPlan), plan
        assert_sound(plan, BIG, planned)  # every device within its own usable memory


@pytest.mark.parametrize("budget", [1e12, float(1 << 24), math.inf, math.nan, -1.0, "9e9"])
def test_an_absurd_budget_is_clamped_like_a_device(budget: object) -> None:
    """Bounded by ``max_credible_mb`` as a device's claim is; not a finite number: none."""
    liar = dataclasses.replace(WORKERS["ana-3060"], key="liar", alone_mb=budget)  # type: ignore[arg-type]
    pool = [liar, WORKERS["ana-4090"], WORKERS["ben-3090x2"]]
    checked = plan_group(BIG, pool, max_credible_mb=24_576)
    assert isinstance(checked, GroupPlan), checked  # 24 GB cannot hold 43 GB alone
    assert_sound(checked, BIG, pool, max_credible_mb=24_576)
    believed = plan_group(BIG, pool)  # the default bound, 256 GB, would, if it is a number
    counted = isinstance(budget, float) and math.isfinite(budget) and budget > 0
    assert isinstance(believed, NoPlan) is counted
