"""Diffusion models placed on demand (issue 38): a hub name the queen reads as a diffusion model
is placed, for an image request, only on a worker with the ``image`` capability, with a fetch of
``kind`` ``image`` and the memory its image child is allowed; a request of the other
kind is refused by name before the hub is asked for more or any worker is sent a fetch."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from queen_server.errors import InvalidRequest, NoCapacity
from shared_schema import ModelDescriptor
from shared_schema.images import diffusion_memory_mb
from tests.queen_server.placement.harness import MODEL, Swarm, settle
from tests.support.diffusion_fixture import diffusion_model  # noqa: F401  (a fixture)
from tests.support.diffusion_models import WrittenModel

TEXT = "org/text-GGUF:Q4_K_M"  # a second repo whose header is the test GGUF LLM's


@pytest.fixture
async def swarm(diffusion_model: WrittenModel) -> AsyncIterator[Swarm]:  # noqa: F811
    """A swarm whose hub's ``MODEL`` (100 MB listed) reads as the random SDXS model."""
    with diffusion_model.path.open("rb") as handle:
        header = handle.read(2 << 20)  # the whole header and then some
    swarm = Swarm(header)
    try:
        yield swarm
    finally:
        await swarm.service.stop()
        await swarm.catalog.close()


async def test_an_image_model_is_placed_only_on_a_worker_that_makes_images(swarm) -> None:
    text = swarm.add("text", memory_mb=64_000, swarm_models=True)  # more room, preferred else
    image = swarm.add("image", images=True)
    task = asyncio.create_task(swarm.service.prepare(MODEL, kind="image"))
    name, fetch = await swarm.next_frame()
    assert name == "image"
    assert (fetch.name, fetch.kind, fetch.group) == (MODEL, "image", False)
    loading = swarm.service.loading[MODEL]
    assert loading.need.kind == "image"
    assert loading.need.memory_mb == diffusion_memory_mb(fetch.size_bytes)
    swarm.report(image, models=[ModelDescriptor(name=MODEL, sha256=fetch.sha256, loaded=False,
                                                kind="image")])
    await asyncio.wait_for(task, 5)  # the worker holds it: the request goes on
    assert MODEL not in swarm.service.loading
    assert swarm.connections["text"].fetches() == []
    assert text.downloads == {}


async def test_a_text_request_for_a_diffusion_model_is_refused_before_any_fetch(swarm) -> None:
    swarm.add("a", images=True)
    with pytest.raises(InvalidRequest) as caught:
        await swarm.service.prepare(MODEL)
    assert (caught.value.code, caught.value.param) == ("model_makes_images", "model")
    assert "/v1/images/generations" in caught.value.message
    assert swarm.all_fetches() == []
    assert swarm.service.loading == {}


async def test_an_image_request_for_a_text_model_is_refused_before_any_fetch(
        swarm, header: bytes) -> None:
    swarm.reader.add(TEXT, 100 << 20)
    swarm.reader.read_prefix = lambda repo, commit, path, n: (  # type: ignore[method-assign]
        header[:n] if repo == TEXT.partition(":")[0] else swarm.reader.header[:n])
    swarm.add("a", images=True)
    with pytest.raises(InvalidRequest) as caught:
        await swarm.service.prepare(TEXT, kind="image")
    assert (caught.value.code, caught.value.param) == ("model_not_image", "model")
    assert swarm.all_fetches() == []


async def test_a_text_request_joining_an_image_placement_is_refused(swarm) -> None:
    swarm.add("image", images=True)
    first = asyncio.create_task(swarm.service.prepare(MODEL, kind="image"))
    await swarm.next_frame()
    with pytest.raises(InvalidRequest) as caught:
        await swarm.service.prepare(MODEL)
    assert caught.value.code == "model_makes_images"
    assert len(swarm.all_fetches()) == 1  # the image placement goes on, alone
    first.cancel()
    await settle(first)


async def test_with_no_worker_that_makes_images_the_answer_says_so(swarm) -> None:
    swarm.add("text", memory_mb=64_000)
    with pytest.raises(NoCapacity) as caught:
        await swarm.service.prepare(MODEL, kind="image")
    assert caught.value.code == "no_worker_fits"
    assert "takes image models" in caught.value.message
    assert swarm.all_fetches() == []


async def test_an_image_worker_without_the_memory_for_the_largest_image_is_passed_over(
        swarm) -> None:
    need_mb = diffusion_memory_mb(100 << 20)
    swarm.add("small", images=True, memory_mb=need_mb - 1)
    with pytest.raises(NoCapacity) as caught:
        await swarm.service.prepare(MODEL, kind="image")
    assert f"{need_mb:,} MB of memory" in caught.value.message
    swarm.clock.now += 60  # the remembered answer expires; a worker that fits has come
    swarm.add("big", images=True, memory_mb=need_mb)
    task = asyncio.create_task(swarm.service.prepare(MODEL, kind="image"))
    name, fetch = await swarm.next_frame()
    assert (name, fetch.kind) == ("big", "image")
    task.cancel()
    await settle(task)


async def test_unmet_image_demand_places_another_copy_on_another_image_worker(swarm) -> None:
    first = swarm.add("first", images=True, room_mb=900_000)
    swarm.add("text", memory_mb=64_000, swarm_models=True)
    swarm.add("second", images=True)
    task = asyncio.create_task(swarm.service.prepare(MODEL, kind="image"))
    name, fetch = await swarm.next_frame()
    assert name == "first"
    swarm.report(first, models=[ModelDescriptor(name=MODEL, sha256=fetch.sha256, loaded=False,
                                                kind="image")])
    await asyncio.wait_for(task, 5)
    swarm.service.started(MODEL, 3.0)  # image requests that waited for a busy holder
    await swarm.service.tell_demand()
    [row] = swarm.service.demand.models
    assert (row.name, row.kind) == (MODEL, "image")
    assert row.memory_mb == diffusion_memory_mb(fetch.size_bytes)
    await swarm.service.add_copies()
    name, copy = await swarm.next_frame()
    assert (name, copy.kind) == ("second", "image")  # never the text worker
    assert swarm.connections["text"].fetches() == []
