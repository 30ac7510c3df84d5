"""A model no worker holds and none can hold alone (issue 19): the queen fetches it onto the
worker that is to lead its group (trusted, with the ``rpc`` backend and room for the file), as
a download-only ``fetch``, keeps every worker from serving it alone meanwhile, and forms the
group once the head holds it. The hostile parties: workers the queen does not trust, or that
lack the RPC backend or the room they would need, are never made to fetch it; a head that fails
its download is replaced, then the model is given up cleanly."""

from __future__ import annotations

import asyncio

import pytest

from queen_server.errors import ModelLoading, NoCapacity, WorkerFailed
from shared_schema import Fetch, FetchFailed, GroupServe
from tests.queen_server.placement.group_harness import Groups, sizes
from tests.queen_server.placement.harness import MODEL, WAIT, settle


def with_placement(groups: Groups) -> Groups:
    groups.swarm.service.groups = groups.service
    return groups


def fetches(groups: Groups) -> dict[str, Fetch]:
    return {name: f for name, f in groups.swarm.all_fetches() if f.name == MODEL}


async def test_the_would_be_head_fetches_the_file_then_the_group_forms(groups: Groups) -> None:
    with_placement(groups)
    head, each = sizes(groups)
    groups.add("head", head)  # trusted (``group_heads``), holds nothing
    groups.add("m1", each)
    groups.add("m2", each)
    swarm = groups.swarm
    waiting = asyncio.create_task(swarm.service.prepare(MODEL))
    name, fetch = await swarm.next_frame()
    assert name == "head"
    assert fetch.group  # download and check only: the model does not fit it alone
    await settle(waiting)
    assert swarm.no_frame()  # no member was asked to download anything
    assert MODEL in groups.service.group_only
    assert "downloading" in groups.service.outcomes[MODEL]
    groups.service.prepare(MODEL)  # while it downloads: placement's wait, no 503 of its own
    swarm.holds(swarm.workers["head"], MODEL)
    await asyncio.wait_for(waiting, WAIT)
    assert groups.holders() == set()  # it holds the file, but serves it only as a group's head
    with pytest.raises(ModelLoading) as loading:
        groups.service.prepare(MODEL)  # held, the group not planned yet
    assert loading.value.code == "model_loading"
    await groups.service.tick()
    group = groups.service.by_model[MODEL]
    assert group.head is swarm.workers["head"]
    assert {w.public_id for w in group.members.values()} == {"m1", "m2"}
    for member in ("m1", "m2"):
        assert isinstance(await groups.frame(member, GroupServe), GroupServe)
    assert MODEL not in groups.service.fetching
    assert MODEL not in groups.service.fetched


async def test_the_estimate_counts_the_group_s_load(groups: Groups) -> None:
    with_placement(groups)
    head, each = sizes(groups)
    for name, memory_mb in (("head", head), ("m1", each), ("m2", each)):
        groups.add(name, memory_mb)
    groups.swarm.settings.model_wait_s = 0.0  # answer at once with the estimate
    with pytest.raises(ModelLoading) as caught:
        await groups.swarm.service.prepare(MODEL)
    loading = groups.swarm.service.loading[MODEL]
    assert loading.group
    download_s = loading.need.size_bytes / (groups.swarm.settings.assumed_download_mb_s * 2**20)
    assert caught.value.extra["estimated_time"] == pytest.approx(
        download_s + groups.service.load_estimate_s(loading.need.size_bytes), abs=0.1)


@pytest.mark.parametrize("who", ["untrusted", "no_rpc", "no_room", "no_fetch"])
async def test_only_a_trusted_rpc_worker_with_room_is_made_to_fetch_for_a_group(
        groups: Groups, who: str) -> None:
    """A would-be head the queen cannot trust, or that could not lead (no RPC backend, no room
    for the file, no fetches), is never sent the fetch; with no other, the request gets
    ``no_worker_fits`` with the planner's reason, and nothing is left group-only."""
    with_placement(groups)
    head, each = sizes(groups)
    bad = groups.add("head" if who != "untrusted" else "stranger", head,
                     rpc=who != "no_rpc")
    if who == "no_room":
        bad.model_room_mb = 10  # MB: the file is 100
    if who == "no_fetch":
        bad.capabilities = bad.capabilities - {"fetch"}
    groups.add("m1", each)
    groups.add("m2", each)
    with pytest.raises(NoCapacity) as caught:
        await groups.swarm.service.prepare(MODEL)
    assert caught.value.code == "no_worker_fits"
    assert "No group of workers can serve it together either" in caught.value.message
    assert fetches(groups) == {}
    assert MODEL not in groups.service.group_only
    assert MODEL not in groups.service.fetching


async def test_a_head_that_fails_its_download_is_replaced_then_the_model_given_up(
        groups: Groups) -> None:
    with_placement(groups)
    groups.swarm.settings.max_fetch_attempts = 2
    groups.settings.group_heads = ["head", "head2"]
    head, each = sizes(groups)
    groups.add("head", head)
    groups.add("head2", head)
    groups.add("m1", each)
    groups.add("m2", each)
    swarm = groups.swarm
    waiting = asyncio.create_task(swarm.service.prepare(MODEL))
    first, fetch = await swarm.next_frame()
    assert first in ("head", "head2")
    assert fetch.group
    swarm.service.fetch_failed(swarm.workers[first], FetchFailed(
        name=MODEL, code="sha256_mismatch", message="not the file named"))
    second, fetch = await swarm.next_frame()
    assert {first, second} == {"head", "head2"}
    assert fetch.group
    assert groups.service.fetching[MODEL] == swarm.workers[second].key
    swarm.service.fetch_failed(swarm.workers[second], FetchFailed(
        name=MODEL, code="disk_full", message="no room"))
    with pytest.raises(WorkerFailed) as caught:
        await asyncio.wait_for(waiting, WAIT)
    assert caught.value.code == "fetch_failed"
    assert MODEL not in groups.service.fetching
    assert MODEL not in groups.service.group_only
    assert "could not download" in groups.service.outcomes[MODEL]


async def test_a_group_s_head_downloading_is_not_planned_around(groups: Groups) -> None:
    """While the head downloads, the group loop plans nothing for the model (it would find no
    head and take the model out of group-only, letting a lone holder serve it)."""
    with_placement(groups)
    head, each = sizes(groups)
    for name, memory_mb in (("head", head), ("m1", each), ("m2", each)):
        groups.add(name, memory_mb)
    waiting = asyncio.create_task(groups.swarm.service.prepare(MODEL))
    await groups.swarm.next_frame()
    await groups.service.tick()
    assert MODEL in groups.service.group_only
    assert MODEL not in groups.service.by_model
    assert "downloading" in groups.service.outcomes[MODEL]
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
