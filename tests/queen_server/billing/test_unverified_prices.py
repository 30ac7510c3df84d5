"""Models the queen cannot read on the hub, priced as the hostile worker would like them priced:
a tiny file under a made-up name, a liar undercutting an honest holder, a lie upward, a local
name for a file the queen did read. Real billed queens over real sockets, scripted workers
playing the hostile parts, the price and its reason read where a developer reads them
(``/v1/models``, ``/stats``, the landing page) before paying."""

from __future__ import annotations

import html

import httpx

from queen_server.billing.pricing import PriceTable
from tests.queen_server.billing.test_billing_api import funded_key
from tests.queen_server.billing.test_usage_bounds import FUNDS_SATS, charged_and_credited
from tests.support.fake_hub import FakeHub, pricing_repos
from tests.support.queen import running_queen
from tests.support.workers import ScriptedWorker

TABLE = PriceTable()
MADE_UP = "gpt-4o"  # a name developers type, squatted by a worker with a 135M model
SMOLLM2_BYTES = 98_362_432  # the real SmolLM2-135M Q4_1 file
SEVEN_B_BYTES = 4_370_000_000  # a 7B Q4_K_M file: at most 23B parameters, the xl class
HUB_SMALL = "org/small-GGUF:Q4_K_M"  # 135M parameters on the (fake) hub
HELLO = [{"role": "user", "content": "Hello"}]


def holding(worker: ScriptedWorker, *, size_bytes: int, sha256: str | None = None
            ) -> ScriptedWorker:
    """The worker's models with this file size (and sha256) in its hello, as the app says."""
    worker.models = [m.model_copy(update={"size_bytes": size_bytes, "sha256": sha256})
                     for m in worker.models]
    return worker


async def cards(queen, secret: str | None = None) -> dict[str, dict]:
    headers = {"authorization": f"Bearer {secret}"} if secret else {}
    async with httpx.AsyncClient(base_url=queen.base_url) as http:
        answer = await http.get("/v1/models", headers=headers)
    assert answer.status_code == 200, answer.text
    return {card["id"]: card["apiary"] for card in answer.json()["data"]}


async def test_a_made_up_name_for_a_tiny_file_earns_the_tiny_class(tmp_path, db_url):
    async with running_queen(tmp_path, auth="keys", db=db_url, escrow_jobs=0,
                             unverified_price_class=None) as queen:
        squatter = await holding(ScriptedWorker(queen.ws_url, models=[MADE_UP]),
                                 size_bytes=SMOLLM2_BYTES).start()
        try:
            secret, key_id = await funded_key(queen, FUNDS_SATS)
            # The developer sees the price and why before paying.
            price = (await cards(queen, secret))[MADE_UP]["price"]
            assert (price["size_class"], price["basis"]) == ("tiny", "file_size")
            assert price["reason"].startswith("unverified: the queen could not read this "
                                              "model's file on the hub; its workers report a "
                                              "file of 94 MB")
            # Two jobs (the first is the worker's unpaid proof of work): charged and credited
            # at the tiny class, not the largest.
            client = queen.client(api_key=secret)
            for _ in range(2):
                answer = await client.chat.completions.create(model=MADE_UP, messages=HELLO,
                                                              max_tokens=20)
            charged, credited = await charged_and_credited(queen, key_id, squatter.pubkey)
            usage = answer.usage
            tiny = TABLE.named("tiny").cost_msat(usage.prompt_tokens, usage.completion_tokens)
            assert tiny <= charged <= 2 * tiny
            assert credited == int(tiny * queen.state.settings.worker_share)
            largest = TABLE.prices[-1].cost_msat(usage.prompt_tokens, usage.completion_tokens)
            assert credited < largest * queen.state.settings.worker_share / 50
        finally:
            await squatter.stop()


async def test_a_liar_cannot_undercut_an_honest_holder_and_a_lie_upward_buys_nothing_new(
        tmp_path):
    async with running_queen(tmp_path, unverified_price_class=None) as queen:
        honest = await holding(ScriptedWorker(queen.ws_url, models=["my-7b"]),
                               size_bytes=SEVEN_B_BYTES).start()
        workers = [honest]
        try:
            assert queen.state.price_of("my-7b").size_class == "xl"
            # A second holder says the file is tiny: the honest holder's claim still prices it.
            workers.append(await holding(ScriptedWorker(queen.ws_url, models=["my-7b"]),
                                         size_bytes=1).start())
            assert queen.state.price_of("my-7b").size_class == "xl"
            # A holder that claims a trillion-byte file lifts the name to the class for
            # unverified models, the price every such name had before, and no further; the
            # developer reads that in /v1/models before choosing it.
            workers.append(await holding(ScriptedWorker(queen.ws_url, models=["my-7b"]),
                                         size_bytes=10**12).start())
            card = (await cards(queen))["my-7b"]["price"]
            assert (card["size_class"], card["basis"]) == ("xxl", "unverified")
            await workers.pop().stop()  # the liar upward leaves: back to the honest claim
            await queen.wait_until(lambda: len(queen.state.registry.holders("my-7b")) == 2, 10)
            assert queen.state.price_of("my-7b").size_class == "xl"
            # With only the undercutter left, it prices its own name: its loss, no one else's.
            await workers.pop(0).stop()
            await queen.wait_until(lambda: len(queen.state.registry.holders("my-7b")) == 1, 10)
            assert queen.state.price_of("my-7b").size_class == "tiny"
        finally:
            for worker in workers:
                await worker.stop()


async def test_a_local_name_for_a_file_the_queen_read_is_priced_by_that_reading(tmp_path):
    with FakeHub(pricing_repos({HUB_SMALL: 135_000_000})) as hub:
        async with running_queen(tmp_path, hub_endpoint=hub.url,
                                 unverified_price_class=None) as queen:
            await queen.state.catalog.settle(HUB_SMALL)
            sha256 = queen.state.catalog.facts(HUB_SMALL).sha256
            # The hub file imported under a local name, its size claimed a thousand times
            # over: the queen knows the file by its sha256 and prices it as it read it.
            importer = await holding(ScriptedWorker(queen.ws_url, models=["my-small"]),
                                     size_bytes=10**12, sha256=sha256).start()
            try:
                price = (await cards(queen))["my-small"]["price"]
                assert (price["size_class"], price["basis"]) == ("tiny", "same_file")
                assert f"as {HUB_SMALL} (135M parameters)" in price["reason"]
            finally:
                await importer.stop()


async def test_a_holder_that_says_nothing_leaves_the_name_unverified_and_says_why(tmp_path):
    async with running_queen(tmp_path, unverified_price_class=None) as queen:
        silent = await holding(ScriptedWorker(queen.ws_url, models=["mystery"]),
                               size_bytes=0).start()
        try:
            reason = ("unverified: the queen could not read this model's file on the hub, so "
                      "it is priced as the largest class (xxl)")
            price = (await cards(queen))["mystery"]["price"]
            assert (price["size_class"], price["basis"], price["reason"]) == (
                "xxl", "unverified", reason)
            async with httpx.AsyncClient(base_url=queen.base_url) as http:
                stats = (await http.get("/stats")).json()
                landing = (await http.get("/")).text
            [listed] = stats["models"]
            assert listed["price"]["reason"] == reason
            assert reason in html.unescape(landing)
        finally:
            await silent.stop()


async def test_a_flagged_holder_claims_nothing(tmp_path):
    """Only routable holders' claims count: a holder taken out of routing (flagged by the
    audits, here) no longer lowers or raises the name's price."""
    async with running_queen(tmp_path, unverified_price_class=None) as queen:
        honest = await holding(ScriptedWorker(queen.ws_url, models=["m"]),
                               size_bytes=SEVEN_B_BYTES).start()
        loud = await holding(ScriptedWorker(queen.ws_url, models=["m"]),
                             size_bytes=10**12).start()
        try:
            assert queen.state.price_of("m").size_class == "xxl"
            registry = queen.state.registry
            registry.set_flagged(registry.get(loud.pubkey), True)
            assert queen.state.price_of("m").size_class == "xl"
        finally:
            await honest.stop()
            await loud.stop()
