"""The queen prices a diffusion model by its own reading of the hub file (issue 38): the real
``huggingface_hub`` client against the fake hub, Range reads of the header only, the family and
parameter count read as stable-diffusion.cpp would; the model card then says it is verified,
an image model, with its parameters, and its price comes from that reading, not a worker's
claim. A file that is neither an LLM's GGUF nor a diffusion model stays unverified. A
single-file safetensors checkpoint is read the same way; one that cannot render from its one
file (no VAE) stays unverified, naming what it lacks."""

from __future__ import annotations

import contextlib

import openai

from queen_server.catalog import ModelCatalog
from queen_server.catalog.hub import HubFiles
from tests.shared_schema.test_diffusion_check import SD1_TABLE, safetensors, table
from tests.support.diffusion_fixture import (  # noqa: F401  (fixtures)
    diffusion_model,
    safetensors_diffusion_model,
)
from tests.support.diffusion_models import WrittenModel
from tests.support.fake_hub import FakeHub, FakeRepo
from tests.support.image_workers import ImageWorker
from tests.support.queen import running_queen

REPO = "org/tiny-sd-GGUF"
NAME = f"{REPO}:Q4_0"
FILE = "sdxs-512-ds-Q4_0.gguf"


async def test_a_diffusion_gguf_is_read_from_its_header_alone(diffusion_model) -> None:  # noqa: F811
    model: WrittenModel = diffusion_model
    with FakeHub([FakeRepo(REPO, {FILE: model.path})]) as hub:
        catalog = ModelCatalog(HubFiles(hub.url))
        await catalog.settle(NAME)
        facts = catalog.facts(NAME)
        assert facts is not None, catalog.problem(NAME)
        assert facts.parameter_count == model.parameter_count
        assert facts.architecture == "diffusion:sdxs"
        assert facts.sha256 == model.sha256
        assert facts.size_bytes == model.size_bytes
        reads = [r.range for r in hub.requests if r.method == "GET" and r.path.endswith(".gguf")]
        assert reads
        assert all(r is not None and r.startswith("bytes=0-") for r in reads)  # never whole


async def test_a_file_that_is_no_model_stays_unverified() -> None:
    with FakeHub([FakeRepo(REPO, {FILE: b"GGUF" + bytes(4096)})]) as hub:
        catalog = ModelCatalog(HubFiles(hub.url))
        await catalog.settle(NAME)
        assert catalog.facts(NAME) is None
        assert catalog.status(NAME) == "unverified"


async def test_the_card_and_the_price_come_from_the_queens_reading(tmp_path,
                                                                   diffusion_model) -> None:  # noqa: F811
    model: WrittenModel = diffusion_model
    with FakeHub([FakeRepo(REPO, {FILE: model.path})]) as hub:
        async with running_queen(tmp_path, hub_endpoint=hub.url) as queen:
            worker = await ImageWorker(queen.ws_url, models=[NAME]).start()
            await queen.state.catalog.settle(NAME)
            cards = {card.id: card.model_extra["apiary"]
                     for card in (await queen.client().models.list()).data}
            card = cards.get(NAME)
            assert card is not None
            assert card["kind"] == "image"
            assert card["parameter_count"] == model.parameter_count  # not the claim of 450 M
            assert card["price"]["basis"] == "verified"
            price = queen.state.price_of(NAME)
            assert card["price"]["size_class"] == price.size_class
            await worker.stop()


async def test_a_worker_holding_another_file_under_the_name_gets_no_image_job(
        tmp_path, diffusion_model) -> None:  # noqa: F811
    """The name is pinned to the file the queen read: a worker whose file has another sha256
    (the scripted one's) is not used for it, and alone cannot serve it."""
    model: WrittenModel = diffusion_model
    with FakeHub([FakeRepo(REPO, {FILE: model.path})]) as hub:
        async with running_queen(tmp_path, hub_endpoint=hub.url) as queen:
            other = await ImageWorker(queen.ws_url, models=[NAME]).start()
            await queen.state.catalog.settle(NAME)
            client = queen.client()
            with contextlib.suppress(openai.APIStatusError):
                await client.images.generate(model=NAME, prompt="x", size="64x64")
            assert other.orders == []
            await other.stop()


async def test_a_safetensors_checkpoint_is_read_from_its_header_alone(
        safetensors_diffusion_model) -> None:  # noqa: F811
    """Most diffusion models are published so: one .safetensors file in a repo of no GGUF
    files, named by its file. Its 8-byte length, then its JSON header, by Range reads."""
    model: WrittenModel = safetensors_diffusion_model
    repo, file = "org/tiny-sd", "sdxs_512_ds_fp16.safetensors"
    with FakeHub([FakeRepo(repo, {file: model.path, "README.md": "# sd"})]) as hub:
        catalog = ModelCatalog(HubFiles(hub.url))
        name = f"{repo}:sdxs_512_ds_fp16"
        await catalog.settle(name)
        facts = catalog.facts(name)
        assert facts is not None, catalog.problem(name)
        assert (facts.architecture, facts.parameter_count) == ("diffusion:sdxs",
                                                               model.parameter_count)
        assert (facts.sha256, facts.size_bytes) == (model.sha256, model.size_bytes)
        reads = [r.range for r in hub.requests if r.method == "GET" and r.path.endswith(file)]
        assert reads
        assert all(r is not None and r.startswith("bytes=0-") for r in reads)  # never whole


async def test_a_model_that_cannot_render_from_its_one_file_stays_unverified() -> None:
    """An SD 1.x checkpoint without its VAE: a worker would download it and then refuse it
    (it loads a model from one file), so the queen neither pins nor places it."""
    entries = table([entry for entry in SD1_TABLE if not entry[0].startswith("first_stage")])
    repo, file = "org/no-vae", "sd15-no-vae.safetensors"
    with FakeHub([FakeRepo(repo, {file: safetensors(entries)})]) as hub:
        catalog = ModelCatalog(HubFiles(hub.url))
        name = f"{repo}:sd15-no-vae"
        await catalog.settle(name)
        assert catalog.facts(name) is None
        problem = catalog.problem(name)
        assert problem is not None
        assert "without its VAE" in problem
