"""A model group's shares over the cluster bus (issue 19): the replica serving a group's head
tells the replica holding the client who shares the answer, within a bound."""

from __future__ import annotations

import json

import pytest

from shared_schema.cluster import (
    MAX_GROUP_SHARES,
    Assigned,
    ClusterEvent,
    ClusterJob,
    decode_cluster,
    encode_cluster,
)
from shared_schema.errors import ProtocolError

SHARES = [("aa" * 32, 12), ("bb" * 32, 10), ("cc" * 32, 8)]


def test_an_assigned_head_carries_its_group_s_shares() -> None:
    event = ClusterEvent(job_id="r1.1", seq=1, frame=Assigned(worker_key="aa" * 32,
                                                              worker_id="w1", shares=SHARES))
    decoded = decode_cluster(encode_cluster(event))
    assert isinstance(decoded, ClusterEvent)
    assert isinstance(decoded.frame, Assigned)
    assert [tuple(share) for share in decoded.frame.shares] == SHARES
    alone = decode_cluster(encode_cluster(ClusterEvent(job_id="r1.1", seq=1,
                                                       frame=Assigned(worker_id="w2"))))
    assert alone.frame.shares == []  # type: ignore[union-attr]  # a worker serving alone


@pytest.mark.parametrize("shares", [
    [("aa" * 32, 1)] * (MAX_GROUP_SHARES + 1),  # more parts than any group has
    [["aa" * 32]],  # a share without its layers
    [("aa" * 32, "many")],
])
def test_a_malformed_share_list_is_refused(shares: list) -> None:
    raw = ('{"type":"event","job_id":"r1.1","seq":1,"frame":{"type":"assigned",'
           '"worker_id":"w1","shares":' + json.dumps(shares) + "}}")
    with pytest.raises(ProtocolError):
        decode_cluster(raw)


def test_a_group_s_id_goes_out_with_its_head_and_back_with_the_regroup() -> None:
    """The replica holding the client learns the group's id (``Assigned.group``) and names
    it when it sends the answer back to be continued on the re-formed group."""
    event = ClusterEvent(job_id="r1.1", seq=1, frame=Assigned(worker_id="w1", shares=SHARES,
                                                              group="0123456789abcdef"))
    decoded = decode_cluster(encode_cluster(event))
    assert decoded.frame.group == "0123456789abcdef"  # type: ignore[union-attr]
    job = ClusterJob(job_id="r1.2", origin="a", reply_to="apiary:replies:a", model="m",
                     openai_url="/v1/chat/completions", openai_req={}, timeout_s=60,
                     continuation="Paris is", regroup="0123456789abcdef")
    back = decode_cluster(encode_cluster(job))
    assert isinstance(back, ClusterJob)
    assert back.regroup == "0123456789abcdef"


@pytest.mark.parametrize("group", ["", "not-hex-at-all!!", "ab" * 40, "ABCDEF0123456789"])
def test_a_malformed_group_id_is_refused(group: str) -> None:
    raw = ('{"type":"job","job_id":"r1.2","origin":"a","reply_to":"r","model":"m",'
           '"openai_url":"/v1/chat/completions","openai_req":{},"timeout_s":60,'
           '"regroup":' + json.dumps(group) + "}")
    with pytest.raises(ProtocolError):
        decode_cluster(raw)
    raw = ('{"type":"event","job_id":"r1.1","seq":1,"frame":{"type":"assigned",'
           '"worker_id":"w1","group":' + json.dumps(group) + "}}")
    with pytest.raises(ProtocolError):
        decode_cluster(raw)
