"""A model group on one replica serving an answer asked of another (issues 18 and 19): two real
queen processes on one PostgreSQL and one real ``redis-server``, four real workers (with
llama.cpp's RPC backend and the real SmolLM2) connected to replica B, the developer's stream on
replica A. B forms a group (no worker holds the model alone by its rules); A's request crosses
the bus to B's head. When a member leaves mid-answer, A does not give up on B: it sends the
answer's continuation back to B naming the group that lost it (``ClusterJob.regroup``), B ends
that group, waits for the next one (with the spare worker) and continues on its head. The
client's stream runs to its end with no error."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import httpx
import orjson
import pytest

from desktop_worker.service import WorkerService
from desktop_worker.store import ModelStore
from queen_server.identity import public_id
from tests.support.fake_hub import FakeHub
from tests.support.on_demand import MODEL, repos, worker_at
from tests.support.one_process import ASK, one_process_text
from tests.support.processes import health
from tests.support.replicas import (  # noqa: F401  (shared_db is a fixture)
    local_workers,
    shared_db,
    start_replicas,
    until,
)
from tests.support.rpc import needs_rpc

pytestmark = [
    pytest.mark.timeout(300),
    needs_rpc,
]

ADMIN = "groups-replicas-admin"
LONG = 160
SETTINGS = {"auth": "open", "admin_token": ADMIN, "group_heads": "*", "group_reserve_mb": "176",
            "group_headroom_fraction": "0", "group_interval_s": "0.5",
            "group_setup_timeout_s": "60", "group_load_timeout_s": "120",
            "total_timeout_s": "120"}
MEMBER = {"memory_budget_mb": 256, "threads": 1, "max_jobs": 1}


def ready_group(port: int, not_id: str | None = None) -> dict[str, Any] | None:
    """The ready group of MODEL on the queen at ``port`` (all replicas merged), if any."""
    answer = httpx.get(f"http://127.0.0.1:{port}/admin/api/groups", timeout=5,
                       headers={"authorization": f"Bearer {ADMIN}"})
    if answer.status_code != 200:
        return None
    for group in answer.json()["groups"]:
        if group["model"] == MODEL and group["phase"] == "ready" and group["id"] != not_id:
            return group
    return None


def served(port: int) -> bool:
    """Whether a one-token answer of MODEL asked of the queen at ``port`` comes back."""
    answer = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60,
                        json={**ASK, "model": MODEL, "max_tokens": 1})
    return answer.status_code == 200


async def wait_group(port: int, not_id: str | None = None) -> dict[str, Any]:
    found: list[dict[str, Any]] = []

    def ready() -> bool:
        group = ready_group(port, not_id)
        if group is not None:
            found.append(group)
        return group is not None

    await until(ready, 180, "a ready group")
    return found[-1]


async def test_a_group_on_another_replica_re_forms_and_the_answer_goes_on(
        tmp_path, redis_server, shared_db) -> None:  # noqa: F811
    with FakeHub(repos()) as hub:
        store = ModelStore(tmp_path / "head" / "models", endpoint=hub.url)
        await asyncio.to_thread(store.pull, MODEL)
        ports, queens = await start_replicas(tmp_path, shared_db, redis_server.url,
                                             names="ab", hub_endpoint=hub.url, **SETTINGS)
        b_url = f"ws://127.0.0.1:{ports['b']}/worker"
        try:
            async with contextlib.AsyncExitStack() as stack:
                services: dict[str, WorkerService] = {}
                exits: dict[str, contextlib.AsyncExitStack] = {}
                for count, name in enumerate(("head", "w1", "w2", "w3"), start=1):
                    async def joined(_service: WorkerService, count: int = count) -> None:
                        await until(lambda: local_workers(ports["b"]) >= count, 30,
                                    f"{count} workers on b")

                    exits[name] = await stack.enter_async_context(contextlib.AsyncExitStack())
                    services[name] = await exits[name].enter_async_context(worker_at(
                        tmp_path, b_url, hub, name, joined,
                        store=store if name == "head" else None, **MEMBER))
                by_id = {public_id(s.identity.pubkey): name for name, s in services.items()}
                assert health(ports["a"])["workers"] == 0  # a holds no worker itself

                group = await wait_group(ports["a"])
                names = [by_id[m["worker"]] for m in group["members"]]
                assert names[0] == "head"
                assert len(names) == 3
                # A learns of b's group from b's next capacity report (each heartbeat): until
                # then a request made on a gets a 404, so wait for one that a serves.
                await until(lambda: served(ports["a"]), 30, "a to route to b's group")
                gone = names[1]
                spare = next(n for n in ("w1", "w2", "w3") if n not in names)

                body = {**ASK, "model": MODEL, "max_tokens": LONG, "stream": True}
                received: list[str] = []
                finish = None
                errors: list[Any] = []
                async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{ports['a']}",
                                             timeout=180) as http, \
                        http.stream("POST", "/v1/chat/completions", json=body) as response:
                    assert response.status_code == 200
                    async for line in response.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = orjson.loads(line[6:])
                        if "error" in chunk:
                            errors.append(chunk["error"])
                            continue
                        choice = chunk["choices"][0] if chunk.get("choices") else {}
                        if choice.get("delta", {}).get("content"):
                            received.append(choice["delta"]["content"])
                            if len(received) == 3:
                                await exits[gone].aclose()  # a member of b's group leaves
                        finish = choice.get("finish_reason") or finish
                assert errors == []
                assert finish in ("length", "stop")

                again = await wait_group(ports["a"], not_id=group["id"])
                assert {by_id[m["worker"]] for m in again["members"]} == {
                    "head", names[2], spare}
                text, before_loss = "".join(received), "".join(received[:3])
                longer = {**ASK, "max_tokens": LONG}
                whole = await asyncio.to_thread(one_process_text, longer)
                assert whole.startswith(before_loss)
                assert len(text) > len(before_loss) + 100  # it went on, on b's new group
        finally:
            for queen in queens.values():
                queen.stop()
