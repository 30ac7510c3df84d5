"""An image model placed on demand (issue 38): a developer names a diffusion model on the hub
(the fake hub serving the tests' random SDXS-512-DS file) that no worker holds. A real queen
reads its header, prices it, and sends the fetch to the one real worker whose owner turned
images on (``WorkerService`` with ``images``), never to the text worker beside it (a key that
cannot pay is refused first, before the hub is read); the developer
hears ``model_loading`` with an estimate while the file downloads, then gets a PNG rendered by
the worker's sandboxed image child. A chat request to the same name is refused by name, and
the ledger is clean. The same again for the model published as most diffusion models are, a
single-file safetensors checkpoint in a repo of no GGUF files (named by its file), whose header
the queen reads with Range requests too."""

from __future__ import annotations

import base64
import io

import openai
import pytest
from PIL import Image

from tests.support.diffusion_fixture import (  # noqa: F401  (fixtures)
    diffusion_model,
    safetensors_diffusion_model,
)
from tests.support.diffusion_models import WrittenModel
from tests.support.fake_hub import FakeHub, FakeRepo
from tests.support.on_demand import worker
from tests.support.queen import running_queen

# (fixture, repo, its files, the name a developer asks for)
PUBLISHED = {
    "gguf": ("diffusion_model", "org/tiny-sd-GGUF", "sdxs-512-ds-Q4_0.gguf",
             "org/tiny-sd-GGUF:Q4_0"),
    "safetensors": ("safetensors_diffusion_model", "org/tiny-sd", "sdxs_512_ds_fp16.safetensors",
                    "org/tiny-sd:sdxs_512_ds_fp16"),
}
EXTRA = {"seed": 5, "steps": 2, "guidance": 1.0}

pytestmark = pytest.mark.timeout(600)


@pytest.mark.parametrize("published", sorted(PUBLISHED))
async def test_an_image_model_nobody_holds_is_fetched_onto_an_image_worker_and_renders(
        tmp_path, request, published: str) -> None:
    fixture, repo, file, name = PUBLISHED[published]
    model: WrittenModel = request.getfixturevalue(fixture)
    files = {file: model.path, "README.md": b"# a test model"}
    with FakeHub([FakeRepo(repo, files)]) as hub:
        async with running_queen(tmp_path, auth="keys", hub_endpoint=hub.url, model_wait_s=0,
                                 audits=False, total_timeout_s=300,
                                 first_token_timeout_s=300) as queen, \
                worker(tmp_path, queen, hub, "text", memory_budget_mb=16_000) as text, \
                worker(tmp_path, queen, hub, "artist", images=True, memory_budget_mb=8192,
                       threads=2) as artist:
            poor, _ = await queen.funded_key(0)
            with pytest.raises(openai.APIStatusError) as unpaid:
                await queen.client(api_key=poor).images.generate(
                    model=name, prompt="a hive", size="64x64", extra_body=EXTRA)
            assert unpaid.value.status_code == 402
            assert hub.count() == 0  # a key that cannot pay makes the queen read nothing

            secret, _ = await queen.funded_key(1000)
            client = queen.client(api_key=secret, timeout=300)
            with pytest.raises(openai.APIStatusError) as loading:
                await client.images.generate(model=name, prompt="a hive", size="64x64",
                                             extra_body=EXTRA)
            assert loading.value.status_code == 503
            assert loading.value.body["code"] == "model_loading"
            assert loading.value.body["estimated_time"] > 0
            record = queen.state.registry.get(artist.identity.pubkey)
            await queen.wait_until(lambda: name in record.models, 120,
                                   "the image worker holds the model")
            assert record.models[name].kind == "image"
            assert record.models[name].sha256 == model.sha256

            answer = await client.images.generate(model=name, prompt="a hive", size="64x64",
                                                  extra_body=EXTRA)
            image = Image.open(io.BytesIO(base64.b64decode(answer.data[0].b64_json)))
            image.load()
            assert (image.format, image.size) == ("PNG", (64, 64))
            assert len(set(image.tobytes())) > 1  # not a blank image
            # the request counts as the model's demand (a busy one gets another copy placed)
            assert name in {row.name for row in queen.state.placement.book.rows()}

            with pytest.raises(openai.BadRequestError) as refused:
                await client.chat.completions.create(
                    model=name, messages=[{"role": "user", "content": "hi"}])
            assert refused.value.body["code"] == "model_makes_images"

            assert name not in text.store  # the text worker was never sent it
            assert name in artist.store
            assert artist.pool.loaded() == frozenset()  # never loaded into llama.cpp
            assert (await queen.state.billing.ledger.check()).clean
