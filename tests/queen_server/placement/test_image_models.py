"""A hub name that the queen reads as a diffusion model (issue 38) is not placed on demand: a
worker told to fetch it would load it into llama.cpp. A text request for it is refused by name,
and no worker is sent a fetch."""

from __future__ import annotations

import pytest

from queen_server.errors import InvalidRequest
from tests.queen_server.placement.harness import MODEL, Swarm
from tests.support.diffusion_fixture import diffusion_model  # noqa: F401  (a fixture)
from tests.support.diffusion_models import WrittenModel


async def test_an_image_model_is_not_placed_on_demand(diffusion_model) -> None:  # noqa: F811
    model: WrittenModel = diffusion_model
    with model.path.open("rb") as handle:
        header = handle.read(2 << 20)  # the whole header and then some
    swarm = Swarm(header)
    try:
        swarm.add("a")
        with pytest.raises(InvalidRequest) as caught:
            await swarm.service.prepare(MODEL)
        assert (caught.value.code, caught.value.param) == ("model_makes_images", "model")
        assert "/v1/images/generations" in caught.value.message
        assert swarm.all_fetches() == []
        assert swarm.service.loading == {}
    finally:
        await swarm.service.stop()
        await swarm.catalog.close()
