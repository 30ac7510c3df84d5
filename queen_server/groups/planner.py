"""Planning a model group: which workers together hold a model none of them can hold alone.

Issue 19 serves such a model through llama.cpp's RPC backend: a head process loads the model
with some layers on each member's devices. The queen decides the group, from facts it holds
(the model's shape from the GGUF header it reads itself, and each worker's reported memory,
LAN hint, measured latency, trust, llama.cpp build and ``rpc`` capability), so this module is
pure and runs on recorded hardware in tests. It imports only the standard library and
``shared_schema``; the KV cache per layer is ``shared_schema.fitting``'s, the worker's rule.

The rules, and why:

- A model that fits on one worker is not a group: routing serves it as today (``NoPlan``).
  One worker holds it on its devices, or in the memory it serves a model with alone
  (``Candidate.alone_mb``, its pool's budget: a lone worker keeps the layers its GPU cannot
  hold in RAM, which a group's device never does).
- Memory claims are claims: each device is clamped to ``max_credible_mb`` (what the queen can
  check) and to zero, then keeps a headroom (``HEADROOM_FRACTION`` plus ``RESERVE_MB``) for
  llama.cpp's compute buffers, which the weights never get.
- A layer is never split across devices, so capacity is checked per device after rounding
  layer counts: no member, and no device of one, is given more than it can hold.
- Fewest members first (every member adds a network round trip per token, since upstream RPC
  is a star through the head), then a set on one LAN (direct links), then lower estimated
  latency, then the sorted keys: the same swarm always gives the same plan.
- Only identical llama.cpp builds are grouped (RPC has no versioning between builds), only
  workers with the ``rpc`` capability join, and only a trusted worker is a head (members run
  the graphs the head sends).
- Layers are split in proportion to each device's usable memory (the head's less the
  non-block tensors it holds), as llama.cpp splits by free memory; contiguous ranges, head first.
- Each device's *share* (``MemberPlan.share_mb``, issue 34) is what it was planned to hold (its
  layers with their KV cache) plus the headroom kept on it for llama.cpp's compute buffers:
  the most its member's gate lets the head allocate there. Never more than the device claimed.

On a swarm of more than ``SHORTLIST`` able workers of one build the search looks at the
largest ones overall and per LAN (a bound on the work per plan); up to that it is exhaustive.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from itertools import accumulate, combinations

from shared_schema.fitting import MB, ModelShape, choose_context, kv_bytes_per_layer

__all__ = [
    "HEADROOM_FRACTION", "MAX_CREDIBLE_MB", "MAX_MEMBERS", "RESERVE_MB", "Candidate",
    "GroupPlan", "MemberPlan", "NoPlan", "NoPlanReason", "Route", "plan_group", "usable_mb",
]

HEADROOM_FRACTION = 0.10  # of each device's credible free memory, kept free
RESERVE_MB = 512  # and this much more per device: llama.cpp's compute buffers
MAX_CREDIBLE_MB = 256 * 1024  # default bound on one device's claim
MAX_MEMBERS = 8  # more members than this is too slow to be worth serving
SHORTLIST = 10  # workers per search set on a large swarm
UNKNOWN_RTT_MS = 250.0  # a worker whose latency was not measured counts as far away
MAX_RTT_MS = 60_000.0
DIRECT_RTT_MS = 1.0  # a hop on one LAN


class Route(StrEnum):
    """How the head reaches a member: itself, straight on their LAN, or through the queen."""

    LOCAL = "local"
    DIRECT = "direct"
    RELAYED = "relayed"


class NoPlanReason(StrEnum):
    FITS_ONE_WORKER = "fits_one_worker"
    NO_LAYERS = "no_layers"
    TOO_FEW_CANDIDATES = "too_few_candidates"
    NOT_ENOUGH_MEMORY = "not_enough_memory"
    NO_TRUSTED_HEAD = "no_trusted_head"
    BUILDS_DIFFER = "builds_differ"
    NO_DIRECT_ROUTE = "no_direct_route"


@dataclass(frozen=True, slots=True)
class Candidate:
    """A worker as the planner sees it. ``free_mb`` is per device, in the worker's device order
    (a RAM-only box: one entry). ``lan`` is the worker's opaque LAN hint: equal strings are one
    LAN. ``rtt_ms`` is the queen's measured round trip to it, None when unmeasured. ``trusted``:
    it may be a head (the queen trusts it, and it holds the model's file). ``alone_mb``: the
    memory it serves a model with by itself (its pool's budget), when that is not its devices'
    (None: they are); a model that fits there is no group's. ``family``: its owner's family of
    machines (issue 34): a set never mixes families, and workers without one group only with
    each other."""

    key: str
    free_mb: tuple[float, ...]
    lan: str | None = None
    rtt_ms: float | None = None
    trusted: bool = False
    build: str | None = None
    rpc: bool = False
    alone_mb: float | None = None
    family: str | None = None  # its owner's family (issue 34): grouped only within it


@dataclass(frozen=True, slots=True)
class MemberPlan:
    """One member's share: layers ``[start, end)``, split over its devices as
    ``device_layers`` (in its device order), and the bytes it holds (its layers' weights and
    KV cache; the head also the non-block tensors). ``share_mb``: per device, what it holds
    there plus the headroom kept on it, rounded up to whole MB (empty: not planned here)."""

    key: str
    start: int
    end: int
    device_layers: tuple[int, ...]
    holds_bytes: int
    usable_bytes: int
    headroom_mb: int
    route: Route
    share_mb: tuple[int, ...] = ()

    @property
    def layers(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class GroupPlan:
    """A group: the head first in ``members``, then the rest in layer order."""

    head: str
    members: tuple[MemberPlan, ...]
    build: str
    n_ctx: int
    kv_bytes_per_layer: int
    total_bytes: int
    headroom_fraction: float
    reserve_mb: int
    link_ms: float  # estimated network time per token, over all members

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(m.key for m in self.members)


@dataclass(frozen=True, slots=True)
class NoPlan:
    reason: NoPlanReason
    detail: str
    needed_mb: int
    worker: str | None = None  # FITS_ONE_WORKER: the first (by key) that holds it alone


@dataclass(frozen=True, slots=True)
class _Entry:
    candidate: Candidate
    caps: tuple[int, ...]  # usable bytes per device
    headroom_mb: int
    rtt: float
    lan: str | None
    reserves: tuple[int, ...] = ()  # bytes kept free per device (its claim less ``caps``)

    @property
    def key(self) -> str:
        return self.candidate.key

    @property
    def total(self) -> int:
        return sum(self.caps)


@dataclass(frozen=True, slots=True)
class _Model:
    prefix: tuple[int, ...]  # prefix[i]: bytes of layers [0, i), KV included
    other: int

    @property
    def need(self) -> int:
        return self.prefix[-1] + self.other


_Found = tuple[tuple[object, ...], list[_Entry], list[int]]  # score, order, device bin ends


def usable_mb(free_mb: Sequence[float], *, max_credible_mb: int = MAX_CREDIBLE_MB,
              headroom_fraction: float = HEADROOM_FRACTION,
              reserve_mb: int = RESERVE_MB) -> tuple[int, ...]:
    """Each device's usable memory: its claim bounded to ``[0, max_credible_mb]`` (anything
    that is not a finite number counts as 0), less the headroom."""
    return tuple(max(0, mb - _headroom(mb, headroom_fraction, reserve_mb))
                 for mb in (_credible(claim, max_credible_mb) for claim in free_mb))


def plan_group(shape: ModelShape, candidates: Iterable[Candidate], *, n_ctx: int | None = None,
               max_credible_mb: int = MAX_CREDIBLE_MB,
               headroom_fraction: float = HEADROOM_FRACTION, reserve_mb: int = RESERVE_MB,
               max_members: int = MAX_MEMBERS, relayed: bool = True) -> GroupPlan | NoPlan:
    """The group that serves ``shape`` at ``n_ctx`` (``fitting.choose_context``'s choice), or
    why there is none. ``relayed=False``: only groups whose members all share the head's LAN
    (while the queen cannot relay a link). Raises ``ValueError`` on two candidates with one
    key."""
    pool = list(candidates)
    twice = sorted(k for k, n in Counter(c.key for c in pool).items() if n > 1)
    if twice:
        raise ValueError(f"duplicate candidate keys: {twice}")
    context = choose_context(shape, n_ctx)
    kv = kv_bytes_per_layer(shape, context)
    costs = [max(0, int(b)) + kv for b in shape.layer_bytes]
    model = _Model(tuple(accumulate(costs, initial=0)), max(0, int(shape.other_bytes)))
    need_mb = -(-model.need // MB)
    if not costs:
        return NoPlan(NoPlanReason.NO_LAYERS, "the model has no layers to split", need_mb)
    entries = sorted((_entry(c, max_credible_mb, headroom_fraction, reserve_mb) for c in pool),
                     key=lambda e: e.key)
    for e in entries:
        alone = e.candidate.alone_mb
        ways = [e] if alone is None else [e, _entry(replace(e.candidate, free_mb=(alone,)),
                                                    max_credible_mb, headroom_fraction,
                                                    reserve_mb)]
        if any(way.total > 0 and _layout(model, [way]) is not None for way in ways):
            return NoPlan(NoPlanReason.FITS_ONE_WORKER,
                          f"worker {e.key} holds the model alone", need_mb, worker=e.key)
    entries = [e for e in entries if e.total > 0]
    able = [e for e in entries if e.candidate.rpc and e.candidate.build]
    if len(able) < 2:
        return NoPlan(NoPlanReason.TOO_FEW_CANDIDATES,
                      f"{len(able)} worker(s) with the rpc capability, a llama.cpp build and "
                      "memory; a group needs two", need_mb)
    found = _search(model, able, max_members, by_build=True, trusted_only=True,
                    direct_only=not relayed)
    if found is not None:
        return _plan(model, found, context, kv, headroom_fraction, reserve_mb)
    if not relayed and _search(model, able, max_members, by_build=True,
                               trusted_only=True) is not None:
        return NoPlan(NoPlanReason.NO_DIRECT_ROUTE,
                      "workers could hold the model together, but not workers on one LAN "
                      "with a trusted head (a link through the queen is not offered)", need_mb)
    if _search(model, able, max_members, by_build=True, trusted_only=False) is not None:
        return NoPlan(NoPlanReason.NO_TRUSTED_HEAD,
                      "workers of one build could hold the model, but none of those sets has "
                      "a trusted worker to be its head", need_mb)
    if _search(model, able, max_members, by_build=False, trusted_only=False) is not None:
        return NoPlan(NoPlanReason.BUILDS_DIFFER,
                      "workers could hold the model together, but not workers of one "
                      "llama.cpp build", need_mb)
    usable = sum(e.total for e in able) // MB
    why = (f"no {max_members} or fewer of them hold it in whole layers of up to "
           f"{max(costs) // MB} MB" if usable >= need_mb else "not enough")
    return NoPlan(NoPlanReason.NOT_ENOUGH_MEMORY,
                  f"the model needs {need_mb} MB; the {len(able)} workers that can join a group "
                  f"have {usable} MB usable: {why}", need_mb)


def _credible(claim: float, bound: int) -> int:
    if isinstance(claim, bool) or not isinstance(claim, int | float) or not math.isfinite(claim):
        return 0
    return int(min(max(claim, 0), max(bound, 0)))


def _headroom(mb: int, fraction: float, reserve_mb: int) -> int:
    return max(0, reserve_mb) + math.ceil(mb * min(max(fraction, 0.0), 1.0))


def _entry(c: Candidate, bound: int, fraction: float, reserve_mb: int) -> _Entry:
    usable = usable_mb(c.free_mb, max_credible_mb=bound, headroom_fraction=fraction,
                       reserve_mb=reserve_mb)
    credible = [_credible(claim, bound) for claim in c.free_mb]
    rtt = c.rtt_ms
    if (rtt is None or isinstance(rtt, bool) or not isinstance(rtt, int | float)
            or not math.isfinite(rtt) or rtt < 0):
        rtt = UNKNOWN_RTT_MS
    lan = c.lan.strip() if isinstance(c.lan, str) and c.lan.strip() else None
    return _Entry(c, tuple(mb * MB for mb in usable),
                  sum(min(mb, _headroom(mb, fraction, reserve_mb)) for mb in credible),
                  min(float(rtt), MAX_RTT_MS), lan,
                  tuple((mb - free) * MB for mb, free in zip(credible, usable, strict=True)))


def _bins(model: _Model, order: Sequence[_Entry]) -> list[int] | None:
    """Capacities of the devices in layer order; the head's largest device first gives room
    for the non-block tensors. None when it has not that room."""
    caps = [cap for e in order for cap in e.caps]
    head = order[0].caps
    largest = head.index(max(head))
    if caps[largest] < model.other:
        return None
    caps[largest] -= model.other
    return caps


def _layout(model: _Model, order: Sequence[_Entry]) -> list[int] | None:
    """Where each device's layers end, split in proportion to the devices' room, or None when
    the devices, in this order and whole layers each, cannot hold the model."""
    caps = _bins(model, order)
    if caps is None:
        return None
    prefix = model.prefix
    n = len(prefix) - 1
    # reach[b]: the earliest layer from which devices b.. hold every later layer (filled from
    # the end, each as full as it goes, which reaches furthest).
    reach = [n] * (len(caps) + 1)
    for b in reversed(range(len(caps))):
        end = reach[b + 1]
        reach[b] = bisect_left(prefix, prefix[end] - caps[b], 0, end + 1)
    if reach[0] > 0:
        return None
    ends: list[int] = []
    start = 0
    for b, cap in enumerate(caps):
        if b == len(caps) - 1:
            ends.append(n)
            break
        room = sum(caps[b:])
        lowest = max(start, reach[b + 1])  # what the later devices cannot take
        highest = bisect_right(prefix, prefix[start] + cap, start, n + 1) - 1
        if room == 0:
            end = lowest
        else:
            # prefix[end] nearest to prefix[start] + the remaining bytes * cap / room
            target = prefix[start] * room + (prefix[n] - prefix[start]) * cap
            above = bisect_left(prefix, -(-target // room), start, n + 1)
            end = min((i for i in (above - 1, above) if start <= i <= n),
                      key=lambda i: abs(prefix[i] * room - target))
        end = min(max(end, lowest), highest)
        ends.append(end)
        start = end
    return ends


def _link_ms(order: Sequence[_Entry]) -> float:
    """Network time per token: the head reaches each member in turn, directly on its LAN, else
    through the queen (the head's round trip to the queen and the member's)."""
    head = order[0]
    return round(sum(DIRECT_RTT_MS if _route(head, e) is Route.DIRECT else head.rtt + e.rtt
                     for e in order[1:]), 3)


def _score(order: Sequence[_Entry]) -> tuple[object, ...]:
    head = order[0]
    one_lan = head.lan is not None and all(e.lan == head.lan for e in order)
    return (not one_lan, _link_ms(order), head.rtt, tuple(sorted(e.key for e in order)),
            head.key)


def _route(head: _Entry, e: _Entry) -> Route:
    if e is head:
        return Route.LOCAL
    return Route.DIRECT if head.lan is not None and e.lan == head.lan else Route.RELAYED


def _sources(pool: list[_Entry], need: int, limit: int) -> list[list[_Entry]]:
    """The sets whose subsets are tried: the whole pool while small; else its largest workers
    (one trusted kept for a head) and those of each LAN that could hold the model alone."""
    if len(pool) <= limit:
        return [pool]

    def largest(group: list[_Entry]) -> list[_Entry]:
        ranked = sorted(group, key=lambda e: (-e.total, e.rtt, e.key))
        picked = ranked[:limit]
        if not any(e.candidate.trusted for e in picked):
            trusted = [e for e in ranked if e.candidate.trusted]
            picked = ranked[:limit - 1] + trusted[:1]
        return sorted(picked, key=lambda e: e.key)

    lans: dict[str, list[_Entry]] = {}
    for e in pool:
        if e.lan is not None:
            lans.setdefault(e.lan, []).append(e)
    return [largest(pool)] + [largest(group) for _, group in sorted(lans.items())
                              if len(group) > 1 and sum(e.total for e in group) >= need]


def _search(model: _Model, able: list[_Entry], max_members: int, *, by_build: bool,
            trusted_only: bool, direct_only: bool = False) -> _Found | None:
    pools: dict[tuple[str, str], list[_Entry]] = {}
    for e in able:  # never across owners' families (issue 34), nor builds when asked
        build = str(e.candidate.build) if by_build else ""
        pools.setdefault((build, e.candidate.family or ""), []).append(e)
    limit = max(SHORTLIST, max_members)
    sources = [s for _, pool in sorted(pools.items())
               for s in _sources(pool, model.need, limit)]
    for k in range(2, max_members + 1):
        best: _Found | None = None
        seen: set[tuple[str, ...]] = set()
        for source in sources:
            totals = sorted((e.total for e in source), reverse=True)
            if len(source) < k or sum(totals[:k]) < model.need:
                continue
            for combo in combinations(source, k):
                names = tuple(e.key for e in combo)
                if names in seen or sum(e.total for e in combo) < model.need:
                    continue
                seen.add(names)
                for head in combo:
                    if trusted_only and not head.candidate.trusted:
                        continue
                    if direct_only and (head.lan is None
                                        or any(e.lan != head.lan for e in combo)):
                        continue
                    order = [head, *(e for e in combo if e is not head)]
                    ends = _layout(model, order)
                    if ends is not None and (best is None or _score(order) < best[0]):
                        best = (_score(order), order, ends)
        if best is not None:
            return best
    return None


def _plan(model: _Model, found: _Found, context: int, kv: int, fraction: float,
          reserve_mb: int) -> GroupPlan:
    _, order, ends = found
    head = order[0]
    largest = head.caps.index(max(head.caps))  # where ``_bins`` put the non-block tensors
    members = []
    device = 0
    start = 0
    for e in order:
        first = start
        counts = []
        shares = []
        for d, reserve in enumerate(e.reserves):
            held = model.prefix[ends[device]] - model.prefix[start]
            if e is head and d == largest:
                held += model.other
            counts.append(ends[device] - start)
            shares.append(-(-(held + reserve) // MB))
            start = ends[device]
            device += 1
        holds = model.prefix[start] - model.prefix[first] + (model.other if e is head else 0)
        members.append(MemberPlan(e.key, first, start, tuple(counts), holds, e.total,
                                  e.headroom_mb, _route(head, e), tuple(shares)))
    return GroupPlan(head.key, tuple(members), str(head.candidate.build), context, kv,
                     model.need, fraction, reserve_mb, _link_ms(order))
