"""``/v1/images/generations`` through the official ``openai`` SDK against a real queen and
scripted image workers over real websockets (issue 38): images of the requested size and
format, ``n``, links kept for a limited time, the queen's own bill and the worker's credit,
every refusal naming its field before anything runs, and the hostile workers (wrong size,
garbage, too few images, wrong seeds, a lying usage) passed over without a client seeing their
images or paying for them. The real engine's path: ``tests/e2e/test_images.py``."""

from __future__ import annotations

import base64
import io
from datetime import UTC, datetime, timedelta

import httpx
import openai
import pytest
from PIL import Image
from sqlalchemy import update

from queen_server.billing import ledger
from queen_server.images.orders import image_tokens
from queen_server.storage.tables import ImageLinkRow
from shared_schema import Usage
from shared_schema.images import ImageOrder
from tests.support.image_workers import IMAGE_MODEL, ImageWorker, picture
from tests.support.queen import QueenHarness, running_queen
from tests.support.workers import ECHO_MODEL, ScriptedWorker

EXTRA = {"seed": 41, "steps": 4}


@pytest.fixture
async def queen(tmp_path, db_url):
    async with running_queen(tmp_path, auth="keys", db=db_url, files_dir=tmp_path / "files",
                             escrow_jobs=0) as queen:
        yield queen


async def funded_key(queen: QueenHarness, sats: float) -> str:
    return (await queen.funded_key(sats))[0]


async def balance(queen: QueenHarness, account: str) -> int:
    return (await queen.state.billing.ledger.balances()).get(account, 0)


async def key_available(queen: QueenHarness, secret: str) -> int:
    principal = await queen.state.billing.authenticate(f"Bearer {secret}")
    assert principal.key is not None
    return await balance(queen, ledger.key_available(principal.key.id))


def decoded(b64: str) -> Image.Image:
    image = Image.open(io.BytesIO(base64.b64decode(b64)))
    image.load()
    return image


async def proven(queen: QueenHarness, worker: ImageWorker, client: openai.AsyncOpenAI) -> None:
    """A new worker's first job is its unpaid proof of work, as for text."""
    await client.images.generate(model=IMAGE_MODEL, prompt="proof", size="64x64",
                                 extra_body=EXTRA)


async def test_images_of_the_size_asked_are_billed_by_the_queens_count(queen):
    worker = await ImageWorker(queen.ws_url, claims=Usage(prompt_tokens=0,
                                                          completion_tokens=10**6,
                                                          total_tokens=10**6)).start()
    secret = await funded_key(queen, 1000)
    client = queen.client(api_key=secret)
    start = await key_available(queen, secret)
    await proven(queen, worker, client)
    before = await key_available(queen, secret)
    # The first image of a new worker is its unpaid proof of work, as for text: charged to
    # the client, the whole charge the queen's.
    assert await balance(queen, ledger.worker_available(worker.pubkey)) == 0
    assert await balance(queen, ledger.worker_pending(worker.pubkey)) == 0
    assert await balance(queen, ledger.QUEEN_FEES) == start - before > 0
    earned = await balance(queen, ledger.worker_available(worker.pubkey))
    answer = await client.images.generate(model=IMAGE_MODEL, prompt="a hive at dawn",
                                          size="128x64", n=2, extra_body=EXTRA)
    assert len(answer.data) == 2
    images = [decoded(item.b64_json) for item in answer.data]
    assert [(image.format, image.size) for image in images] == [("PNG", (128, 64))] * 2
    order = worker.orders[-1]
    assert (order.seed, order.n, order.steps, order.width, order.height) == (41, 2, 4, 128, 64)
    assert base64.b64decode(answer.data[1].b64_json) == picture(order, 42)
    assert answer.size == "128x64"
    assert answer.output_format == "png"
    apiary = answer.model_extra["apiary"]
    assert apiary["seeds"] == [41, 42]
    assert apiary["steps"] == 4
    tokens = image_tokens(order, queen.state.settings.image_tokens_per_megapixel_step)
    assert apiary["billed_tokens"] == tokens
    price = queen.state.price_of(IMAGE_MODEL)
    charged = before - await key_available(queen, secret)
    assert charged == price.cost_msat(0, tokens)  # the worker's claim of 10**6 tokens: ignored
    credited = await balance(queen, ledger.worker_available(worker.pubkey)) - earned
    assert credited == int(charged * queen.state.settings.worker_share)
    assert (await queen.state.billing.ledger.check()).clean
    await worker.stop()


async def test_a_seed_left_out_is_drawn_and_answered(queen):
    worker = await ImageWorker(queen.ws_url).start()
    client = queen.client(api_key=await funded_key(queen, 1000))
    answer = await client.images.generate(model=IMAGE_MODEL, prompt="x", size="64x64",
                                          output_format="jpeg", output_compression=50)
    seed = answer.model_extra["apiary"]["seed"]
    assert worker.orders[-1].seed == seed
    assert 0 <= seed < 2**32
    assert worker.orders[-1].steps == 20  # quality auto
    assert decoded(answer.data[0].b64_json).format == "JPEG"
    await worker.stop()


async def test_a_url_answer_is_served_until_it_expires_then_swept(queen):
    worker = await ImageWorker(queen.ws_url).start()
    client = queen.client(api_key=await funded_key(queen, 1000))
    answer = await client.images.generate(model=IMAGE_MODEL, prompt="x", size="64x64",
                                          response_format="url", output_format="webp",
                                          extra_body=EXTRA)
    url = answer.data[0].url
    assert url.startswith(queen.base_url + "/v1/images/files/")
    assert url.endswith(".webp")
    async with httpx.AsyncClient(trust_env=False) as http:
        got = await http.get(url)
        assert got.status_code == 200
        assert got.headers["content-type"] == "image/webp"
        assert got.content == picture(worker.orders[-1], 41)
        token = url.rsplit("/", 1)[1]
        guessed = url.replace(token, "A" * 43 + ".webp")
        assert (await http.get(guessed)).status_code == 404
        assert (await http.get(url.replace(".webp", ".png"))).status_code == 404
        async with queen.state.db.engine.begin() as conn:  # its time is up
            await conn.execute(update(ImageLinkRow).values(
                expires_at=datetime.now(UTC) - timedelta(seconds=1)))
        gone = await http.get(url)
        assert gone.status_code == 404
        assert gone.json()["error"]["code"] == "image_not_found"
    kept = list((queen.state.settings.files_dir / "images").iterdir())
    assert len(kept) == 1
    assert await queen.state.image_links.sweep() == 1
    assert list((queen.state.settings.files_dir / "images").iterdir()) == []
    await worker.stop()


@pytest.mark.parametrize(("body", "param", "code"), [
    ({"size": "65x64"}, "size", "invalid_value"),
    ({"size": "4096x4096"}, "size", "invalid_value"),
    ({"n": 5}, "n", None),
    ({"n": 4, "size": "1024x1024"}, None, None),  # over the pixels of one order
    ({"style": "vivid"}, "style", "unsupported_parameter"),
    ({"moderation": "low"}, "moderation", "unsupported_parameter"),
    ({"background": "transparent"}, "background", None),
    ({"output_format": "gif"}, "output_format", None),
    ({"output_compression": 50}, None, None),  # png
    ({"stream": True}, "stream", None),
    ({"steps": 0}, "steps", None),
    ({"sampler": "ddim"}, "sampler", None),
    ({"frobnicate": 1}, "frobnicate", "unknown_parameter"),
    # stable-diffusion.cpp would open the path on the volunteer's machine
    ({"prompt": "a cat <lora:/home/me/.ssh/id_ed25519:1>"}, "prompt", None),
    ({"negative_prompt": "<LoRA : ../../key:1>"}, "negative_prompt", None),
])
async def test_a_bad_request_is_a_400_naming_its_field_and_runs_nothing(queen, body, param,
                                                                       code):
    worker = await ImageWorker(queen.ws_url).start()
    secret = await funded_key(queen, 1000)
    before = await key_available(queen, secret)
    async with httpx.AsyncClient(base_url=queen.base_url, trust_env=False) as http:
        answer = await http.post("/v1/images/generations",
                                 headers={"Authorization": f"Bearer {secret}"},
                                 json={"model": IMAGE_MODEL, "prompt": "x", **body})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    assert worker.orders == []
    assert await key_available(queen, secret) == before
    await worker.stop()


async def test_models_of_the_other_kind_are_refused_by_name(queen):
    images = await ImageWorker(queen.ws_url).start()
    text = await ScriptedWorker(queen.ws_url).start()
    client = queen.client(api_key=await funded_key(queen, 1000))
    with pytest.raises(openai.BadRequestError) as caught:
        await client.images.generate(model=ECHO_MODEL, prompt="x", size="64x64")
    assert caught.value.body["code"] == "model_not_image"
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(model=IMAGE_MODEL,
                                             messages=[{"role": "user", "content": "hi"}])
    assert caught.value.body["code"] == "model_makes_images"
    with pytest.raises(openai.NotFoundError):
        await client.images.generate(model="nobody/holds-this", prompt="x", size="64x64")
    kinds = {model.id: model.model_extra["apiary"]["kind"]
             for model in (await client.models.list()).data}
    assert kinds == {IMAGE_MODEL: "image", ECHO_MODEL: "text"}
    assert images.orders == []
    assert text.jobs == []
    await images.stop()
    await text.stop()


async def test_a_text_worker_holding_the_name_never_gets_an_image_job(queen):
    """A hostile worker claims an image model's name as a text model: image jobs never go to
    it, and while an honest holder is connected text requests for the name are not refused."""
    honest = await ImageWorker(queen.ws_url).start()
    claimer = await ScriptedWorker(queen.ws_url, models=[IMAGE_MODEL],
                                   capabilities=["image"]).start()
    client = queen.client(api_key=await funded_key(queen, 1000))
    for _ in range(3):
        await client.images.generate(model=IMAGE_MODEL, prompt="x", size="64x64",
                                     extra_body=EXTRA)
    assert len(honest.orders) == 3
    assert claimer.jobs == []
    await honest.stop()
    await claimer.stop()


async def test_a_key_that_cannot_pay_is_refused_before_anything_runs(queen):
    worker = await ImageWorker(queen.ws_url).start()
    client = queen.client(api_key=await funded_key(queen, 0))
    with pytest.raises(openai.APIStatusError) as caught:
        await client.images.generate(model=IMAGE_MODEL, prompt="x", size="512x512")
    assert caught.value.status_code == 402
    assert worker.orders == []
    await worker.stop()


@pytest.mark.parametrize("behaviour", ["wrong_size", "garbage", "few", "wrong_seed"])
async def test_a_worker_whose_images_break_the_order_is_passed_over(queen, behaviour):
    cheat = await ImageWorker(queen.ws_url, behaviour=behaviour).start()
    secret = await funded_key(queen, 1000)
    client = queen.client(api_key=secret)
    before = await key_available(queen, secret)
    with pytest.raises(openai.InternalServerError) as caught:  # alone: nobody delivers
        await client.images.generate(model=IMAGE_MODEL, prompt="x", size="64x64", n=2,
                                     extra_body=EXTRA)
    assert caught.value.status_code == 502
    assert caught.value.body["code"] == "invalid_images"
    assert await key_available(queen, secret) == before  # nothing charged
    assert await balance(queen, ledger.worker_available(cheat.pubkey)) == 0
    honest = await ImageWorker(queen.ws_url).start()
    answer = await client.images.generate(model=IMAGE_MODEL, prompt="x", size="64x64", n=2,
                                          extra_body=EXTRA)
    order = ImageOrder.model_validate(honest.orders[-1].model_dump())
    assert [base64.b64decode(item.b64_json) for item in answer.data] == [
        picture(order, 41), picture(order, 42)]
    assert await balance(queen, ledger.worker_available(cheat.pubkey)) == 0
    await cheat.stop()
    await honest.stop()


async def test_a_failing_worker_is_retried_on_another(queen):
    failing = await ImageWorker(queen.ws_url, behaviour="error").start()
    client = queen.client(api_key=await funded_key(queen, 1000))
    honest = await ImageWorker(queen.ws_url).start()
    for _ in range(3):
        answer = await client.images.generate(model=IMAGE_MODEL, prompt="x", size="64x64",
                                              extra_body=EXTRA)
        assert decoded(answer.data[0].b64_json).size == (64, 64)
    assert len(honest.orders) == 3
    await failing.stop()
    await honest.stop()


async def test_image_speeds_are_kept_under_their_own_class(queen):
    """Seed 001's separate key: an image job's time is a record of its model's image class
    (seconds per megapixel-step on the stats pages, routing's score for image jobs), never a
    text class's seconds per token or the swarm's tokens/s."""
    from queen_server.reports import worker_row

    worker = await ImageWorker(queen.ws_url).start()
    client = queen.client(api_key=await funded_key(queen, 1000))
    for _ in range(2):
        await client.images.generate(model=IMAGE_MODEL, prompt="x", size="64x64",
                                     extra_body=EXTRA)
    dispatcher, stats = queen.state.dispatcher, queen.state.stats
    image_class = dispatcher.size_class_of(IMAGE_MODEL)
    assert image_class == "image:" + queen.state.price_of(IMAGE_MODEL).size_class
    assert worker.pubkey in stats.speeds_for(image_class)
    record = stats.workers[worker.pubkey]
    assert list(record.speeds) == [image_class]
    assert record.sec_per_token() is None
    assert stats.tokens_per_s() == 0
    row = worker_row(queen.state, record, {})
    assert row["sec_per_megapixel_step"] > 0
    await worker.stop()
