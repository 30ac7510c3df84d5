"""One reading of a name (issue 39): routing, price and the audits' file all come from the
name's pin, so a hub whose file changes under the same name moves none of them until the
operator re-pins it (the admin API), and then all three move together. A real queen, the real
``huggingface_hub`` client against the fake hub, scripted workers over real websockets, the
openai SDK."""

from __future__ import annotations

import hashlib
import logging
import time

import httpx
import pytest

from queen_server.billing.pricing import DEFAULT_PRICES, PriceTable
from tests.support.fake_hub import FakeHub, FakeRepo, gguf_header_only
from tests.support.queen import QueenHarness, running_queen
from tests.support.workers import ScriptedWorker

NAME = "org/one-GGUF:Q4_K_M"
PATH = "model-Q4_K_M.gguf"
SMALL, LARGE = 1_000_000_000, 70_000_000_000
TOKEN = "admin-token-for-tests"


class Clock:
    def __init__(self) -> None:
        self.now = time.monotonic()

    def __call__(self) -> float:
        return self.now


def class_of(parameter_count: int) -> str:
    return PriceTable(DEFAULT_PRICES).for_parameters(parameter_count).size_class


async def served_by(queen: QueenHarness, *workers: ScriptedWorker) -> ScriptedWorker:
    """Which of ``workers`` a real chat request for NAME reached."""
    before = [len(worker.jobs) for worker in workers]
    answer = await queen.client().chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert answer.choices[0].message.content
    [served] = [w for w, n in zip(workers, before, strict=True) if len(w.jobs) > n]
    return served


def seen(queen: QueenHarness) -> tuple[str, set[str | None], str | None]:
    """What price, routing and the audits use for NAME now."""
    state = queen.state
    routable = {profile[2] for profile in state.dispatcher.eligibility.servable(NAME)}
    return (state.price_of(NAME).size_class, routable,
            state.catalog.audit_file(NAME, None))


async def test_a_changed_hub_file_moves_nothing_until_the_operator_repins(
        tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    small, large = gguf_header_only(SMALL), gguf_header_only(LARGE)
    old_sha, new_sha = hashlib.sha256(small).hexdigest(), hashlib.sha256(large).hexdigest()
    assert class_of(SMALL) != class_of(LARGE)
    with FakeHub([FakeRepo("org/one-GGUF", {PATH: small}, commit="a" * 40)]) as hub:
        async with running_queen(tmp_path, hub_endpoint=hub.url, admin_token=TOKEN,
                                 unverified_price_class=None) as queen:
            catalog = queen.state.catalog
            clock = Clock()
            catalog.clock = clock
            old = await ScriptedWorker(queen.ws_url, models=[NAME], sha256=old_sha).start()
            new = await ScriptedWorker(queen.ws_url, models=[NAME], sha256=new_sha).start()
            try:
                await queen.wait_until(lambda: catalog.pin(NAME) is not None, what="pinned")
                assert seen(queen) == (class_of(SMALL), {old_sha}, old_sha)

                # The repo changes under the same name; the queen reads it again (its TTL).
                hub.add_repo(FakeRepo("org/one-GGUF", {PATH: large}, commit="b" * 40))
                clock.now += catalog.ttl_s + 1
                await catalog.settle(NAME, wait_s=60)  # a loaded machine reads slowly
                latest = catalog.latest(NAME)
                assert latest is not None
                assert latest.sha256 == new_sha  # it was read
                assert catalog.hub_moved(NAME) == latest
                assert seen(queen) == (class_of(SMALL), {old_sha}, old_sha)  # nothing moved
                assert await served_by(queen, old, new) is old
                async with httpx.AsyncClient(base_url=queen.base_url) as http:
                    card = (await http.get(f"/v1/models/{NAME}")).json()["apiary"]
                    assert (card["sha256"], card["parameter_count"]) == (old_sha, SMALL)
                    assert card["verified"] is True
                    rows = (await http.get("/admin/api/models", headers={
                        "Authorization": f"Bearer {TOKEN}"})).json()
                    [row] = [row for row in rows if row["id"] == NAME]
                    assert "re-pin" in row["hub_moved"]

                    # Re-pinning needs the admin token, and then all three move at once.
                    refused = await http.post("/admin/api/models/repin", json={"model": NAME})
                    assert refused.status_code in (401, 403)
                    assert seen(queen) == (class_of(SMALL), {old_sha}, old_sha)
                    with caplog.at_level(logging.WARNING, "queen_server.catalog.catalog"):
                        done = await http.post(
                            "/admin/api/models/repin", json={"model": NAME},
                            headers={"Authorization": f"Bearer {TOKEN}"})
                    assert done.status_code == 200, done.text
                    body = done.json()
                    assert (body["old_sha256"], body["sha256"]) == (old_sha, new_sha)
                    assert body["price"]["size_class"] == class_of(LARGE)
                    assert any("re-pinned" in r.getMessage() and NAME in r.getMessage()
                               for r in caplog.records)  # the act is logged
                    assert seen(queen) == (class_of(LARGE), {new_sha}, new_sha)
                    assert catalog.hub_moved(NAME) is None
                    assert await served_by(queen, old, new) is new
                    card = (await http.get(f"/v1/models/{NAME}")).json()["apiary"]
                    assert (card["sha256"], card["parameter_count"]) == (new_sha, LARGE)
            finally:
                await old.stop()
                await new.stop()


async def test_repinning_a_name_the_hub_cannot_read_keeps_the_pin(tmp_path) -> None:
    """The hub lost the repo: the operator's re-pin is refused with the reason, and the pin
    (price, routing, audits) stays as it was."""
    small = gguf_header_only(SMALL)
    old_sha = hashlib.sha256(small).hexdigest()
    with FakeHub([FakeRepo("org/one-GGUF", {PATH: small})]) as hub:
        async with running_queen(tmp_path, hub_endpoint=hub.url, admin_token=TOKEN,
                                 unverified_price_class=None) as queen:
            catalog = queen.state.catalog
            await catalog.settle(NAME, wait_s=60)  # a loaded machine reads slowly
            assert catalog.pin(NAME) is not None
            hub.fail_next("/api/models/", 404, times=5, error_code="RepoNotFound")
            async with httpx.AsyncClient(base_url=queen.base_url) as http:
                answer = await http.post("/admin/api/models/repin", json={"model": NAME},
                                         headers={"Authorization": f"Bearer {TOKEN}"})
                local = await http.post("/admin/api/models/repin", json={"model": "my-model"},
                                        headers={"Authorization": f"Bearer {TOKEN}"})
            assert answer.status_code == 404, answer.text
            assert answer.json()["error"]["code"] == "model_not_found"
            assert local.status_code == 400
            assert "APIARY_LOCAL_MODEL_PINS" in local.json()["error"]["message"]
            assert catalog.audit_file(NAME, None) == old_sha
            assert queen.state.price_of(NAME).size_class == class_of(SMALL)


async def test_a_pin_outlives_the_queen_and_is_shared_by_the_next_one(tmp_path) -> None:
    """The pin is kept in the database (``catalog.pins``): a queen started after the hub's file
    changed (a restart, or another replica on the same database) uses the first reading's file,
    price and audit file, and shows that the hub moved; even with the hub unreachable the name
    stays pinned. An operator's re-pin is what the next queen then uses."""
    small, large = gguf_header_only(SMALL), gguf_header_only(LARGE)
    old_sha, new_sha = hashlib.sha256(small).hexdigest(), hashlib.sha256(large).hexdigest()
    db = f"sqlite+aiosqlite:///{tmp_path / 'shared.sqlite3'}"
    with FakeHub([FakeRepo("org/one-GGUF", {PATH: small}, commit="a" * 40)]) as hub:
        settings = {"hub_endpoint": hub.url, "admin_token": TOKEN, "db": db,
                    "unverified_price_class": None}
        async with running_queen(tmp_path / "first", **settings) as queen:
            await queen.state.catalog.settle(NAME, wait_s=60)
            assert seen(queen)[0] == class_of(SMALL)
        hub.add_repo(FakeRepo("org/one-GGUF", {PATH: large}, commit="b" * 40))
        async with running_queen(tmp_path / "second", **settings) as queen:
            catalog = queen.state.catalog
            await catalog.settle(NAME, wait_s=60)
            assert catalog.pin(NAME) is not None
            assert seen(queen) == (class_of(SMALL), set(), old_sha)  # no worker: none routable
            assert catalog.hub_moved(NAME) is not None  # read, and shown to the operator
            async with httpx.AsyncClient(base_url=queen.base_url) as http:
                done = await http.post("/admin/api/models/repin", json={"model": NAME},
                                       headers={"Authorization": f"Bearer {TOKEN}"})
            assert done.status_code == 200, done.text
        hub.fail_next("/api/models/", 503, times=50)  # the hub is out of reach now
        async with running_queen(tmp_path / "third", **settings) as queen:
            catalog = queen.state.catalog
            await catalog.settle(NAME, wait_s=60)
            assert catalog.verified(NAME)  # pinned from the database, the hub unread
            assert seen(queen) == (class_of(LARGE), set(), new_sha)
