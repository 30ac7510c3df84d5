"""A model's price is the queen's own reading, never a worker's claim: lying workers against a
real billed queen over real sockets, with the real ``huggingface_hub`` client reading GGUF
headers from the fake hub."""

from __future__ import annotations

import json

import httpx
import pytest

from queen_server.billing.pricing import PriceTable
from tests.queen_server.billing.test_billing_api import funded_key
from tests.queen_server.billing.test_usage_bounds import FUNDS_SATS, charged_and_credited
from tests.support.fake_hub import FakeHub, pricing_repos
from tests.support.queen import running_queen
from tests.support.workers import ScriptedWorker

SMALL = "org/small-GGUF:Q4_K_M"  # 135M on the hub
BIG = "org/big-GGUF:Q4_K_M"  # 70B on the hub
LOCAL = "my-imported-model"  # a file imported on a worker: on no hub
TABLE = PriceTable()
HELLO = [{"role": "user", "content": "Hello"}]


def claiming(worker: ScriptedWorker, parameter_count: int) -> ScriptedWorker:
    """The worker claims ``parameter_count`` and says nothing of its file's size (a size
    bounds a model the queen cannot read: ``test_unverified_prices``)."""
    worker.models = [m.model_copy(update={"parameter_count": parameter_count, "size_bytes": 0})
                     for m in worker.models]
    return worker


@pytest.fixture
def hub():
    with FakeHub(pricing_repos({SMALL: 135_000_000, BIG: 70_000_000_000})) as served:
        yield served


async def cost_of_one_request(queen, secret: str, key_id: int, model: str) -> tuple[int, int]:
    """(charged msat, what the queen's reading prices that usage at)."""
    before, _ = await charged_and_credited(queen, key_id, None)
    answer = await queen.client(api_key=secret).chat.completions.create(
        model=model, messages=HELLO, max_tokens=20)
    after, _ = await charged_and_credited(queen, key_id, None)
    return after - before, answer.usage


async def test_workers_lying_about_size_move_no_price(tmp_path, db_url, hub):
    async with running_queen(tmp_path, auth="keys", db=db_url, escrow_jobs=0,
                             hub_endpoint=hub.url, unverified_price_class=None) as queen:
        # A cheap model claimed huge, a huge model claimed cheap, a local model claimed tiny.
        workers = [await claiming(ScriptedWorker(queen.ws_url, models=[SMALL]), 10**12).start(),
                   await claiming(ScriptedWorker(queen.ws_url, models=[BIG]), 135_000_000).start(),
                   await claiming(ScriptedWorker(queen.ws_url, models=[LOCAL]), 1).start()]
        try:
            secret, key_id = await funded_key(queen, FUNDS_SATS)
            expected = {SMALL: TABLE.named("tiny"), BIG: TABLE.named("xxl"),
                        LOCAL: TABLE.named("xxl")}  # on no hub: the class for unverified
            for model, price in expected.items():
                charged, usage = await cost_of_one_request(queen, secret, key_id, model)
                assert charged == price.cost_msat(usage.prompt_tokens, usage.completion_tokens), \
                    model
            async with httpx.AsyncClient(base_url=queen.base_url) as client:
                cards = {c["id"]: c["apiary"] for c in
                         (await client.get("/v1/models", headers={
                             "authorization": f"Bearer {secret}"})).json()["data"]}
            assert cards[SMALL]["parameter_count"] == 135_000_000
            assert cards[SMALL]["verified"] is True
            assert cards[SMALL]["sha256"] == hub.file_sha256("org/small-GGUF",
                                                             "model-Q4_K_M.gguf")
            assert cards[SMALL]["price"]["size_class"] == "tiny"
            assert cards[BIG]["parameter_count"] == 70_000_000_000
            assert cards[BIG]["price"]["size_class"] == "xxl"
            assert cards[LOCAL]["parameter_count"] is None
            assert cards[LOCAL]["verified"] is False
            assert cards[LOCAL]["price"]["size_class"] == "xxl"
            # A second worker holding SMALL and claiming otherwise changes nothing either.
            workers.append(await claiming(ScriptedWorker(queen.ws_url, models=[SMALL]),
                                          2).start())
            assert queen.state.price_of(SMALL).size_class == "tiny"
        finally:
            for worker in workers:
                await worker.stop()


async def test_the_operator_prices_models_the_queen_cannot_read(tmp_path, hub):
    prices = tmp_path / "prices.json"
    prices.write_text(json.dumps({"models": {LOCAL: "small", BIG: "medium"}}))
    async with running_queen(tmp_path, hub_endpoint=hub.url, prices_file=prices,
                             unverified_price_class="large") as queen:
        workers = [await claiming(ScriptedWorker(queen.ws_url, models=[LOCAL, BIG, "other-local"]),
                                  1).start()]
        try:
            await queen.state.catalog.settle(BIG)
            assert queen.state.price_of(LOCAL).size_class == "small"  # the price file
            assert queen.state.price_of(BIG).size_class == "medium"  # the file wins the reading
            assert queen.state.price_of("other-local").size_class == "large"  # unverified
        finally:
            for worker in workers:
                await worker.stop()


async def test_an_unreachable_hub_prices_as_unverified_without_holding_requests_long(tmp_path,
                                                                                      db_url):
    # Nothing listens on port 9: the first billed request learns it at once and is priced as
    # unverified (the largest class), never at a worker's word.
    async with running_queen(tmp_path, auth="keys", db=db_url, escrow_jobs=0,
                             unverified_price_class=None) as queen:
        worker = await claiming(ScriptedWorker(queen.ws_url, models=[SMALL]), 1).start()
        try:
            secret, key_id = await funded_key(queen, FUNDS_SATS)
            charged, usage = await cost_of_one_request(queen, secret, key_id, SMALL)
            assert charged == TABLE.named("xxl").cost_msat(usage.prompt_tokens,
                                                           usage.completion_tokens)
            assert queen.state.catalog.status(SMALL) == "unverified"
            assert "cannot reach" in (queen.state.catalog.problem(SMALL) or "")
        finally:
            await worker.stop()
