"""Payment before placement (issue 34): the hub is read and a fetch is sent only for a caller that
was admitted and whose money is held. The adversaries against a real queen over real sockets,
with the real ``huggingface_hub`` client reading the fake hub, which counts every request:

- a key with 0 sats naming six hub models no worker holds: six 402s, no hub request, no fetch;
- a client on an open queen naming made-up models: each new name costs one hub request and
  counts against that client; past ``placements_per_key_per_hour`` it gets 429 with
  Retry-After, while another client is still answered and served;
- a placement that answers ``model_loading`` (or fails) gives back the hold and the caller's
  place, and charges nothing;
- a model the queen has not read yet is held at the dearest class, then charged at its own.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from queen_server.billing import ledger
from queen_server.billing.pricing import PriceTable
from queen_server.swarm.metering import estimate_prompt_tokens
from shared_schema import Hello
from shared_schema.capabilities import FETCH
from tests.queen_server.billing.test_billing_api import funded_key
from tests.support.fake_hub import FakeHub, pricing_repos
from tests.support.queen import QueenHarness, running_queen
from tests.support.workers import ScriptedWorker

HUB_MODELS = [f"org/model{i}-GGUF:Q4_K_M" for i in range(6)]
TINY_PARAMS = 135_000_000
TABLE = PriceTable()
ASK = {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 8}

pytestmark = pytest.mark.timeout(120)


class TakerWorker(ScriptedWorker):
    """A scripted worker that takes the queen's fetches and has room for any small model (it
    downloads nothing: a fetch it is sent only shows up in the queen's placement books)."""

    def hello(self, nonce: str) -> Hello:
        hello = super().hello(nonce)
        return hello.model_copy(update={
            "capabilities": [*hello.capabilities, FETCH], "model_room_mb": 50_000,
            "memory_budget_mb": 16_000})


def chat(model: str, **headers: str) -> dict[str, object]:
    return {"json": {"model": model, **ASK}, "headers": headers}


def from_address(address: str) -> dict[str, str]:
    """An open-access client at ``address``: the queen believes X-Forwarded-For from
    127.0.0.1 (uvicorn's default trusted proxy), as it would from its TLS proxy."""
    return {"X-Forwarded-For": address}


async def nothing_held(queen: QueenHarness, key_id: int | None = None) -> None:
    """No caller counted, no money reserved: whatever happened gave everything back."""
    await queen.wait_until(lambda: len(queen.state.dispatcher.callers) == 0, 10,
                           "no caller counted")
    if key_id is not None:
        money = await queen.state.billing.ledger.balances()
        assert money.get(ledger.key_reserved(key_id), 0) == 0


async def test_a_key_with_no_money_naming_hub_models_gets_402s_and_costs_nothing(tmp_path):
    with FakeHub(pricing_repos(dict.fromkeys(HUB_MODELS, TINY_PARAMS))) as hub:
        async with running_queen(tmp_path, auth="keys", hub_endpoint=hub.url,
                                 model_wait_s=0) as queen:
            taker = await TakerWorker(queen.ws_url, models=[]).start()
            try:
                assert queen.state.placement.placeable(HUB_MODELS[0])
                broke, broke_id = await funded_key(queen, 0)
                async with httpx.AsyncClient(base_url=queen.base_url, timeout=20) as http:
                    answers = [await http.post("/v1/chat/completions", **chat(
                        model, Authorization=f"Bearer {broke}")) for model in HUB_MODELS]
                assert [a.status_code for a in answers] == [402] * 6
                for answer in answers:
                    error = answer.json()["error"]
                    assert (error["code"], error["type"]) == ("insufficient_balance",
                                                              "insufficient_quota")
                assert hub.requests == []  # not one listing, header or download
                assert queen.state.placement.loading == {}  # no fetch went to any worker
                assert len(queen.state.placement.limits.callers) == 0  # nor was one started
                await nothing_held(queen, broke_id)

                # The same six names from a key that can pay: now the queen reads the hub and
                # places them; each answer is model_loading and charges nothing.
                payer, payer_id = await funded_key(queen, 1000)
                async with httpx.AsyncClient(base_url=queen.base_url, timeout=20) as http:
                    loading = [await http.post("/v1/chat/completions", **chat(
                        model, Authorization=f"Bearer {payer}")) for model in HUB_MODELS[:2]]
                assert [a.status_code for a in loading] == [503, 503]
                assert {a.json()["error"]["code"] for a in loading} == {"model_loading"}
                assert hub.count("GET", "/api/models/") == 2
                for model in HUB_MODELS[:2]:
                    assert set(queen.state.placement.loading[model].asked) == {taker.pubkey}
                await nothing_held(queen, payer_id)
                money = await queen.state.billing.ledger.balances()
                assert money[ledger.key_available(payer_id)] == 1000 * 1000
            finally:
                await taker.stop()


async def test_a_flood_of_made_up_names_is_limited_per_caller_while_others_are_served(tmp_path):
    with FakeHub() as hub:  # a hub that has none of the names asked for
        async with running_queen(tmp_path, hub_endpoint=hub.url,
                                 placements_per_key_per_hour=3) as queen:
            taker = await TakerWorker(queen.ws_url).start()  # it also serves the echo model
            flooder, other = from_address("198.51.100.7"), from_address("203.0.113.9")
            try:
                # The queen reads ahead the worker's own model (on no hub): counted apart.
                catalog = queen.state.catalog
                await queen.wait_until(lambda: not catalog._pending, 10, "read-ahead done")
                ahead = hub.count("GET", "/api/models/")
                made_up = [f"nobody/made-up-{i}-GGUF:Q4_K_M" for i in range(10)]
                async with httpx.AsyncClient(base_url=queen.base_url, timeout=20) as http:
                    answers = [await http.post("/v1/chat/completions", **chat(name, **flooder))
                               for name in made_up]
                    # Its failed resolutions counted: three names read, then 429s.
                    assert [a.status_code for a in answers] == [404] * 3 + [429] * 7
                    assert {a.json()["error"]["code"] for a in answers[:3]} == {
                        "model_not_found"}
                    for limited in answers[3:]:
                        error = limited.json()["error"]
                        assert (error["type"], error["code"]) == ("rate_limit_error",
                                                                  "placement_limit_per_key")
                        assert 3500 < int(limited.headers["retry-after"]) <= 3601
                    assert hub.count("GET", "/api/models/") == ahead + 3  # one a name, no more

                    # A name the hub already said it lacks is answered from the negative cache:
                    # the same 404, no hub request, and no more counted (nothing was spent).
                    again = await http.post("/v1/chat/completions", **chat(made_up[0],
                                                                            **flooder))
                    assert again.status_code == 404
                    assert hub.count("GET", "/api/models/") == ahead + 3
                    # Models the workers serve are not limited: the flooder is still answered.
                    served = await http.post("/v1/chat/completions", **chat(
                        taker.models[0].name, **flooder))
                    assert served.status_code == 200, served.text

                    # Another client is untouched by the flood: its own names are read...
                    fresh = await http.post("/v1/chat/completions", **chat(
                        "nobody/another-GGUF:Q4_K_M", **other))
                    assert fresh.status_code == 404
                    assert fresh.json()["error"]["code"] == "model_not_found"
                    assert hub.count("GET", "/api/models/") == ahead + 4
                    # ...and it is served.
                    answer = await http.post("/v1/chat/completions", **chat(
                        taker.models[0].name, **other))
                    assert answer.status_code == 200, answer.text
                    assert answer.json()["choices"][0]["message"]["content"] == "echo: hi there"
                budget = queen.state.placement.limits.callers
                assert budget.used("addr:198.51.100.7", queen.state.placement.clock()) == 3
                assert budget.used("addr:203.0.113.9", queen.state.placement.clock()) == 1
                await nothing_held(queen)
            finally:
                await taker.stop()


async def test_concurrent_requests_for_one_new_model_share_one_placement(tmp_path):
    """Joining a placement under way costs the caller nothing: ten requests for one new model
    from one client read the hub once, fetch once, and spend one of its placements."""
    model = HUB_MODELS[0]
    with FakeHub(pricing_repos({model: TINY_PARAMS})) as hub:
        async with running_queen(tmp_path, hub_endpoint=hub.url, model_wait_s=0,
                                 placements_per_key_per_hour=1) as queen:
            taker = await TakerWorker(queen.ws_url, models=[]).start()
            try:
                async with httpx.AsyncClient(base_url=queen.base_url, timeout=20) as http:
                    answers = await asyncio.gather(*(
                        http.post("/v1/chat/completions", **chat(model)) for _ in range(10)))
                assert {a.status_code for a in answers} == {503}
                assert {a.json()["error"]["code"] for a in answers} == {"model_loading"}
                assert hub.count("GET", "/api/models/") == 1
                assert list(queen.state.placement.loading[model].asked) == [taker.pubkey]
                assert queen.state.placement.limits.callers.used(
                    "addr:127.0.0.1", queen.state.placement.clock()) == 1
                await nothing_held(queen)
            finally:
                await taker.stop()


async def test_a_model_not_read_yet_is_held_at_the_dearest_class_and_charged_at_its_own(
        tmp_path):
    """A worker lists more names than the queen reads ahead: a request for one not read yet
    reserves at the dearest rates (its reading could put it in any class), then is charged at
    the class the queen reads from its header."""
    names = [f"org/listed{i:02d}-GGUF:Q4_K_M" for i in range(20)]
    unread = names[-1]
    with FakeHub(pricing_repos(dict.fromkeys(names, TINY_PARAMS))) as hub:
        async with running_queen(tmp_path, auth="keys", hub_endpoint=hub.url,
                                 unverified_price_class=None, escrow_jobs=0) as queen:
            worker = await ScriptedWorker(queen.ws_url, models=names,
                                          behaviour="gated").start()
            try:
                catalog = queen.state.catalog
                await queen.wait_until(lambda: not catalog._pending, 10, "read-ahead done")
                assert not catalog.known(unread)
                secret, key_id = await funded_key(queen, 1000)
                async with httpx.AsyncClient(base_url=queen.base_url, timeout=20) as http:
                    request = asyncio.create_task(http.post("/v1/chat/completions", **chat(
                        unread, Authorization=f"Bearer {secret}")))
                    await queen.wait_until(lambda: len(worker.jobs) == 1, 10, "job given")
                    money = await queen.state.billing.ledger.balances()
                    dearest = TABLE.prices[-1]
                    prompt = estimate_prompt_tokens(["hi there"])
                    assert money[ledger.key_reserved(key_id)] == dearest.cost_msat(
                        prompt, ASK["max_tokens"])
                    worker.release.set()
                    answer = await request
                assert answer.status_code == 200, answer.text
                usage = answer.json()["usage"]
                tiny = TABLE.for_parameters(TINY_PARAMS)
                money = await queen.state.billing.ledger.balances()
                charged = 1000 * 1000 - money[ledger.key_available(key_id)]
                assert charged == tiny.cost_msat(usage["prompt_tokens"],
                                                 usage["completion_tokens"])
                assert charged < dearest.cost_msat(usage["prompt_tokens"],
                                                   usage["completion_tokens"])
                await nothing_held(queen, key_id)
            finally:
                await worker.stop()
