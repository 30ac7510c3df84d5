"""The model-group frames' own rules (issue 19): a route is direct (an address, a port and a
fingerprint together) or relayed (none of them), and a relayed data frame is a tag, a channel
and a bounded payload, read without copying."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from shared_schema import GroupLink, GroupMemberReady, GroupOpen, decode, encode
from shared_schema.errors import ProtocolError
from shared_schema.groups import (
    MAX_RELAY_CHANNEL,
    MAX_RELAY_PAYLOAD,
    RELAY_TAG,
    parse_relay_frame,
    relay_frame,
)

GROUP = "0123456789abcdef"
DIRECT = {"host": "192.168.1.9", "port": 40_001, "fingerprint": "ab" * 32}


def test_a_relayed_ready_and_link_carry_no_address_and_round_trip() -> None:
    ready = GroupMemberReady(group=GROUP)
    assert ready.relayed
    assert decode(encode(ready)) == ready
    link = GroupLink(worker_id="m2", token="c" * 64, device_layers=[3])
    assert link.relayed
    assert not GroupLink(worker_id="m1", token="c" * 64, device_layers=[3], **DIRECT).relayed
    assert not GroupMemberReady(group=GROUP, **DIRECT).relayed


@pytest.mark.parametrize("drop", ["host", "port", "fingerprint"])
def test_half_a_direct_route_is_refused(drop: str) -> None:
    given = {k: v for k, v in DIRECT.items() if k != drop}
    with pytest.raises(ValidationError, match="come together"):
        GroupMemberReady(group=GROUP, **given)
    with pytest.raises(ValidationError, match="come together"):
        GroupLink(worker_id="m1", token="c" * 64, device_layers=[3], **given)


def test_relay_frames_round_trip_and_bad_ones_are_protocol_errors() -> None:
    payload = b"\x00\x01" * 100
    frame = relay_frame(MAX_RELAY_CHANNEL, payload)
    channel, view = parse_relay_frame(frame)
    assert (channel, bytes(view)) == (MAX_RELAY_CHANNEL, payload)
    assert frame[0] == RELAY_TAG
    for channel, body in ((0, b"x"), (MAX_RELAY_CHANNEL + 1, b"x"), (1, b""),
                          (1, b"x" * (MAX_RELAY_PAYLOAD + 1))):
        with pytest.raises(ValueError, match="relay"):
            relay_frame(channel, body)
    for bad in (b"", b"{", b"\x01\x00\x00\x00\x01", b"\x01\x00\x00\x00\x00x",
                b"\x01\xff\xff\xff\xffx", frame[:1] + b"\x00\x00\x00\x01" + b"y" * (1 << 19)):
        with pytest.raises(ProtocolError) as refused:
            parse_relay_frame(bad)
        assert refused.value.code == "bad_relay_frame"
    with pytest.raises(ValidationError):
        GroupOpen(group=GROUP, channel=0, member="m2")


def test_a_failure_may_name_a_member_by_its_public_id_only() -> None:
    from shared_schema import GroupFailed

    named = GroupFailed(group=GROUP, code="load_failed", member="m1")
    assert decode(encode(named)) == named
    assert GroupFailed(group=GROUP, code="lost").member is None
    for bad in ("", "m 1", "x" * 65, "../m1"):
        with pytest.raises(ValidationError):
            GroupFailed(group=GROUP, code="load_failed", member=bad)
