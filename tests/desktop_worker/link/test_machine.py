import random

import orjson
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from desktop_worker.link.backoff import Backoff
from desktop_worker.link.machine import (
    CancelJob,
    Close,
    DemandReceived,
    FetchModel,
    GroupCommand,
    Link,
    RefusedByQueen,
    Send,
    StartJob,
    State,
    Welcomed,
)
from shared_schema import (
    Cancel,
    Challenge,
    Demand,
    Fetch,
    FetchFailed,
    GroupEnd,
    GroupFailed,
    GroupLead,
    GroupLink,
    GroupMemberReady,
    GroupReady,
    GroupServe,
    Hello,
    Job,
    ModelDemand,
    Ping,
    Refused,
    Status,
    Usage,
    Welcome,
    decode,
    encode,
    hello_signing_payload,
)
from tests.support.workers import new_key, signed_hello

NONCE = "ab" * 16
ORIGIN = "https://queen.example"  # the origin of the URL the worker dialled
WELCOME = encode(Welcome(session_id="s", worker_id="w", heartbeat_interval_s=15))


def _link(max_jobs: int = 2) -> tuple[Link, list[tuple[str, str]]]:
    asked: list[tuple[str, str]] = []
    key = new_key()

    def hello_for(nonce: str, origin: str) -> Hello:
        asked.append((nonce, origin))
        return signed_hello(key, nonce, models=[], max_jobs=max_jobs, origin=origin)

    return Link(hello_for, max_jobs, ORIGIN), asked


def _ready(max_jobs: int = 2) -> Link:
    link, _ = _link(max_jobs)
    link.receive(encode(Challenge(nonce=NONCE)))
    link.receive(WELCOME)
    return link


def _job(job_id: str) -> str:
    return encode(Job(id=job_id, openai_url="/v1/chat/completions", openai_req={"model": "m"}))


def test_challenge_gets_a_hello_signed_over_its_nonce():
    link, nonces = _link()
    [action] = link.receive(encode(Challenge(nonce=NONCE)))
    assert isinstance(action, Send)
    assert decode(action.frame).type == "hello"
    assert nonces == [(NONCE, ORIGIN)]
    assert link.state is State.AWAITING_WELCOME


def test_the_hello_is_signed_for_the_origin_dialled_whatever_the_queen_says():
    link, asked = _link()
    # A hostile queen naming another queen in its challenge (an extra field: ignored).
    challenge = Challenge(nonce=NONCE).model_dump() | {"origin": "https://victim.example"}
    [action] = link.receive(orjson.dumps(challenge).decode())
    assert asked == [(NONCE, ORIGIN)]
    hello = decode(action.frame)
    payload = hello_signing_payload(NONCE, hello.pubkey, None, ORIGIN)
    Ed25519PublicKey.from_public_bytes(bytes.fromhex(hello.pubkey)).verify(
        bytes.fromhex(hello.signature), payload)  # raises if not signed for ORIGIN


def test_welcome_makes_the_link_ready():
    link, _ = _link()
    link.receive(encode(Challenge(nonce=NONCE)))
    [action] = link.receive(WELCOME)
    assert isinstance(action, Welcomed)
    assert link.state is State.READY
    # An older queen does not say whether it pays.
    assert (action.pays_workers, action.payout_threshold_msat) == (None, None)


@pytest.mark.parametrize(("pays", "threshold"), [(True, 1_000_000), (False, None)])
def test_welcome_says_whether_the_queen_pays(pays, threshold):
    link, _ = _link()
    link.receive(encode(Challenge(nonce=NONCE)))
    [action] = link.receive(encode(Welcome(session_id="s", worker_id="w",
                                           heartbeat_interval_s=15, pays_workers=pays,
                                           payout_threshold_msat=threshold)))
    assert isinstance(action, Welcomed)
    assert (action.pays_workers, action.payout_threshold_msat) == (pays, threshold)


@pytest.mark.parametrize(("code", "fatal"), [("bad_signature", True),
                                              ("protocol_version", True),
                                              ("wrong_origin", True),
                                              ("hello_timeout", False)])
def test_refusal_closes_and_says_whether_retrying_can_help(code, fatal):
    link, _ = _link()
    link.receive(encode(Challenge(nonce=NONCE)))
    [action] = link.receive(encode(Refused(code=code, reason="no")))
    assert action == RefusedByQueen(code, "no", fatal)
    assert link.state is State.CLOSED


def test_anything_but_a_challenge_first_is_a_protocol_violation():
    link, _ = _link()
    [action] = link.receive(WELCOME)
    assert isinstance(action, Close)
    assert action.code == 1002


def test_jobs_start_up_to_max_jobs_then_get_a_retryable_busy():
    link = _ready(max_jobs=1)
    [start] = link.receive(_job("a"))
    assert isinstance(start, StartJob)
    assert start.job.id == "a"
    [busy] = link.receive(_job("b"))
    error = decode(busy.frame)
    assert (error.type, error.id, error.code, error.retryable) == ("error", "b", "busy", True)
    assert link.receive(_job("a")) == []  # a duplicate is ignored


def test_chunks_are_numbered_and_end_with_the_result():
    link = _ready()
    link.receive(_job("a"))
    [first] = link.chunk("a", {"n": 1})
    assert link.chunk("a", {"n": 2}) == []  # waits while the first frame is being sent
    [second] = link.chunk_sent("a")
    assert link.chunk_sent("a") == []  # nothing waits: the next chunk goes out at once
    frames = [decode(first.frame), decode(second.frame)]
    assert [(f.type, f.seq, f.data, f.tokens) for f in frames] == [("chunk", 0, {"n": 1}, 1),
                                                                  ("chunk", 1, {"n": 2}, 1)]
    [result] = link.result("a", {}, Usage(prompt_tokens=1, completion_tokens=2, total_tokens=3))
    assert decode(result.frame).usage.total_tokens == 3
    assert link.active == set()
    assert link.chunk("a", {"late": True}) == []  # after the end, nothing more goes out


def test_cancel_reaches_only_running_jobs():
    link = _ready()
    link.receive(_job("a"))
    assert link.receive(encode(Cancel(id="a"))) == [CancelJob("a", "cancelled")]
    assert link.receive(encode(Cancel(id="zzz"))) == []
    [error] = link.error("a", "cancelled", "cancelled by the queen", False)
    assert decode(error.frame).code == "cancelled"


def test_ping_gets_a_pong_and_garbage_is_ignored():
    link = _ready()
    [pong] = link.receive(encode(Ping(ts=4.5)))
    assert decode(pong.frame).type == "pong"
    assert decode(pong.frame).ts == 4.5
    assert link.receive("{garbage") == []
    assert link.state is State.READY


def test_status_goes_out_only_when_ready():
    link, _ = _link()
    assert link.status(Status(active_jobs=0)) == []
    link = _ready()
    [send] = link.status(Status(active_jobs=1))
    assert decode(send.frame).active_jobs == 1


def test_connection_lost_cancels_every_job():
    link = _ready()
    link.receive(_job("a"))
    link.receive(_job("b"))
    actions = link.connection_lost()
    assert sorted(a.job_id for a in actions) == ["a", "b"]
    assert link.state is State.CLOSED
    assert link.result("a", {}, Usage(prompt_tokens=0, total_tokens=0)) == []


def test_backoff_grows_exponentially_with_jitter_up_to_the_cap():
    backoff = Backoff(base_s=1, cap_s=60, rng=random.Random(7))
    delays = [backoff.next_delay() for _ in range(10)]
    for attempt, delay in enumerate(delays):
        ceiling = min(60, 2**attempt)
        assert ceiling * 0.5 <= delay <= ceiling
    assert max(delays) <= 60


def test_backoff_resets_after_a_stable_session():
    backoff = Backoff(base_s=1, cap_s=60, stable_s=30, rng=random.Random(1))
    for _ in range(6):
        backoff.next_delay(session_s=1)
    assert backoff.next_delay(session_s=45) <= 1.0


def test_backoff_jitter_spreads_workers_dropped_together():
    delays = {round(Backoff(rng=random.Random(seed)).next_delay(), 3) for seed in range(50)}
    assert len(delays) > 40


def test_fetch_and_demand_become_actions_and_a_welcome_carries_demand():
    demand = Demand(models=[ModelDemand(name="org/repo:Q4_0", requests_per_min=3,
                                        unmet_per_min=1, queued=0, mean_wait_s=0.5,
                                        holders=0, loading=0)])
    link, _ = _link()
    link.receive(encode(Challenge(nonce=NONCE)))
    welcome = Welcome(session_id="s", worker_id="w", heartbeat_interval_s=15, demand=demand)
    assert link.receive(encode(welcome)) == [Welcomed(welcome), DemandReceived(demand)]
    fetch = Fetch(name="org/repo:Q4_0", repo_id="org/repo", revision="c" * 40,
                  paths=["m-Q4_0.gguf"], sha256="d" * 64, size_bytes=10)
    assert link.receive(encode(fetch)) == [FetchModel(fetch)]
    assert link.receive(encode(demand)) == [DemandReceived(demand)]
    # A hostile queen's malformed fetch (a revision that is no commit) is ignored, not acted on.
    bad = orjson.dumps(fetch.model_dump() | {"revision": "../../etc"}).decode()
    assert link.receive(bad) == []
    failure = FetchFailed(name="org/repo:Q4_0", code="disk_full", message="no room")
    [send] = link.fetch_failed(failure)
    assert decode(send.frame) == failure


# --- model groups (issue 19) ---------------------------------------------------------------------

GROUP = "ab" * 8
TOKEN = "cd" * 32
PRINT = "ef" * 32


def _group_frames() -> list:
    link = GroupLink(worker_id="member1", host="192.168.1.20", port=40000, fingerprint=PRINT,
                     token=TOKEN, device_layers=[20])
    return [
        GroupServe(group=GROUP, head="head1", token=TOKEN, layers=20, model="org/repo:Q4_0"),
        GroupLead(group=GROUP, head="head1", model="org/repo:Q4_0", n_ctx=512,
                  head_layers=[10], members=[link]),
        GroupEnd(group=GROUP, reason="a member left"),
    ]


def test_group_commands_become_one_action_only_when_ready():
    link, _ = _link()
    for frame in _group_frames():  # before the welcome: a protocol violation, not a command
        assert not any(isinstance(a, GroupCommand) for a in link.receive(encode(frame)))
    link = _ready()
    for frame in _group_frames():
        assert link.receive(encode(frame)) == [GroupCommand(frame)]
    assert link.state is State.READY


@pytest.mark.parametrize(("kind", "field", "value"), [
    (0, "token", "../../etc/passwd"),  # not a 32-byte hex token
    (0, "group", "G" * 16),
    (1, "members", []),  # a lead without members
    (1, "n_ctx", 1 << 30),
    (2, "group", ""),
])
def test_a_malformed_group_frame_is_ignored_like_any_bad_frame(kind, field, value):
    link = _ready()
    bad = orjson.dumps(_group_frames()[kind].model_dump() | {field: value}).decode()
    assert link.receive(bad) == []
    assert link.state is State.READY


def test_a_lead_naming_a_public_member_address_is_ignored():
    """A hostile queen cannot make a head dial the wider internet through a group."""
    link = _ready()
    lead = _group_frames()[1].model_dump()
    lead["members"][0]["host"] = "8.8.8.8"
    assert link.receive(orjson.dumps(lead).decode()) == []


def test_group_reports_go_out_only_when_ready():
    reports = [GroupMemberReady(group=GROUP, host="127.0.0.1", port=40000, fingerprint=PRINT),
               GroupReady(group=GROUP, load_s=1.5),
               GroupFailed(group=GROUP, code="busy", message="already in a group")]
    link, _ = _link()
    assert all(link.group_report(report) == [] for report in reports)
    link = _ready()
    for report in reports:
        [send] = link.group_report(report)
        assert decode(send.frame) == report
    link.connection_lost()
    assert all(link.group_report(report) == [] for report in reports)
