"""Models on demand, end to end (issue 17): a queen on a 127.0.0.1 port, real workers
(``WorkerService``: the store, the engine and the link) holding no model, and the fake hub
holding the real SmolLM2 file under several repo and quant names. A developer names a model no
worker holds: the queen resolves it on the hub, places it on the worker that fits, answers
``model_loading`` with an estimate while it downloads, and serves it once it is loaded.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import openai
import pytest

from desktop_worker.store import ModelStore
from queen_server.billing import ledger
from queen_server.billing.pricing import PriceTable
from queen_server.swarm.metering import estimate_prompt_tokens
from tests.queen_server.billing.test_billing_api import funded_key
from tests.support.fake_disk import FakeDisk
from tests.support.fake_hub import FakeHub
from tests.support.on_demand import ASK, FILE, MIRROR, MODEL, QUANTS, REPO, repos, worker
from tests.support.queen import running_queen

ADMIN = "placement-admin-token"

pytestmark = pytest.mark.timeout(300)


def error_of(exc: openai.APIStatusError) -> dict[str, Any]:
    body = exc.response.json()
    return body["error"]


async def test_a_model_nobody_holds_is_placed_fetched_and_served(tmp_path):
    with FakeHub(repos()) as hub:
        async with running_queen(tmp_path, hub_endpoint=hub.url, model_wait_s=0,
                                 total_timeout_s=60, admin_token=ADMIN) as queen, \
                worker(tmp_path, queen, hub, "roomy", swarm_models=True) as chosen, \
                worker(tmp_path, queen, hub, "small", disk_quota_gb=0.05) as small:
            client = queen.client()
            hub.throttle(8 << 20)  # 8 MB/s: the 98 MB download takes a while
            # Two developers ask at once: one placement, one download.
            results = await asyncio.gather(
                *(client.chat.completions.create(model=MODEL, **ASK) for _ in range(2)),
                return_exceptions=True)
            for result in results:
                assert isinstance(result, openai.APIStatusError)
                assert result.status_code == 503
                error = error_of(result)
                assert error["code"] == "model_loading"
                assert error["estimated_time"] > 0
                assert int(result.response.headers["retry-after"]) >= 1
            assert list(queen.state.placement.loading) == [MODEL]
            # The placement went to the worker with room, not the one whose quota is 50 MB.
            assert set(queen.state.placement.loading[MODEL].asked) == {chosen.identity.pubkey}

            # While it loads, /v1/models says so, with its progress.
            async with httpx.AsyncClient(base_url=queen.base_url) as http:
                await queen.wait_until(lambda: any(
                    row["downloaded_bytes"] > 0 for row in queen.state.placement.placements()),
                    30, "download progress in a status")
                cards = (await http.get("/v1/models")).json()["data"]
                admin = {"Authorization": f"Bearer {ADMIN}"}
                [row] = (await http.get("/admin/api/placements", headers=admin)).json()
                page = await http.get("/admin/placements", headers=admin)
            [card] = [c for c in cards if c["id"] == MODEL]
            assert card["apiary"]["status"] == "loading"
            assert 0 < card["apiary"]["progress"] < 1
            assert card["apiary"]["sha256"] == hub.file_sha256(REPO, FILE)
            # The admin pages show the placement: which worker, how far.
            assert row["model"] == MODEL
            assert row["worker"] == queen.state.registry.get(chosen.identity.pubkey).public_id
            assert row["downloaded_bytes"] > 0
            assert page.status_code == 200
            assert MODEL in page.text

            hub.throttle(None)
            await queen.wait_until(lambda: MODEL in queen.state.registry.model_names(), 60,
                                   "the model served")
            answer = await client.chat.completions.create(model=MODEL, **ASK)
            assert answer.choices[0].message.content
            held = queen.state.registry.get(chosen.identity.pubkey).models[MODEL]
            assert held.sha256 == hub.file_sha256(REPO, FILE)  # the pinned file
            assert MODEL not in small.store
            # One download for both requests (the queen's own read is a Range request of the
            # header's first 2 MiB).
            downloads = [r for r in hub.requests
                         if r.method == "GET" and FILE in r.path and r.range is None]
            assert len(downloads) == 1
            # The worker heard of the demand in its status loop's welcome or the broadcast.
            await queen.state.placement.tell_demand()
            await queen.wait_until(lambda: chosen.demand is not None and any(
                row.name == MODEL for row in chosen.demand.models), 10, "demand told")


async def test_names_that_cannot_be_served_get_clear_errors(tmp_path):
    with FakeHub(repos()) as hub:
        async with running_queen(tmp_path, hub_endpoint=hub.url, model_wait_s=0) as queen, \
                worker(tmp_path, queen, hub, "tiny", disk_quota_gb=0.05):
            client = queen.client()

            async def refused(model: str) -> openai.APIStatusError:
                with pytest.raises(openai.APIStatusError) as caught:
                    await client.chat.completions.create(model=model, **ASK)
                return caught.value

            ambiguous = await refused(f"{QUANTS}:Q4_K")
            assert ambiguous.status_code == 400
            assert error_of(ambiguous)["code"] == "model_ambiguous"
            assert error_of(ambiguous)["candidates"] == ["m-Q4_K_M.gguf", "m-Q4_K_S.gguf"]
            assert error_of(ambiguous)["param"] == "model"

            no_match = await refused(f"{MIRROR}:Q5_K_M")
            assert no_match.status_code == 400
            assert error_of(no_match)["code"] == "model_file_not_found"

            missing = await refused("nobody/NoSuchModel-GGUF:Q4_0")
            assert missing.status_code == 404
            assert error_of(missing)["code"] == "model_not_found"

            gated = await refused("gated/SmolLM2-GGUF:Q4_1")
            assert gated.status_code == 403
            assert error_of(gated)["code"] == "model_gated"

            # The only worker has 50 MB of quota: the 98 MB file fits no connected worker.
            too_big = await refused(f"{MIRROR}:q4_1")
            assert too_big.status_code == 503
            assert error_of(too_big)["code"] == "no_worker_fits"
            assert "MB" in error_of(too_big)["message"]
            assert not queen.state.placement.loading  # nothing half-placed behind


async def test_a_full_disk_and_a_corrupt_download_move_the_model_to_another_worker(tmp_path):
    with FakeHub(repos()) as hub:
        # the first worker says it has room (20 GB past its 10 GB headroom), then its disk fills
        full = FakeDisk(total_bytes=100 << 30, free_bytes=30 << 30)
        store = ModelStore(tmp_path / "full" / "models", endpoint=hub.url, disk=full)
        async with running_queen(tmp_path, hub_endpoint=hub.url, model_wait_s=60,
                                 total_timeout_s=90) as queen, \
                worker(tmp_path, queen, hub, "full", store=store, swarm_models=True) as liar, \
                worker(tmp_path, queen, hub, "honest") as honest:
            full.free_bytes = 1 << 20
            await queen.state.catalog.resolve(MODEL)  # the queen's header read comes first
            hub.corrupt_next(FILE)  # then whoever downloads the file gets a flipped byte
            client = queen.client()
            # The liar (it opted in, so it is asked first) finds no room; the honest worker's
            # download is corrupt: no worker is left, and the developer is told both reasons.
            with pytest.raises(openai.APIStatusError) as caught:
                await client.chat.completions.create(model=MODEL, **ASK)
            assert caught.value.status_code == 502
            error = error_of(caught.value)
            assert error["code"] == "fetch_failed"
            assert "disk_full" in error["message"]
            assert "sha256_mismatch" in error["message"]
            assert MODEL not in liar.store
            assert MODEL not in honest.store  # the corrupt file was deleted
            assert not queen.state.placement.loading
            # Asked again, the queen places it afresh: the liar now says it has no room, the
            # honest worker downloads a good copy, and the developer is answered.
            answer = await client.chat.completions.create(model=MODEL, **ASK)
            assert answer.choices[0].message.content
            assert honest.store.get(MODEL).sha256 == hub.file_sha256(REPO, FILE)
            assert MODEL not in liar.store


async def test_only_a_key_that_can_pay_gets_a_model_placed_and_pays_its_own_price(tmp_path):
    """Payment before placement (issue 34): a key with no money naming the model gets a 402
    and the queen reads nothing and no worker downloads anything; a key with money gets it
    placed (the hold, at the dearest class while the model is unread, is given back while it
    loads), then served and charged at the class the queen read from its header."""
    with FakeHub(repos()) as hub:
        async with running_queen(tmp_path, auth="keys", hub_endpoint=hub.url, model_wait_s=0,
                                 total_timeout_s=60, unverified_price_class=None) as queen, \
                worker(tmp_path, queen, hub, "roomy") as chosen:
            broke, _ = await funded_key(queen, 0)
            with pytest.raises(openai.APIStatusError) as caught:
                await queen.client(api_key=broke).chat.completions.create(model=MODEL, **ASK)
            assert caught.value.status_code == 402
            assert hub.requests == []  # no listing, no header, no download
            assert not queen.state.placement.loading
            assert MODEL not in chosen.store

            secret, key_id = await funded_key(queen, 100)
            client = queen.client(api_key=secret)
            with pytest.raises(openai.APIStatusError) as loading:
                await client.chat.completions.create(model=MODEL, **ASK)
            assert loading.value.status_code == 503
            assert error_of(loading.value)["code"] == "model_loading"
            money = await queen.state.billing.ledger.balances()
            assert money[ledger.key_available(key_id)] == 100_000  # nothing charged
            assert money.get(ledger.key_reserved(key_id), 0) == 0  # the hold given back
            await queen.wait_until(lambda: MODEL in queen.state.registry.model_names(), 60,
                                   "the model served")
            answer = await client.chat.completions.create(model=MODEL, **ASK)
            assert answer.choices[0].message.content
            assert answer.usage is not None
            price = PriceTable().for_parameters(queen.state.catalog.parameter_count(MODEL))
            assert price.size_class == "tiny"  # SmolLM2's 135M parameters, read by the queen
            money = await queen.state.billing.ledger.balances()
            # Charged at that class, never past what its hold reserved for the prompt it
            # estimated (at the dearest class it would have been 50 times as much).
            held = price.cost_msat(estimate_prompt_tokens(["Say hi"]), ASK["max_tokens"])
            assert 100_000 - money[ledger.key_available(key_id)] == min(held, price.cost_msat(
                answer.usage.prompt_tokens, answer.usage.completion_tokens))
