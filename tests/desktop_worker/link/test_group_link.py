"""The link's side of model groups (issue 19) over a real websocket on 127.0.0.1, against a
scripted queen: a worker that does not join groups (no ``on_group``) or is paused answers
``group_serve``/``group_lead`` at once with ``group_failed``, ignores ``group_end``; one that
joins gets each command with a report that answers on the same session, and hears when that
session ends (its group must not outlive it). On the relayed route, channels' bytes come and
go as binary frames on that session, and a worker that does not join groups closes a channel
the queen opens to it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from websockets.asyncio.server import ServerConnection, serve

from desktop_worker.jobs import JobRunner
from desktop_worker.link.backoff import Backoff
from desktop_worker.link.client import LinkClient
from desktop_worker.link.machine import RelayData
from shared_schema import (
    SUBPROTOCOL,
    Challenge,
    Fetch,
    GroupClose,
    GroupEnd,
    GroupFailed,
    GroupLead,
    GroupLink,
    GroupMemberReady,
    GroupOpen,
    GroupServe,
    Hello,
    Ping,
    Welcome,
    decode,
    encode,
)
from shared_schema.groups import MAX_RELAY_PAYLOAD, parse_relay_frame, relay_frame
from tests.support.workers import new_key, signed_hello

GROUP = "ab" * 8
TOKEN = "cd" * 32
PRINT = "ef" * 32
SERVE = GroupServe(group=GROUP, head="head1", token=TOKEN, layers=20, model="org/repo:Q4_0")
LEAD = GroupLead(group="12" * 8, head="head1", model="org/repo:Q4_0", n_ctx=512,
                 head_layers=[10], members=[GroupLink(worker_id="m1", host="127.0.0.1",
                                                      port=40000, fingerprint=PRINT,
                                                      token=TOKEN, device_layers=[20])])


async def welcome(ws: ServerConnection) -> None:
    """The queen's side of the handshake: challenge, the worker's hello, welcome."""
    await ws.send(encode(Challenge(nonce="ab" * 16)))
    assert isinstance(decode(await ws.recv()), Hello)
    await ws.send(encode(Welcome(session_id="s", worker_id="w", heartbeat_interval_s=15)))


class ScriptedQueen:
    """Welcomes one worker, sends it ``frames``, reads ``expect`` answers, then sends a ping
    and records anything else it answers before the pong (which must be nothing)."""

    def __init__(self, frames: list[Any], expect: int, *,
                 hold: asyncio.Event | None = None) -> None:
        self.frames = frames
        self.expect = expect
        self.hold = hold  # when set: keep the session open until it is set
        self.answers: list[Any] = []
        self.done = asyncio.Event()

    async def handle(self, ws: ServerConnection) -> None:
        await welcome(ws)
        for frame in self.frames:
            await ws.send(encode(frame))
        async for raw in ws:
            message = decode(raw)
            if message.type != "status":
                self.answers.append(message)
            if len(self.answers) == self.expect:
                break
        await ws.send(encode(Ping(ts=1.0)))
        async for raw in ws:
            message = decode(raw)
            if message.type == "pong":
                break
            if message.type != "status":
                self.answers.append(message)
        self.done.set()
        if self.hold is not None:
            await self.hold.wait()


@pytest.fixture
async def queen_at() -> AsyncIterator[Callable[[ScriptedQueen], Any]]:
    servers = []

    async def start(queen: ScriptedQueen) -> str:
        server = await serve(queen.handle, "127.0.0.1", 0, subprotocols=[SUBPROTOCOL])
        servers.append(server)
        return f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}/worker"

    yield start
    for server in servers:
        server.close()
        await server.wait_closed()


def client_for(url: str, **kwargs: Any) -> LinkClient:
    key = new_key()

    async def hello_for() -> tuple[Any, int]:
        return (lambda nonce, origin: signed_hello(key, nonce, models=[], origin=origin)), 1

    runner = JobRunner(None, has_model=lambda name: False)  # type: ignore[arg-type]
    return LinkClient(url, hello_for, runner, backoff=Backoff(base_s=30), **kwargs)


async def serve_once(client: LinkClient, queen: ScriptedQueen | RelayQueen) -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(client.run(stop))
    try:
        async with asyncio.timeout(20):
            await queen.done.wait()
    finally:
        stop.set()
        async with asyncio.timeout(20):
            await task


async def test_a_worker_that_does_not_join_groups_says_so_at_once(queen_at) -> None:
    queen = ScriptedQueen([SERVE, LEAD, GroupEnd(group=GROUP)], 2)
    await serve_once(client_for(await queen_at(queen)), queen)
    assert [(a.type, a.group, a.code) for a in queen.answers] == [
        ("group_failed", SERVE.group, "not_allowed"), ("group_failed", LEAD.group, "not_allowed")]


async def test_a_fetch_for_a_group_is_refused_by_a_worker_that_does_not_join_groups(
        queen_at) -> None:
    """A worker that takes fetches but not groups refuses to download a model to lead a group
    (it could not serve it); its ordinary fetches still reach its handler."""
    fetch = {"name": "org/repo:Q4_0", "repo_id": "org/repo", "revision": "a" * 40,
             "paths": ["m-Q4_0.gguf"], "sha256": "b" * 64, "size_bytes": 1 << 30}
    fetched: list[Any] = []
    queen = ScriptedQueen([Fetch(**fetch, group=True), Fetch(**fetch)], 1)
    client = client_for(await queen_at(queen), on_fetch=lambda f, report: fetched.append(f))
    await serve_once(client, queen)
    assert [(a.type, a.code) for a in queen.answers] == [("fetch_failed", "not_allowed")]
    assert "model groups" in queen.answers[0].message
    assert fetched == [Fetch(**fetch)]


async def test_a_paused_worker_answers_paused_and_the_handler_hears_only_ends(queen_at) -> None:
    heard: list[Any] = []
    queen = ScriptedQueen([SERVE, LEAD, GroupEnd(group=GROUP)], 2)
    client = client_for(await queen_at(queen), on_group=lambda m, report: heard.append(m))
    client.set_paused("on battery")
    await serve_once(client, queen)
    assert [(a.type, a.code) for a in queen.answers] == [("group_failed", "paused")] * 2
    assert "on battery" in queen.answers[0].message
    assert heard == [GroupEnd(group=GROUP)]


async def test_a_joining_worker_answers_on_the_session_and_hears_it_end(queen_at) -> None:
    ready = GroupMemberReady(group=GROUP, host="127.0.0.1", port=40000, fingerprint=PRINT)
    heard: list[Any] = []
    reports: list[Any] = []
    ended = asyncio.Event()

    def on_group(message: Any, report: Any) -> None:
        heard.append(message)
        reports.append(report)
        if isinstance(message, GroupServe):
            asyncio.get_running_loop().create_task(report(ready))

    hold = asyncio.Event()
    queen = ScriptedQueen([SERVE, GroupEnd(group=GROUP, reason="done")], 1, hold=hold)
    url = await queen_at(queen)
    client = client_for(url, on_group=on_group, on_session_end=ended.set)
    stop = asyncio.Event()
    task = asyncio.create_task(client.run(stop))
    try:
        async with asyncio.timeout(20):
            await queen.done.wait()
        assert heard == [SERVE, GroupEnd(group=GROUP, reason="done")]
        assert queen.answers == [ready]  # on the session that carried the command
        assert not ended.is_set()
        hold.set()  # the queen ends the session
        async with asyncio.timeout(20):
            await ended.wait()
        # a report after the session ended goes nowhere and raises nothing
        await reports[0](GroupFailed(group=GROUP, code="lost"))
    finally:
        stop.set()
        async with asyncio.timeout(20):
            await task


# --- the relayed route: group_open/group_close and binary data frames ---------------------------


class RelayQueen:
    """Welcomes one worker, opens channel 7 to it and sends it bytes on 7 and on a channel it
    never opened, then records what comes back (text decoded, binary parsed) until a
    ``group_close``."""

    def __init__(self) -> None:
        self.got: list[Any] = []
        self.done = asyncio.Event()

    async def handle(self, ws: ServerConnection) -> None:
        await welcome(ws)
        await ws.send(encode(GroupOpen(group=GROUP, channel=7, member="w")))
        await ws.send(relay_frame(7, b"challenge?"))
        await ws.send(relay_frame(8, b"for no channel"))
        await ws.send(b"\x02not a relay frame")
        async for raw in ws:
            if isinstance(raw, bytes):
                channel, payload = parse_relay_frame(raw)
                self.got.append((channel, bytes(payload)))
                continue
            message = decode(raw)
            if message.type == "status":
                continue
            self.got.append(message)
            if message.type == "group_close":
                break
        self.done.set()


async def test_relayed_channels_go_both_ways_as_binary_frames_on_the_session(queen_at) -> None:
    heard: list[Any] = []
    reports: list[Any] = []
    data: list[tuple[int, bytes]] = []

    def on_group(message: Any, report: Any) -> None:
        heard.append(message)
        reports.append(report)  # bound to this session: it sends the channel's frames

    async def on_relay(channel: int, payload: bytes) -> None:
        data.append((channel, payload))
        if payload == b"challenge?":
            await reports[0](RelayData(channel, b"x" * (MAX_RELAY_PAYLOAD + 10)))  # two frames
            await reports[0](GroupClose(group=GROUP, channel=channel, reason="done"))

    queen = RelayQueen()
    await serve_once(client_for(await queen_at(queen), on_group=on_group, on_relay=on_relay),
                     queen)
    assert heard == [GroupOpen(group=GROUP, channel=7, member="w")]
    # the handler gets every well-formed data frame (the channel table drops unknown ones)
    assert data == [(7, b"challenge?"), (8, b"for no channel")]
    assert queen.got == [(7, b"x" * MAX_RELAY_PAYLOAD), (7, b"x" * 10),
                         GroupClose(group=GROUP, channel=7, reason="done")]


async def test_a_worker_that_does_not_join_groups_closes_a_channel_back(queen_at) -> None:
    queen = RelayQueen()
    await serve_once(client_for(await queen_at(queen)), queen)
    assert queen.got == [GroupClose(group=GROUP, channel=7,
                                    reason="this worker does not join model groups")]

