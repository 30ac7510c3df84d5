"""The group service plans each worker by the devices it gives a group (issue 19,
``Worker.device_free_mb``), not by its pool's RAM budget: a worker's RPC server serves its GPUs,
so a share planned from the budget would not load there. A two-GPU worker gets one layer count
per GPU and a ``GroupServe`` for both; a worker whose budget is large but whose GPU is small is
given only what its GPU holds; an older worker (no figure) is planned by its budget as before.
The harness's model: 8 layers of about 5 MB (KV included) and 68 MB of other tensors, no
headroom."""

from __future__ import annotations

import asyncio

from queen_server.groups import GroupPlan, plan_group
from queen_server.groups.planner import MAX_CREDIBLE_MB
from shared_schema import GroupLead, GroupServe
from shared_schema.fitting import MB
from shared_schema.hardware import MAX_VRAM_MB
from tests.queen_server.groups.oracle import llama70b
from tests.queen_server.placement.group_harness import Groups, need_mb, sizes
from tests.queen_server.placement.harness import MODEL


async def test_a_two_gpu_member_gets_a_count_per_gpu_and_serves_both(groups: Groups) -> None:
    head, _ = sizes(groups)
    groups.add("head", head, holds=True)  # an older worker: its budget, one device
    pair = groups.add("pair", 60)  # a 60 MB budget, too small to serve the model alone
    pair.device_free_mb = (16, 16)
    await groups.service.tick()
    plan = groups.service.by_model[MODEL].plan
    assert [(m.key, m.device_layers) for m in plan.members] == [
        (groups.swarm.workers["head"].key, (2,)), (pair.key, (3, 3))]
    serve = await groups.frame("pair", GroupServe)
    assert isinstance(serve, GroupServe)
    assert (serve.devices, serve.layers) == (2, 6)
    groups.ready("pair", serve)
    lead = await groups.frame("head", GroupLead)
    assert isinstance(lead, GroupLead)
    assert lead.head_layers == [2]
    assert [m.device_layers for m in lead.members] == [[3, 3]]


async def test_a_large_budget_on_a_small_gpu_is_given_only_what_the_gpu_holds(
        groups: Groups) -> None:
    """The bug this fixes: planned by its 100 MB budget, ``gamer`` would take the six layers
    the head leaves (32 MB) onto a GPU with 12 MB free, and its RPC server would fail the
    load. By its device it holds two, and a third worker the rest."""
    head, _ = sizes(groups)
    groups.add("head", head, holds=True)
    gamer = groups.add("gamer", 100)  # RAM budget: not the model's 108 MB, so no lone server
    gamer.device_free_mb = (12,)
    assert groups.service._candidates(MODEL, "")[1].free_mb == (12.0,)
    await groups.service.tick()
    assert MODEL not in groups.service.by_model  # head + gamer's GPU cannot hold it
    groups.add("third", 25)  # four layers: with the head still two short
    await groups.service.tick()
    plan = groups.service.by_model[MODEL].plan
    [share] = [m for m in plan.members if m.key == gamer.key]
    assert share.device_layers == (2,)
    assert share.holds_bytes <= 12 * MB
    serve = await asyncio.wait_for(groups.frame("gamer", GroupServe), 5)
    assert (serve.devices, serve.layers) == (1, 2)  # type: ignore[attr-defined]


async def test_a_budget_that_holds_the_model_keeps_it_out_of_groups(groups: Groups) -> None:
    """A worker whose pool serves the model alone (in RAM, what its GPU cannot hold) makes it
    no group's, however small its GPU: routing serves it as before groups."""
    head, each = sizes(groups)
    groups.add("head", head, holds=True)
    groups.add("m1", each)
    roomy = groups.add("roomy", need_mb(groups) + 20)
    roomy.device_free_mb = (8,)
    await groups.service.tick()
    assert MODEL not in groups.service.by_model
    assert groups.service.outcomes[MODEL].startswith("fits_one_worker")


def test_absurd_device_figures_are_clamped_by_the_planner(groups: Groups) -> None:
    """A worker claiming 16 TiB on each device (and as its budget) is believed up to
    ``max_credible_mb`` per device: on a model larger than that it is one member of a group
    and holds no more than the bound allows."""
    shape = llama70b(layers=80, layer_mb=8_000)  # 640 GB: more than two credible devices
    head = groups.add("head", 100_000, holds=True)
    liar = groups.add("liar", MAX_VRAM_MB)
    liar.device_free_mb = (MAX_VRAM_MB, MAX_VRAM_MB)
    helper = groups.add("helper", 150_000)
    helper.device_free_mb = (80_000, 80_000)
    facts = groups.swarm.catalog.pin(MODEL)
    assert facts is not None
    candidates = groups.service._candidates(MODEL, facts.sha256)
    plan = plan_group(shape, candidates, headroom_fraction=0.0, reserve_mb=0)
    assert isinstance(plan, GroupPlan), plan
    assert plan.head == head.key
    [share] = [m for m in plan.members if m.key == liar.key]
    assert len(share.device_layers) == 2
    assert share.usable_bytes == 2 * MAX_CREDIBLE_MB * MB
    assert share.holds_bytes <= 2 * MAX_CREDIBLE_MB * MB
    assert helper.key in plan.keys  # the liar's claim alone did not make the group
