"""Failover of a model group's answer (issue 19): a head that fails mid-answer has lost a part of
its group, so the dispatcher ends the group, waits for the next one and goes on on its head
(often the same worker), with what was delivered as the continuation. Real queen, real
websockets, a scripted head; the group service is a fake that speaks ``GroupJobs``."""

from __future__ import annotations

import asyncio

import httpx
import orjson

from queen_server.http import sse
from queen_server.swarm.dispatch import MAX_REGROUPS
from queen_server.swarm.jobs import Shares
from queen_server.swarm.worker import Worker
from tests.queen_server.swarm.test_failover import FULL, USER, sse_events
from tests.support.queen import QueenHarness
from tests.support.sse import text_of
from tests.support.workers import ECHO_MODEL, ScriptedWorker

BODY = {"model": ECHO_MODEL, "messages": USER, "stream": True}
MEMBER = "ab" * 32


class FakeGroups:
    """One group headed by ``head``; ``regrouped`` waits for ``reformed``, then the group is
    "g2", its head behaves as ``then`` says (when set), and the answer is ``why``."""

    def __init__(self, head: ScriptedWorker) -> None:
        self.scripted = head
        self.head = head.pubkey
        self.then: str | None = None
        self.group = "g1"
        self.lost: list[tuple[str, str]] = []
        self.waits: list[float] = []
        self.waiting = asyncio.Event()
        self.reformed = asyncio.Event()
        self.why: str | None = None

    def credit(self, worker: Worker, model: str) -> tuple[str, Shares]:
        if worker.key != self.head:
            return "", ()
        return self.group, ((worker.key, 2), (MEMBER, 1))

    def job_lost(self, group: str, worker: Worker, reason: str) -> None:
        self.lost.append((group, worker.key))

    async def regrouped(self, model: str, timeout_s: float) -> str | None:
        self.waits.append(timeout_s)
        self.waiting.set()
        await self.reformed.wait()
        self.group = "g2"
        if self.then is not None:
            self.scripted.behaviour = self.then
        return self.why


async def head_of_group(queen: QueenHarness, behaviour: str) -> tuple[ScriptedWorker, FakeGroups]:
    head = await ScriptedWorker(queen.ws_url, behaviour=behaviour, continues=True).start()
    groups = FakeGroups(head)
    queen.state.dispatcher.groups = groups
    return head, groups


async def test_a_stream_waits_for_its_group_to_re_form_and_goes_on_on_its_head(queen):
    head, groups = await head_of_group(queen, "fail_mid")
    groups.then = "echo"  # the re-formed group answers
    task = asyncio.create_task(sse_events(queen, BODY))
    async with asyncio.timeout(5):
        await head.job_arrived.wait()
    head.release.set()
    async with asyncio.timeout(5):
        await groups.waiting.wait()
    assert groups.lost == [("g1", head.pubkey)]  # the group that failed is ended at once
    assert len(head.jobs) == 1  # nothing is sent before the new group is ready
    assert 0 < groups.waits[0] <= queen.state.settings.group_failover_wait_s
    groups.reformed.set()
    events = await asyncio.wait_for(task, 15)
    assert events[-1] == "[DONE]"
    assert not any("error" in event for event in events if isinstance(event, dict))
    assert text_of(events) == FULL  # nothing missing, nothing twice
    # The same worker, heading the new group, continued exactly what the client had.
    assert [job.continuation for job in head.jobs] == [None, "echo: one"]


async def test_no_new_group_ends_the_stream_with_the_planner_s_reason(queen):
    head, groups = await head_of_group(queen, "fail_mid")
    groups.why = "too_small: the workers left hold 300 MB of the 560 MB it needs"
    groups.reformed.set()
    task = asyncio.create_task(sse_events(queen, BODY))
    async with asyncio.timeout(5):
        await head.job_arrived.wait()
    head.release.set()
    events = await asyncio.wait_for(task, 15)
    assert text_of(events) == "echo: one"
    assert "[DONE]" not in events
    error = events[-1]["error"]
    assert error["code"] == "worker_lost"
    assert "no new group took over: too_small" in error["message"]
    assert len(head.jobs) == 1
    await queen.wait_until(lambda: all(not w.jobs for w in queen.state.registry),
                           what="leases released")


async def test_a_head_that_keeps_failing_is_given_up_on(queen):
    """A head that fails its answer each time (broken, or lying) is not waited on for ever:
    after ``MAX_REGROUPS`` new groups it is a failed worker like any other."""
    head, groups = await head_of_group(queen, "fail_mid")
    groups.reformed.set()
    head.release.set()
    events = await asyncio.wait_for(sse_events(queen, BODY), 15)
    assert events[-1]["error"]["code"] == "worker_lost"
    assert len(groups.lost) == MAX_REGROUPS
    assert len(head.jobs) == MAX_REGROUPS + 1


async def test_a_head_that_fails_before_its_first_token_is_retried_on_the_new_group(queen):
    head, groups = await head_of_group(queen, "error")
    groups.then = "echo"
    groups.reformed.set()
    task = asyncio.create_task(sse_events(queen, BODY))
    events = await asyncio.wait_for(task, 15)
    assert text_of(events) == FULL
    assert groups.lost == [("g1", head.pubkey)]
    assert [job.continuation for job in head.jobs] == [None, None]  # a plain retry


async def test_a_stream_waiting_for_its_group_is_kept_alive(queen, monkeypatch):
    """A group re-forming can take minutes (its members load their layers again): the stream
    sends SSE comments meanwhile, which clients skip, so no proxy or client times it out."""
    monkeypatch.setattr(sse, "KEEPALIVE_S", 0.01)
    head, groups = await head_of_group(queen, "fail_mid")
    groups.then = "echo"
    lines: list[str] = []

    async def read() -> None:
        async with httpx.AsyncClient(base_url=queen.base_url, timeout=20) as http, \
                http.stream("POST", "/v1/chat/completions", json=BODY) as response:
            async for line in response.aiter_lines():
                lines.append(line)
                if line == ": keepalive" and lines.count(line) == 3:
                    groups.reformed.set()  # three keepalives while it waited

    task = asyncio.create_task(read())
    async with asyncio.timeout(5):
        await head.job_arrived.wait()
    head.release.set()
    await asyncio.wait_for(task, 15)
    assert lines.count(": keepalive") >= 3
    assert lines[-2] == "data: [DONE]"
    data = [orjson.loads(line[6:]) for line in lines
            if line.startswith("data: {")]
    assert text_of(data) == FULL
