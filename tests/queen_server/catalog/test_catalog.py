"""The queen reads hub models' GGUF headers itself: the real ``huggingface_hub`` client against the
fake hub on 127.0.0.1, Range reads only, a cache by sha256, and failures priced as unverified."""

from __future__ import annotations

import pytest

from queen_server.catalog import ModelCatalog
from queen_server.catalog.catalog import PREFETCH_PER_WORKER
from queen_server.catalog.hub import HubFiles
from tests.support.fake_hub import FakeHub, FakeRepo, gguf_header_only, pricing_repos
from tests.support.queen import running_queen
from tests.support.workers import ScriptedWorker

BIG = "org/big-GGUF:Q4_K_M"
SEVENTY_B = 70_000_000_000


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def gguf_gets(hub: FakeHub) -> list[str | None]:
    """The Range header of every GET of a .gguf file the hub served."""
    return [r.range for r in hub.requests if r.method == "GET" and r.path.endswith(".gguf")]


async def test_a_hub_model_is_read_from_its_header_with_range_requests_only():
    # A 300,000-token vocabulary makes the header ~4.8 MB (more than the first 2 MiB read),
    # and 20 MB of "tensor data" follow it that the queen must never fetch.
    header = gguf_header_only(SEVENTY_B, vocab=300_000)
    data = header + bytes(20 << 20)
    with FakeHub([FakeRepo("org/big-GGUF", {"model-Q4_K_M.gguf": data})]) as hub:
        catalog = ModelCatalog(HubFiles(hub.url))
        assert catalog.status(BIG) == "unverified"
        await catalog.settle(BIG)
        facts = catalog.facts(BIG)
        assert facts is not None, catalog.problem(BIG)
        assert facts.parameter_count == SEVENTY_B
        assert facts.sha256 == hub.file_sha256("org/big-GGUF", "model-Q4_K_M.gguf")
        assert facts.paths == ("model-Q4_K_M.gguf",)
        assert facts.size_bytes == len(data)
        assert catalog.status(BIG) == "verified"
        ranges = gguf_gets(hub)
        assert ranges == ["bytes=0-2097151", "bytes=0-4194303", "bytes=0-8388607"]
        assert len(header) + (20 << 20) > 8 << 20  # the last read still stopped short of the end


async def test_a_file_already_read_is_not_read_again_under_another_name():
    same = gguf_header_only(1_000_000_000)
    repos = [FakeRepo("org/a-GGUF", {"a-Q4_K_M.gguf": same}),
             FakeRepo("mirror/a-GGUF", {"copy-Q4_K_M.gguf": same})]
    with FakeHub(repos) as hub:
        catalog = ModelCatalog(HubFiles(hub.url))
        await catalog.settle("org/a-GGUF:Q4_K_M")
        await catalog.settle("mirror/a-GGUF:Q4_K_M")
        await catalog.settle("org/a-GGUF:a-Q4_K_M")  # a third name for the same file
        assert catalog.header_reads == 1
        assert len(gguf_gets(hub)) == 1
        for name in ("org/a-GGUF:Q4_K_M", "mirror/a-GGUF:Q4_K_M", "org/a-GGUF:a-Q4_K_M"):
            assert catalog.parameter_count(name) == 1_000_000_000


async def test_a_split_model_counts_every_part():
    parts = {f"big-Q8_0-0000{n}-of-00003.gguf": gguf_header_only(10_000_000_000, split=(n, 3))
             for n in (1, 2, 3)}
    with FakeHub([FakeRepo("org/split-GGUF", parts)]) as hub:
        catalog = ModelCatalog(HubFiles(hub.url))
        await catalog.settle("org/split-GGUF:Q8_0")
        facts = catalog.facts("org/split-GGUF:Q8_0")
        assert facts is not None, catalog.problem("org/split-GGUF:Q8_0")
        assert facts.parameter_count == 30_000_000_000
        assert len(facts.sha256s) == 3


async def test_local_names_never_reach_the_hub():
    with FakeHub() as hub:
        catalog = ModelCatalog(HubFiles(hub.url))
        await catalog.settle("SmolLM2-135M-Instruct.Q4_1")
        assert catalog.status("SmolLM2-135M-Instruct.Q4_1") == "local"
        assert catalog.facts("SmolLM2-135M-Instruct.Q4_1") is None
        assert hub.requests == []


async def test_an_unreachable_hub_leaves_the_model_unverified_and_is_retried_later():
    clock = Clock()
    with FakeHub(pricing_repos({BIG: SEVENTY_B})) as hub:
        url = hub.url
    # The hub has stopped: nothing listens on its port any more.
    catalog = ModelCatalog(HubFiles(url, timeout_s=2), retry_s=300, clock=clock)
    await catalog.settle(BIG)
    assert catalog.facts(BIG) is None
    assert catalog.status(BIG) == "unverified"
    assert "cannot reach" in (catalog.problem(BIG) or "")
    with FakeHub(pricing_repos({BIG: SEVENTY_B})) as hub:
        catalog.reader = HubFiles(hub.url)
        await catalog.settle(BIG)  # too soon: the failure is remembered
        assert hub.requests == []
        clock.now += 301
        await catalog.settle(BIG)
        assert catalog.parameter_count(BIG) == SEVENTY_B


async def test_a_pinned_reading_survives_a_passing_failure_and_a_vanished_repo():
    """The pin is the one reading (issue 39): a repo that vanishes later is shown to the
    operator (``latest``, ``problem``) but changes nothing until it re-pins."""
    clock = Clock()
    with FakeHub(pricing_repos({BIG: SEVENTY_B})) as hub:
        catalog = ModelCatalog(HubFiles(hub.url), ttl_s=60, clock=clock)
        await catalog.settle(BIG)
        assert catalog.parameter_count(BIG) == SEVENTY_B
        hub.fail_next("/api/models/", 503, times=10)
        clock.now += 61
        await catalog.settle(BIG)
        assert catalog.parameter_count(BIG) == SEVENTY_B  # the hub hiccuped: keep what we read
        assert "503" in (catalog.problem(BIG) or "")
    with FakeHub() as empty:  # the repo is gone
        catalog.reader = HubFiles(empty.url)
        clock.now += 1000
        await catalog.settle(BIG)
        assert catalog.parameter_count(BIG) == SEVENTY_B  # still the pin
        assert catalog.latest(BIG) is None
        assert "not found" in (catalog.problem(BIG) or "")


@pytest.mark.parametrize(("files", "problem"), [
    ({"model-Q4_K_M.gguf": b"not a gguf file at all, just text" * 4}, "bad magic"),
    ({"a-Q4_K_M.gguf": gguf_header_only(10), "b-Q4_K_M-x.gguf": gguf_header_only(10)},
     "matches 2 models"),
    ({"README.md": "no models here"}, "no .gguf"),
])
async def test_a_repo_the_queen_cannot_read_is_unverified_with_a_reason(files, problem):
    with FakeHub([FakeRepo("org/big-GGUF", files)]) as hub:
        catalog = ModelCatalog(HubFiles(hub.url))
        await catalog.settle(BIG)
        assert catalog.facts(BIG) is None
        assert problem in (catalog.problem(BIG) or "")


async def test_a_header_longer_than_the_limit_is_refused_not_read_forever():
    with FakeHub(pricing_repos({BIG: SEVENTY_B}, vocab=300_000)) as hub:
        catalog = ModelCatalog(HubFiles(hub.url), max_header_bytes=1 << 20)
        await catalog.settle(BIG)
        assert catalog.facts(BIG) is None
        assert "longer than 1,048,576 bytes" in (catalog.problem(BIG) or "")
        assert gguf_gets(hub) == ["bytes=0-1048575"]


async def test_a_worker_listing_hundreds_of_names_gets_only_a_few_read_ahead(tmp_path):
    """A hostile worker lists 300 made-up hub names: the queen reads ahead only
    ``PREFETCH_PER_WORKER`` of them (the rest only when a client asks for one)."""
    names = [f"liar/repo{i:03d}-GGUF:Q4_K_M" for i in range(300)]
    with FakeHub() as hub:
        async with running_queen(tmp_path, hub_endpoint=hub.url) as queen:
            worker = await ScriptedWorker(queen.ws_url, models=names).start()
            try:
                catalog = queen.state.catalog
                await queen.wait_until(lambda: not catalog._pending, what="readings done")
                listings = [r for r in hub.requests if r.path.startswith("/api/models/")]
                assert len(listings) == PREFETCH_PER_WORKER
                assert {catalog.status(name) for name in names[:PREFETCH_PER_WORKER]} == {
                    "unverified"}  # no such repos
            finally:
                await worker.stop()


async def test_made_up_names_never_push_a_real_reading_out():
    """A flood of names the hub lacks fills the negative cache, not the readings: a real
    model's reading (what prices it) stays, and each made-up name was asked for once."""
    clock = Clock()
    with FakeHub(pricing_repos({BIG: SEVENTY_B})) as hub:
        catalog = ModelCatalog(HubFiles(hub.url), max_entries=8, clock=clock)
        await catalog.settle(BIG)
        made_up = [f"nobody/made-up-{i}-GGUF:Q4_K_M" for i in range(20)]
        for name in made_up:
            await catalog.settle(name)
        assert catalog.parameter_count(BIG) == SEVENTY_B
        assert catalog.known(made_up[-1])
        failure = catalog.remembered_failure(made_up[-1])
        assert failure is not None
        assert failure.kind == "not_found"
        assert catalog.remembered_failure(BIG) is None
        listed = hub.count("GET", "/api/models/")
        assert listed == 1 + len(made_up)
        for name in made_up[-8:]:  # the negative cache answers again: no hub request
            await catalog.settle(name)
        assert hub.count("GET", "/api/models/") == listed
        clock.now += catalog.ttl_s + 1  # until it expires
        assert catalog.remembered_failure(made_up[-1]) is None
