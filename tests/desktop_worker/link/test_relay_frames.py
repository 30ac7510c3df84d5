"""The link machine's side of a model group's relayed route (issue 19): a binary relayed data
frame becomes ``RelayData`` only once welcomed, a malformed binary frame is ignored like a bad
text frame, ``group_open``/``group_close`` become ``GroupCommand``s, and the worker's own
opens, closes and data frames go out only when welcomed, data split at ``MAX_RELAY_PAYLOAD``."""

from __future__ import annotations

import pytest

from desktop_worker.link.machine import GroupCommand, Link, RelayData, Send, State
from shared_schema import Challenge, GroupClose, GroupOpen, Hello, Welcome, decode, encode
from shared_schema.groups import MAX_RELAY_PAYLOAD, RELAY_TAG, parse_relay_frame, relay_frame
from tests.support.workers import new_key, signed_hello

GROUP = "ab" * 8
ORIGIN = "https://queen.example"


def _link() -> Link:
    key = new_key()

    def hello_for(nonce: str, origin: str) -> Hello:
        return signed_hello(key, nonce, models=[], max_jobs=1, origin=origin)

    return Link(hello_for, 1, ORIGIN)


def _ready() -> Link:
    link = _link()
    link.receive(encode(Challenge(nonce="ab" * 16)))
    link.receive(encode(Welcome(session_id="s", worker_id="w", heartbeat_interval_s=15)))
    assert link.state is State.READY
    return link


def test_a_relayed_data_frame_is_an_action_only_once_welcomed() -> None:
    frame = relay_frame(7, b"\x00rpc bytes")
    link = _link()
    assert link.receive(frame) == []  # awaiting the challenge: ignored, no violation
    assert link.state is State.AWAITING_CHALLENGE
    link.receive(encode(Challenge(nonce="ab" * 16)))
    assert link.receive(frame) == []  # awaiting the welcome
    assert link.state is State.AWAITING_WELCOME
    link = _ready()
    assert link.receive(frame) == [RelayData(7, b"\x00rpc bytes")]
    assert link.receive(bytearray(frame)) == [RelayData(7, b"\x00rpc bytes")]
    link.connection_lost()
    assert link.receive(frame) == []


@pytest.mark.parametrize("frame", [
    b"",
    bytes((RELAY_TAG,)),  # a tag and nothing else
    bytes((RELAY_TAG, 0, 0, 0, 7)),  # no payload
    bytes((RELAY_TAG, 0, 0, 0, 0)) + b"x",  # channel 0
    bytes((RELAY_TAG, 0xFF, 0xFF, 0xFF, 0xFF)) + b"x",  # past MAX_RELAY_CHANNEL
    bytes((2, 0, 0, 0, 7)) + b"x",  # another tag
    bytes((RELAY_TAG, 0, 0, 0, 7)) + b"x" * (MAX_RELAY_PAYLOAD + 1),  # too much
    encode(GroupClose(group=GROUP, channel=1)).encode(),  # JSON, but in a binary frame
])
def test_a_malformed_binary_frame_is_ignored(frame: bytes) -> None:
    link = _ready()
    assert link.receive(frame) == []
    assert link.state is State.READY


def test_opens_and_closes_from_the_queen_are_group_commands_only_when_ready() -> None:
    frames = [GroupOpen(group=GROUP, channel=3, member="m1"),
              GroupClose(group=GROUP, channel=3, reason="the head left")]
    link = _link()
    for frame in frames:  # before the challenge: a protocol violation, never a command
        assert not any(isinstance(a, GroupCommand) for a in link.receive(encode(frame)))
    link = _ready()
    for frame in frames:
        assert link.receive(encode(frame)) == [GroupCommand(frame)]
    # a malformed one (channel 0) is ignored like any bad frame
    bad = encode(frames[0]).replace('"channel":3', '"channel":0')
    assert '"channel":0' in bad
    assert link.receive(bad) == []


def test_the_workers_opens_closes_and_data_go_out_only_when_ready() -> None:
    open_ = GroupOpen(group=GROUP, channel=9, member="m1")
    close = GroupClose(group=GROUP, channel=9, reason="done")
    link = _link()
    assert link.group_report(open_) == []
    assert link.relay_data(9, b"abc") == []
    link = _ready()
    assert [decode(a.frame) for a in link.group_report(open_)] == [open_]
    assert [decode(a.frame) for a in link.group_report(close)] == [close]
    [send] = link.relay_data(9, b"abc")
    assert isinstance(send.frame, bytes)
    channel, payload = parse_relay_frame(send.frame)
    assert (channel, bytes(payload)) == (9, b"abc")
    assert link.relay_data(9, b"") == []  # no bytes, no frame
    link.connection_lost()
    assert link.group_report(close) == []
    assert link.relay_data(9, b"abc") == []


def test_data_past_the_largest_payload_is_split_in_order() -> None:
    link = _ready()
    data = bytes(range(256)) * ((2 * MAX_RELAY_PAYLOAD + 100) // 256 + 1)
    sends = link.relay_data(4, data)
    assert all(isinstance(s, Send) for s in sends)
    parts = [parse_relay_frame(s.frame) for s in sends]  # each one valid: at most the max
    assert [len(p) for _, p in parts] == [MAX_RELAY_PAYLOAD, MAX_RELAY_PAYLOAD,
                                          len(data) - 2 * MAX_RELAY_PAYLOAD]
    assert {c for c, _ in parts} == {4}
    assert b"".join(bytes(p) for _, p in parts) == data
