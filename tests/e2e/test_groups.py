"""Model groups end to end (issue 19): a queen on a 127.0.0.1 port, four real workers
(``WorkerService``: store, engine, link, and llama.cpp's RPC backend) and the fake hub with the
real SmolLM2. No worker can hold the model alone by the queen's rules (each claims 256 MB and
the operator keeps 176 MB of each free), so the queen forms a group: the worker holding the
file leads, two others serve layers through their gates. A developer's answer is the one a
single process writes, billed once and credited to the three by layers held. When a member
leaves mid-answer, the queen forms a new group with the spare worker and the answer goes on on
its head: the client gets one process's text with no break, and each worker is credited for
what it served. Both routes: workers with ``lan_groups`` on are linked directly (TLS
gates on their LAN address); with it off (the default) nothing listens and the queen relays
every byte between the head and its members over their websockets.
"""

from __future__ import annotations

import asyncio
import contextlib

import openai
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)

from desktop_worker.earnings import fetch_earnings
from desktop_worker.service import WorkerService
from desktop_worker.store import ModelStore
from queen_server.groups import Route
from queen_server.placement.groups import Group, Phase
from tests.queen_server.billing.test_billing_api import funded_key
from tests.support.fake_hub import FakeHub
from tests.support.on_demand import MODEL, repos, worker
from tests.support.one_process import ASK, one_process_text
from tests.support.queen import QueenHarness, running_queen
from tests.support.rpc import needs_rpc

pytestmark = [
    pytest.mark.timeout(420),
    needs_rpc,
]

MESSAGES = ASK["messages"]  # max_tokens 40, greedy
LONG = 160  # the answer a member leaves in the middle of
GROUPS = {"group_heads": "*", "group_reserve_mb": 176, "group_headroom_fraction": 0.0,
          "group_interval_s": 0.5, "group_setup_timeout_s": 60, "group_load_timeout_s": 120}
MEMBER = {"memory_budget_mb": 256, "threads": 1, "max_jobs": 1}


async def ready_group(queen: QueenHarness, without: str | None = None) -> Group:
    def ready() -> bool:
        group = queen.state.groups.by_model.get(MODEL)
        return (group is not None and group.phase is Phase.READY
                and (without is None or group.id != without))

    await queen.wait_until(ready, 180, "a ready group")
    return queen.state.groups.by_model[MODEL]


async def earned_msat(queen: QueenHarness, service: WorkerService) -> int:
    earnings = await fetch_earnings(queen.ws_url, service.identity)
    return earnings.available_msat + earnings.pending_msat


def roles_of(services: dict[str, WorkerService], group: Group) -> list[str]:
    """The names of the group's workers, the head first."""
    by_key = {s.identity.pubkey: name for name, s in services.items()}
    return [by_key[w.key] for w in group.parts]


@pytest.mark.parametrize("route", [Route.DIRECT, Route.RELAYED])
async def test_a_model_no_worker_holds_alone_is_served_by_a_group(tmp_path, route):
    member = {**MEMBER, "lan_groups": route is Route.DIRECT}
    with FakeHub(repos()) as hub:
        store = ModelStore(tmp_path / "head" / "models", endpoint=hub.url)
        await asyncio.to_thread(store.pull, MODEL)
        async with running_queen(tmp_path, hub_endpoint=hub.url, auth="keys", escrow_jobs=0,
                                 total_timeout_s=90, **GROUPS) as queen, \
                contextlib.AsyncExitStack() as stack:
            services: dict[str, WorkerService] = {}
            services["head"] = await stack.enter_async_context(
                worker(tmp_path, queen, hub, "head", store=store, **member))
            exits: dict[str, contextlib.AsyncExitStack] = {}
            for name in ("w1", "w2", "w3"):
                exits[name] = await stack.enter_async_context(contextlib.AsyncExitStack())
                services[name] = await exits[name].enter_async_context(
                    worker(tmp_path, queen, hub, name, **member))

            group = await ready_group(queen)
            names = roles_of(services, group)
            for part in group.parts:  # planned by the queen's own round trips, on loopback
                assert part.rtt_ms is not None
                assert 0 <= part.rtt_ms < 5_000
            assert names[0] == "head"  # the only worker holding the file leads
            assert len(names) == 3  # the fewest that hold it: one worker stays out
            members = names[1:]
            assert [m.route for m in group.plan.members[1:]] == [route, route]
            for name in members:  # held out of routing while the group lives
                assert queen.state.registry.get(services[name].identity.pubkey).held_by \
                    == group.id

            secret, _ = await funded_key(queen, 50)
            client = queen.client(api_key=secret)
            expected = await asyncio.to_thread(one_process_text, ASK, group.plan.n_ctx)
            for _ in range(2):  # a worker's first job is its unpaid proof of work
                answer = await client.chat.completions.create(
                    model=MODEL, messages=MESSAGES, temperature=0, max_tokens=40)
                assert answer.choices[0].message.content == expected
            for name in members:
                part = services[name].groups.part
                assert part is not None
                assert part.gate is not None
                assert part.gate.stats().round_trips > 0  # the layers ran there
            relayed = queen.state.groups.relay.usage(group.id)
            if route is Route.RELAYED:  # every byte went through the queen, none otherwise
                assert relayed.bytes_to_members > 1_000_000  # the weights, uploaded
                assert relayed.bytes_to_head > 0
            else:
                assert relayed.opened == 0
            # Billed once, credited to the three by layers held.
            earned = {}
            for name in names:
                earnings = await fetch_earnings(queen.ws_url, services[name].identity)
                earned[name] = earnings.available_msat + earnings.pending_msat
                assert earnings.jobs_settled == 2
            assert all(amount > 0 for amount in earned.values()), earned

            # A member leaves mid-answer: the queen ends the group, forms a new one with the
            # spare worker, and the answer goes on on its head with no break in the stream.
            gone = members[0]
            spare = next(n for n in ("w1", "w2", "w3") if n not in names)
            before = {n: await earned_msat(queen, services[n]) for n in (*names, spare)}
            longer = {**ASK, "max_tokens": LONG}
            stream = await client.chat.completions.create(
                model=MODEL, messages=MESSAGES, temperature=0, max_tokens=LONG, stream=True)
            received: list[str] = []
            finish = None
            async for chunk in stream:  # no error: the stream runs to its end
                if chunk.choices and chunk.choices[0].delta.content:
                    received.append(chunk.choices[0].delta.content)
                    if len(received) == 3:
                        await exits[gone].aclose()
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
            assert finish in ("length", "stop")
            again = queen.state.groups.by_model[MODEL]
            assert again.id != group.id
            assert set(roles_of(services, again)) == {"head", members[1], spare}
            # What came before the member left is one process's text; the new group went on
            # from it (greedy from the delivered text, re-read as a prompt, which may take
            # another path than one process's tokens did).
            text, before_loss = "".join(received), "".join(received[:3])
            whole = await asyncio.to_thread(one_process_text, longer, again.plan.n_ctx)
            assert whole.startswith(before_loss)
            assert len(text) > len(before_loss) + 100
            # The lost member is credited its share of the first part, and the spare's share
            # of the rest is its first job (its unpaid proof of work).
            after = {n: await earned_msat(queen, services[n]) for n in (*names, spare)}
            assert all(after[n] > before[n] for n in names), (before, after)
            spare_books = await fetch_earnings(queen.ws_url, services[spare].identity)
            assert spare_books.jobs_settled == 1
            # The new group serves the same text.
            answer = await client.chat.completions.create(
                model=MODEL, messages=MESSAGES, temperature=0, max_tokens=40)
            assert answer.choices[0].message.content == expected


async def test_a_model_no_worker_holds_is_fetched_onto_its_head_and_served_by_a_group(tmp_path):
    """No worker holds the file, none can hold the model alone: the queen fetches it onto the
    worker its plan makes the head (downloaded and checked, not loaded), no other worker
    downloads it, and the group forms once the head holds it. Relayed (the default route).
    By the queen's rule for groups (its operator keeps 176 MB of each 256 MB free) no worker
    holds it alone, though the placement's rule for one worker alone would."""
    with FakeHub(repos()) as hub:
        async with running_queen(tmp_path, hub_endpoint=hub.url, auth="keys", escrow_jobs=0,
                                 total_timeout_s=90, model_wait_s=0, **GROUPS) as queen, \
                contextlib.AsyncExitStack() as stack:
            services = {name: await stack.enter_async_context(
                worker(tmp_path, queen, hub, name, **MEMBER)) for name in ("w1", "w2", "w3")}
            secret, _ = await funded_key(queen, 50)
            client = queen.client(api_key=secret)
            with pytest.raises(openai.APIStatusError) as caught:
                await client.chat.completions.create(model=MODEL, messages=MESSAGES,
                                                     temperature=0, max_tokens=40)
            assert caught.value.status_code == 503
            error = caught.value.response.json()["error"]
            assert error["code"] == "model_loading"
            assert error["estimated_time"] > 0
            [head_key] = queen.state.placement.loading[MODEL].asked
            assert queen.state.placement.loading[MODEL].group
            assert MODEL in queen.state.groups.group_only

            group = await ready_group(queen)
            assert group.head.key == head_key  # the worker that fetched it leads
            names = roles_of(services, group)
            head = services[names[0]]
            assert [m.name for m in head.store.list()] == [MODEL]
            assert MODEL not in head.pool.loaded() or head.groups.part is not None
            for name, service in services.items():  # nobody else downloaded it
                if name != names[0]:
                    assert service.store.list() == []
            expected = await asyncio.to_thread(one_process_text, ASK, group.plan.n_ctx)
            for _ in range(2):  # a worker's first job is its unpaid proof of work
                answer = await client.chat.completions.create(
                    model=MODEL, messages=MESSAGES, temperature=0, max_tokens=40)
                assert answer.choices[0].message.content == expected


async def test_a_groups_answers_are_audited_by_a_trusted_auditor_that_holds_the_model(tmp_path):
    """Issue 39: a group's answer is re-scored by an auditor outside the group that can hold the
    whole model, here the operator's trusted auditor (an audit-only worker with the memory): the
    verdict counts for the head, and passes for honest work. Relayed (the default route)."""
    auditor_key = tmp_path / "auditor" / "key.pem"
    auditor_key.parent.mkdir(parents=True)
    private = Ed25519PrivateKey.generate()
    auditor_key.write_bytes(private.private_bytes(Encoding.PEM, PrivateFormat.PKCS8,
                                                  NoEncryption()))
    auditor_key.chmod(0o600)
    auditor_pubkey = private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()
    with FakeHub(repos()) as hub:
        store = ModelStore(tmp_path / "head" / "models", endpoint=hub.url)
        await asyncio.to_thread(store.pull, MODEL)
        audit_store = ModelStore(tmp_path / "auditor" / "models", endpoint=hub.url)
        await asyncio.to_thread(audit_store.pull, MODEL)
        async with running_queen(tmp_path, hub_endpoint=hub.url, auth="keys", escrow_jobs=0,
                                 total_timeout_s=90, audit_new_rate=1.0,
                                 audit_max_wait_s=120, trusted_auditors=[auditor_pubkey],
                                 **GROUPS) as queen, \
                contextlib.AsyncExitStack() as stack:
            services: dict[str, WorkerService] = {}
            services["head"] = await stack.enter_async_context(
                worker(tmp_path, queen, hub, "head", store=store, **MEMBER))
            for name in ("w1", "w2"):
                services[name] = await stack.enter_async_context(
                    worker(tmp_path, queen, hub, name, **MEMBER))
            auditor = await stack.enter_async_context(worker(
                tmp_path, queen, hub, "auditor", store=audit_store, auditor=True, threads=1,
                max_jobs=1, memory_budget_mb=2048))
            group = await ready_group(queen)
            assert auditor.identity.pubkey not in {part.key for part in group.parts}
            secret, _ = await funded_key(queen, 50)
            client = queen.client(api_key=secret)
            for _ in range(2):
                await client.chat.completions.create(
                    model=MODEL, messages=MESSAGES, temperature=0, max_tokens=40)
            audits = queen.state.audits
            await queen.wait_until(lambda: audits.idle, 120, "the group's answers audited")
            rows = await audits.store.recent(10, worker_key=group.head.key)
            assert len(rows) == 2  # both answers, each re-scored whole by the auditor
            assert all(row.auditor_key == auditor_pubkey and row.auditor_trusted
                       and not row.failed for row in rows)
            standing = audits.standing(group.head.key)
            assert (standing.audited, standing.failed) == (2, 0)
            for name in ("w1", "w2"):  # members are blamed only on failing verdicts
                assert await audits.store.recent(10, worker_key=services[name].identity.pubkey) \
                    == []
