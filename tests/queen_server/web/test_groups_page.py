"""The Groups admin page (issue 19): ``/admin/groups`` and ``/admin/api/groups`` against a real
queen whose ``GroupService`` holds groups built here (a head and members with their layer ranges
and routes), and its planner's outcomes for models without a group. The page and the JSON come
from one report (``reports.groups``); with replicas, each replica's groups are merged in."""

from __future__ import annotations

import re
import secrets
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.async_api import Browser, expect

from queen_server import reports
from queen_server.groups import GroupPlan, MemberPlan, Route
from queen_server.placement.group_relay import RelayUsage
from queen_server.placement.groups import Group, GroupService, Phase
from queen_server.swarm.worker import Worker
from queen_server.web import formatting
from tests.queen_server.web.support import ADMIN_TOKEN, log_in, new_page
from tests.queen_server.web.test_sources import page_data
from tests.support.queen import QueenHarness, running_queen
from tests.support.redis_server import RedisServer

ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}
BIG = "test-org/big-70B-GGUF:Q4_K_M"
HUGE = "test-org/huge-405B-GGUF:Q4_K_M"
EVIL = 'x/<img src=x onerror="window.pwned=1">:<b>Q4</b>'
EVIL_WORKER = "<script>window.pwned=2</script>"


def worker(public_id: str) -> Worker:
    return Worker(key=secrets.token_hex(32), public_id=public_id, session_id="s")


def put_group(service: GroupService, model: str, head: Worker,
              members: list[tuple[Worker, int, Route]], *, head_layers: int = 4,
              phase: Phase = Phase.READY, age_s: float = 125.0,
              load_s: float | None = 2.5) -> Group:
    """A group in the service's tables as ``GroupService._form`` leaves it (the head first,
    the members in layer order), in ``phase``, planned ``age_s`` ago."""
    plans = [MemberPlan(key=head.key, start=0, end=head_layers, device_layers=(head_layers,),
                        holds_bytes=0, usable_bytes=0, headroom_mb=0, route=Route.LOCAL)]
    start = head_layers
    for member, layers, route in members:
        plans.append(MemberPlan(key=member.key, start=start, end=start + layers,
                                device_layers=(layers,), holds_bytes=0, usable_bytes=0,
                                headroom_mb=0, route=route))
        start += layers
    plan = GroupPlan(head=head.key, members=tuple(plans), build="ggml-0.25.3/rpc-7.0.0",
                     n_ctx=2048, kv_bytes_per_layer=0, total_bytes=0, headroom_fraction=0.0,
                     reserve_mb=0, link_ms=0.0)
    group = Group(id=secrets.token_hex(8), model=model, sha256="0" * 64, size_bytes=0,
                  plan=plan, head=head, members={m.key: m for m, _, _ in members},
                  tokens={m.key: "00" for m, _, _ in members},
                  started=service.clock() - age_s, phase=phase, load_s=load_s)
    service.groups[group.id] = group
    service.by_model[model] = group
    service.outcomes[model] = f"group {group.id} {phase}"
    return group


def relay_usage(service: GroupService, monkeypatch: pytest.MonkeyPatch,
                usage: dict[str, RelayUsage]) -> None:
    """The relay's counters as they stand after traffic (the relay itself is tested in
    ``tests/queen_server/placement/test_group_relay.py``)."""
    monkeypatch.setattr(service.relay, "usage", lambda group: usage.get(group, RelayUsage()))


def freeze(service: GroupService) -> None:
    """Stop the service's clock, so that ages are the same on every read."""
    now = service.clock()
    service.clock = lambda: now


def swarm_of_groups(service: GroupService, monkeypatch: pytest.MonkeyPatch) -> Group:
    """A ready group of BIG over a direct and a relayed member, a forming group of HUGE, and
    the planner's outcomes: a group-only model no group could be formed for, a model whose
    group ended, and one a single worker holds (no group needed)."""
    freeze(service)
    head, near, far = worker("w_head"), worker("w_near"), worker("w_far")
    big = put_group(service, BIG, head, [(near, 12, Route.DIRECT), (far, 1, Route.RELAYED)])
    put_group(service, HUGE, worker("w_h2"), [(worker("w_m2"), 30, Route.DIRECT)],
              head_layers=2, phase=Phase.FORMING, age_s=3.0, load_s=None)
    relay_usage(service, monkeypatch, {big.id: RelayUsage(channels=2, opened=3,
                                                          bytes_to_members=1_000_000,
                                                          bytes_to_head=572_864)})
    service.group_only.add("test-org/giant-GGUF:Q8_0")
    service.outcomes["test-org/giant-GGUF:Q8_0"] = (
        "not_enough_memory: the rpc workers hold 40 GB of the 75 GB it needs")
    service.outcomes["test-org/mid-GGUF:Q4_K_M"] = "group 0123abcd ended: worker w_x left"
    service.outcomes["test-org/small-GGUF:Q4_K_M"] = "fits_one_worker: w_y holds it alone"
    return big


async def test_the_json_lists_each_group_and_the_models_without_one(
        web_queen: QueenHarness, monkeypatch: pytest.MonkeyPatch) -> None:
    big = swarm_of_groups(web_queen.state.groups, monkeypatch)
    async with httpx.AsyncClient(base_url=web_queen.base_url, trust_env=False) as http:
        answer = await http.get("/admin/api/groups", headers=ADMIN)
    assert answer.status_code == 200, answer.text
    data = answer.json()
    assert [row["model"] for row in data["groups"]] == [BIG, HUGE]
    ready, forming = data["groups"]
    assert ready == {
        "id": big.id, "model": BIG, "phase": "ready", "head": "w_head",
        "members": [{"worker": "w_head", "layers": 4, "route": "local"},
                    {"worker": "w_near", "layers": 12, "route": "direct"},
                    {"worker": "w_far", "layers": 1, "route": "relayed"}],
        "members_text": ["w_head (4 layers, head)", "w_near (12 layers, direct)",
                         "w_far (1 layer, relayed)"],
        "size": 3, "since_s": 125.0, "load_s": 2.5,
        "relayed_channels": 2, "relayed_bytes": 1_572_864}
    assert (forming["phase"], forming["size"], forming["load_s"],
            forming["relayed_channels"]) == ("forming", 2, None, 0)
    # The group-only model first (its requests fail), then the one whose group ended; none
    # for a model with a live group, nor for one a single worker holds.
    assert data["models"] == [
        {"model": "test-org/giant-GGUF:Q8_0", "group_only": True,
         "served_by": reports.SERVED_BY_NO_ONE,
         "outcome": "not_enough_memory: the rpc workers hold 40 GB of the 75 GB it needs"},
        {"model": "test-org/mid-GGUF:Q4_K_M", "group_only": False,
         "served_by": reports.SERVED_BY_HOLDERS,
         "outcome": "group 0123abcd ended: worker w_x left"}]


async def test_a_group_only_model_without_an_outcome_yet_is_being_planned(
        web_queen: QueenHarness) -> None:
    web_queen.state.groups.group_only.add(BIG)
    async with httpx.AsyncClient(base_url=web_queen.base_url, trust_env=False) as http:
        data = (await http.get("/admin/api/groups", headers=ADMIN)).json()
    assert data == {"groups": [], "models": [{
        "model": BIG, "group_only": True, "served_by": reports.SERVED_BY_NO_ONE,
        "outcome": "its group is being planned"}]}


async def test_the_groups_page_and_json_are_for_the_admin_only(web_queen: QueenHarness) -> None:
    async with httpx.AsyncClient(base_url=web_queen.base_url, trust_env=False) as http:
        for headers in ({}, {"authorization": "Bearer not-the-admin-token"},
                        {"authorization": "Bearer test-key"}):
            refused = await http.get("/admin/api/groups", headers=headers)
            assert refused.status_code == 401, headers
            assert "error" in refused.json()
            page = await http.get("/admin/groups", headers=headers)
            assert page.status_code == 303, headers
            assert page.headers["location"] == "/admin/login?next=%2Fadmin%2Fgroups"
            assert "w_head" not in page.text


async def test_the_page_renders_what_the_json_answers(
        web_queen: QueenHarness, monkeypatch: pytest.MonkeyPatch) -> None:
    swarm_of_groups(web_queen.state.groups, monkeypatch)
    async with httpx.AsyncClient(base_url=web_queen.base_url, trust_env=False,
                                 headers=ADMIN) as http:
        html = await http.get("/admin/groups")
        answer = await http.get("/admin/api/groups")
    assert html.status_code == 200
    assert html.headers["cache-control"] == "no-store"
    assert page_data(html.text) == ("/admin/api/groups", answer.json())
    text = html.text
    assert '<a href="/admin/groups" class="active" aria-current="page">Groups</a>' in text
    for shown in ("w_head (4 layers, head), w_near (12 layers, direct), w_far (1 layer, relayed)",
                  '<span class="badge good">ready</span>', '<span class="badge">forming</span>',
                  '<a href="/admin/workers/w_head">w_head</a>', "2m 5s", "2.50 s", "1.5 MB",
                  "not_enough_memory: the rpc workers hold 40 GB of the 75 GB it needs",
                  reports.SERVED_BY_NO_ONE, "group 0123abcd ended: worker w_x left"):
        assert shown in text, shown
    assert "fits_one_worker" not in text.split('id="page-data"')[0]


async def test_model_names_and_worker_ids_are_escaped(
        web_queen: QueenHarness, monkeypatch: pytest.MonkeyPatch) -> None:
    service = web_queen.state.groups
    put_group(service, EVIL, worker(EVIL_WORKER), [(worker("w_m"), 3, Route.RELAYED)])
    service.group_only.add(EVIL + "2")
    service.outcomes[EVIL + "2"] = f"not_enough_memory: {EVIL_WORKER} left"
    async with httpx.AsyncClient(base_url=web_queen.base_url, trust_env=False,
                                 headers=ADMIN) as http:
        html = (await http.get("/admin/groups")).text
    tables = html.split("<main")[1].split('id="page-data"')[0]
    assert "<img" not in tables
    assert "<script>window" not in tables
    assert "<b>" not in tables
    assert "&lt;img src=x onerror=&#34;window.pwned=1&#34;&gt;:&lt;b&gt;Q4&lt;/b&gt;" in tables
    assert "&lt;script&gt;window.pwned=2&lt;/script&gt; (4 layers, head)" in tables
    # The head's link: its id quoted in the address, escaped in the text.
    assert ('<a href="/admin/workers/%3Cscript%3Ewindow.pwned%3D2%3C%2Fscript%3E">'
            "&lt;script&gt;window.pwned=2&lt;/script&gt;</a>") in tables
    # The embedded JSON cannot close its script element.
    data = html.split('id="page-data">')[1].split("</script>")[0]
    assert "<" not in data


async def test_the_table_fills_from_the_json_live_and_shows_hostile_names_as_text(
        web_queen: QueenHarness, browser: Browser, monkeypatch: pytest.MonkeyPatch) -> None:
    errors: list[str] = []
    service = web_queen.state.groups
    page = await new_page(browser, errors)
    await log_in(page, web_queen.base_url)
    await page.click("nav >> text=Groups")
    await expect(page).to_have_url(web_queen.base_url + "/admin/groups")
    await expect(page.locator('[data-empty-for="groups"]')).to_have_text(
        "No group is forming or serving now.")
    await expect(page.locator('[data-empty-for="groups"]')).to_be_visible()
    # Groups form after the page was drawn: the script's polling shows them.
    big = swarm_of_groups(service, monkeypatch)
    evil = put_group(service, EVIL, worker(EVIL_WORKER), [(worker("w_m"), 3, Route.RELAYED)],
                     phase=Phase.LOADING, load_s=None, age_s=3700)
    await expect(page.locator("#groups tbody tr")).to_have_count(3)
    await expect(page.locator(f'#groups tbody tr[data-key="{big.id}"] td')).to_have_text(
        [BIG, "ready", "w_head",
         "w_head (4 layers, head), w_near (12 layers, direct), w_far (1 layer, relayed)",
         "3", "2m 5s", "2.50 s", "2", "1.5 MB"])
    await expect(page.locator(f'#groups tbody tr[data-key="{big.id}"] .badge.good')
                 ).to_have_text("ready")
    row = page.locator(f'#groups tbody tr[data-key="{evil.id}"] td')
    await expect(row.nth(0)).to_have_text(EVIL)
    await expect(row.nth(2)).to_have_text(EVIL_WORKER)
    await expect(row.nth(3)).to_have_text(f"{EVIL_WORKER} (4 layers, head), w_m (3 layers, "
                                          "relayed)")
    await expect(row.nth(5)).to_have_text("1h 1m")
    await expect(page.locator("#ungrouped tbody tr")).to_have_count(2)
    await expect(page.locator("#ungrouped tbody tr").first.locator("td")).to_have_text(
        ["test-org/giant-GGUF:Q8_0", reports.SERVED_BY_NO_ONE,
         "not_enough_memory: the rpc workers hold 40 GB of the 75 GB it needs"])
    assert await page.locator("#groups img, #groups b, #groups script").count() == 0
    assert await page.evaluate("() => window.pwned") is None
    # A group that ends leaves the table; its model moves to the second one with why.
    service.end(big, "worker w_far left")
    await expect(page.locator(f'#groups tbody tr[data-key="{big.id}"]')).to_have_count(0)
    await expect(page.locator(f'#ungrouped tbody tr[data-key="{BIG}"] td').nth(2)).to_have_text(
        re.compile(r"group [0-9a-f]+ ended: worker w_far left"))
    assert errors == []


FORMAT_CASES: list[tuple[object, str]] = [
    (0, "bytes"), (1, "bytes"), (1023, "bytes"), (1024, "bytes"), (1280, "bytes"),
    (1_572_864, "bytes"), (5 * 2**30, "bytes"), (3 * 2**40 + 1, "bytes"), (2**52, "bytes"),
    (None, "bytes"), (0, "duration"), (59.9, "duration"), (125, "duration"),
    (3700, "duration"), (90_000, "duration"), (-5, "duration"),
    ("ready", "state"), ("forming", "state"),
]


async def test_the_page_script_formats_bytes_and_durations_like_the_server(
        web_queen: QueenHarness, browser: Browser) -> None:
    page = await new_page(browser)
    await page.goto(web_queen.base_url + "/")
    shown = await page.evaluate("(cases) => cases.map(([v, k]) => window.Apiary.fmt(v, k))",
                                [[value, kind] for value, kind in FORMAT_CASES])
    expected = [formatting.fmt(value, kind) for value, kind in FORMAT_CASES]
    assert list(zip(FORMAT_CASES, shown, strict=True)) == list(
        zip(FORMAT_CASES, expected, strict=True))
    assert expected[4:6] == ["1.3 KB", "1.5 MB"]
    assert expected[12] == "2m 5s"


# --- merging the replicas' parts ----------------------------------------------------------

def part(groups: list[Any], models: list[Any]) -> dict[str, Any]:
    return {"groups": groups, "models": models}


def test_merged_parts_keep_each_replicas_groups_and_drop_models_grouped_elsewhere() -> None:
    here = part([{"id": "b1", "model": "m/b", "members": [
        {"worker": "w1", "layers": 2, "route": "local"}]}],
        [{"model": "m/a", "group_only": False, "outcome": "too_few_candidates: one"},
         {"model": "m/c", "group_only": True, "outcome": "not_enough_memory: here"}])
    there = part([{"id": "a1", "model": "m/a", "members": []}],
                 [{"model": "m/c", "group_only": False, "outcome": "no_trusted_head: there"},
                  {"model": "m/c", "group_only": False, "outcome": "no_trusted_head: there"},
                  {"model": "m/b", "group_only": True, "outcome": "builds_differ: x"}])
    merged = reports.merge_groups([here, there])
    assert [(g["id"], g["size"], g["members_text"]) for g in merged["groups"]] == [
        ("a1", 0, []), ("b1", 1, ["w1 (2 layers, head)"])]
    # m/a and m/b have a group on some replica; m/c has none anywhere: group-only on one.
    assert merged["models"] == [{
        "model": "m/c", "group_only": True, "served_by": reports.SERVED_BY_NO_ONE,
        "outcome": "not_enough_memory: here; no_trusted_head: there"}]


def test_malformed_parts_from_a_replica_are_skipped() -> None:
    good = part([{"id": "g", "model": "m", "members": [
        {"worker": "w", "layers": 1, "route": "relayed"}, "junk", None]}], [])
    junk: list[Any] = [None, "text", 5, [], {"groups": "no", "models": 7},
                       part([1, "x", None], [None, {"model": 3}, {"outcome": "x"}, "m"]),
                       {"groups": None, "models": None}]
    merged = reports.merge_groups([good, *junk])
    assert [(g["id"], g["members_text"]) for g in merged["groups"]] == [
        ("g", ["w (1 layer, relayed)"])]
    assert merged["models"] == []


def test_ungrouped_leaves_out_models_with_a_group_and_those_one_worker_holds() -> None:
    rows = reports.ungrouped(
        {"a": "group 1 ready", "b": "fits_one_worker: w holds it", "c": "no_layers: none",
         "d": "fits_one_worker: just now"},
        group_only={"d", "e"}, grouped={"a"})
    assert [(r["model"], r["group_only"], r["outcome"]) for r in rows] == [
        ("c", False, "no_layers: none"), ("d", True, "fits_one_worker: just now"),
        ("e", True, "its group is being planned")]


# --- replicas (issue 18) --------------------------------------------------------------------

@pytest.fixture
async def pair(tmp_path: Path, redis_server: RedisServer
               ) -> AsyncIterator[tuple[QueenHarness, QueenHarness]]:
    async with AsyncExitStack() as stack:
        queens = []
        for name in "ab":
            (tmp_path / name).mkdir()
            queens.append(await stack.enter_async_context(running_queen(
                tmp_path / name, admin_token=ADMIN_TOKEN, redis_url=redis_server.url,
                replica_id=name)))
        yield queens[0], queens[1]


@pytest.mark.timeout(120)
async def test_a_replica_shows_the_groups_that_live_on_another(
        pair: tuple[QueenHarness, QueenHarness], monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = pair
    big = swarm_of_groups(a.state.groups, monkeypatch)
    b.state.groups.outcomes[BIG] = "not_enough_memory: b's workers are too few"
    b.state.groups.outcomes["test-org/giant-GGUF:Q8_0"] = "too_few_candidates: b has one"
    async with httpx.AsyncClient(base_url=b.base_url, trust_env=False, timeout=20) as http:
        answer = (await http.get("/admin/api/groups", headers=ADMIN)).json()
        page = await http.get("/admin/groups", headers=ADMIN)
    assert [(g["id"], g["model"], g["relayed_bytes"]) for g in answer["groups"]] == [
        (big.id, BIG, 1_572_864), (a.state.groups.by_model[HUGE].id, HUGE, 0)]
    # BIG has a group on a: b's outcome for it is no reason to worry. The giant one has none
    # anywhere: both replicas' reasons, b's own first.
    assert [(m["model"], m["group_only"], m["outcome"]) for m in answer["models"]] == [
        ("test-org/giant-GGUF:Q8_0", True, "too_few_candidates: b has one; not_enough_memory: "
         "the rpc workers hold 40 GB of the 75 GB it needs"),
        ("test-org/mid-GGUF:Q4_K_M", False, "group 0123abcd ended: worker w_x left")]
    assert page.status_code == 200
    assert "w_near (12 layers, direct)" in page.text
