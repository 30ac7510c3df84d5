"""The queen's link machine driven with no sockets: the handshake and its refusals, job frames
routed to their jobs, bad frames answered and counted, heartbeats, and the frames it writes."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import orjson
import pytest

from queen_server.swarm.jobs import JobHandle
from queen_server.swarm.link import (
    NOTHING,
    Admit,
    Close,
    FetchRefused,
    GroupReport,
    QueenLink,
    Refuse,
    RelayIn,
    Send,
    State,
    StatusChanged,
)
from shared_schema import (
    PROTOCOL_VERSION,
    SUBPROTOCOL,
    Cancel,
    Challenge,
    Chunk,
    Demand,
    Fetch,
    FetchFailed,
    GroupClose,
    GroupEnd,
    GroupFailed,
    GroupMemberReady,
    GroupOpen,
    GroupReady,
    GroupServe,
    Hello,
    Job,
    JobError,
    LegacyRequest,
    ModelDescriptor,
    Ping,
    Pong,
    Refused,
    Result,
    Status,
    Usage,
    Welcome,
    decode,
    encode,
)
from shared_schema.groups import MAX_RELAY_PAYLOAD, RELAY_TAG, relay_frame
from shared_schema.protocol import CLOSE_POLICY, MAX_CHUNK_TOKENS
from tests.support.workers import LegacyWorker, new_key, signed_hello

MODEL = "org/repo:Q4_K_M"
FIXTURES = Path(__file__).resolve().parents[3] / "tests" / "fixtures" / "original"
USAGE = Usage(prompt_tokens=3, completion_tokens=2, total_tokens=5)
NONCE = "ab" * 32


@dataclass
class Knobs:
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 3.0
    max_hello_bytes: int = 4096
    max_bad_frames: int = 3
    legacy_workers: str = "on"


@dataclass
class FakeGate:
    """The injected checks: the signature verdict and the payout problem are set by the test."""

    signed: bool = True
    payout: str | None = None
    elsewhere: str | None = None  # the origin a refused hello was signed for, if known
    origins: tuple[str, ...] = ("https://queen.example",)
    asked: list[tuple[str, str]] = field(default_factory=list)

    def hello_signed(self, hello: Hello, nonce: str) -> bool:
        self.asked.append((hello.pubkey, nonce))
        return self.signed

    def signed_for_elsewhere(self, hello: Hello, nonce: str) -> str | None:
        return self.elsewhere

    def public_id(self, pubkey: str) -> str:
        return "pub-" + pubkey[:8]

    def payout_problem(self, ln_url: str | None) -> str | None:
        return self.payout


def hello_frame(**kwargs) -> str:
    kwargs.setdefault("models", [ModelDescriptor(name=MODEL, loaded=True)])
    return encode(signed_hello(new_key(), NONCE, **kwargs))


def new_link(gate: FakeGate | None = None, *, v1: bool = True, pays: bool = False,
             **knobs) -> QueenLink:
    return QueenLink(Knobs(**knobs), gate or FakeGate(), v1=v1, nonce=NONCE, clock=lambda: 42.0,
                     pays_workers=pays, payout_threshold_msat=1_000_000)


def admitted(*, v1: bool = True, **knobs) -> tuple[QueenLink, dict[str, JobHandle]]:
    """A link past its handshake, registered with a lease table the test fills."""
    link = new_link(v1=v1, **knobs)
    link.opened()
    first = hello_frame() if v1 else (FIXTURES / "registration.json").read_text()
    [admit] = link.receive(first, 0.0)
    assert isinstance(admit, Admit)
    leases: dict[str, JobHandle] = {}
    link.registered(leases)
    return link, leases


def lease(leases: dict[str, JobHandle], job_id: str) -> JobHandle:
    handle = JobHandle(job_id, MODEL, "k", started_at=0.0)
    leases[job_id] = handle
    return handle


def sent(actions) -> list[dict]:
    assert all(isinstance(action, Send) for action in actions), actions
    return [orjson.loads(action.frame) for action in actions]


# --- the handshake ------------------------------------------------------------------------------


def test_a_signed_hello_is_admitted_with_a_welcome():
    gate = FakeGate()
    link = new_link(gate)
    [challenge] = link.opened()
    assert decode(challenge.frame) == Challenge(nonce=NONCE)
    hello = signed_hello(new_key(), NONCE, models=[ModelDescriptor(name=MODEL, loaded=True)],
                         max_jobs=3, ln_url="alice@example.com", capabilities=["chat", "continue"])
    [admit] = link.receive(encode(hello), 7.0)
    assert isinstance(admit, Admit)
    worker = admit.worker
    assert gate.asked == [(hello.pubkey, NONCE)]
    assert (worker.key, worker.public_id, worker.max_jobs, worker.ln_url) == (
        hello.pubkey, "pub-" + hello.pubkey[:8], 3, "alice@example.com")
    assert worker.loaded == {MODEL}
    assert worker.capabilities == {"chat", "continue"}
    assert (worker.worker_version, worker.legacy, worker.connected_at) == ("scripted-1", False, 42)
    welcome = decode(admit.welcome)
    assert welcome == Welcome(session_id=worker.session_id, worker_id=worker.public_id,
                              heartbeat_interval_s=1.0, pays_workers=False,
                              chunk_tokens=MAX_CHUNK_TOKENS)  # it reads joined chunks
    assert welcome.payout_threshold_msat is None  # a queen that does not pay names no threshold
    assert link.state is State.READY
    assert link.worker is worker
    assert link.last_seen == 7.0


def _refusal(actions, code: str, close_code: int = 1008) -> Refuse:
    [refuse] = actions
    assert isinstance(refuse, Refuse)
    assert (refuse.code, refuse.close_code) == (code, close_code)
    assert refuse.reason
    assert decode(refuse.frame) == Refused(code=code, reason=refuse.reason)
    return refuse


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        ("this is not json", "invalid_json"),
        ("[1, 2, 3]", "invalid_message"),
        ('{"type": "pong"}', "unexpected_message"),
        ('{"type": "hello", "protocol": 99}', "protocol_version"),
        ('{"type": "hello", "protocol": 2, "pubkey": 5}', "invalid_message"),
        ('{"type": "hello", "protocol": 1, "pubkey": 5}', "protocol_version"),
        ('{"type": "hello", "protocol": "2"}', "protocol_version"),
        (None, "binary_frame"),
    ],
)
def test_a_first_frame_that_is_no_hello_is_refused(frame, code):
    link = new_link()
    link.opened()
    _refusal(link.receive(frame, 0.0), code)
    assert link.state is State.CLOSED
    assert link.worker is None


def test_a_hello_whose_signature_does_not_verify_is_refused():
    link = new_link(FakeGate(signed=False))
    link.opened()
    refuse = _refusal(link.receive(hello_frame(), 0.0), "bad_signature")
    assert "signature" in refuse.reason


def test_a_hello_signed_for_the_name_it_dialled_is_refused_with_that_name():
    gate = FakeGate(signed=False, elsewhere="http://10.0.0.5:8000")
    link = new_link(gate)
    link.opened()
    refuse = _refusal(link.receive(hello_frame(), 0.0), "wrong_origin")
    assert refuse.reason == ("this hello was signed for http://10.0.0.5:8000; this queen is "
                             "https://queen.example; set APIARY_PUBLIC_URL if the queen sits "
                             "behind a proxy")


def test_an_older_worker_is_told_to_upgrade_before_its_signature_is_checked():
    gate = FakeGate()
    link = new_link(gate)
    link.opened()
    old = orjson.loads(hello_frame())
    old["protocol"] = 1  # a worker from before hellos named their queen
    refuse = _refusal(link.receive(orjson.dumps(old).decode(), 0.0), "protocol_version")
    assert "upgrade your worker" in refuse.reason
    assert "protocol 1" in refuse.reason
    assert f"protocol {PROTOCOL_VERSION}" in refuse.reason
    assert gate.asked == []  # never verified: the old, unbound form is not an option
    newer = orjson.loads(hello_frame())
    newer["protocol"] = PROTOCOL_VERSION + 1
    link = new_link(gate)
    refuse = _refusal(link.receive(orjson.dumps(newer).decode(), 0.0), "protocol_version")
    assert "upgrade the queen" in refuse.reason


def test_a_paying_queen_says_so_in_its_welcome():
    link = new_link(pays=True)
    link.opened()
    [admit] = link.receive(hello_frame(), 0.0)
    welcome = decode(admit.welcome)
    assert (welcome.pays_workers, welcome.payout_threshold_msat) == (True, 1_000_000)


def test_a_hello_with_an_invalid_payout_address_is_refused():
    link = new_link(FakeGate(payout="not an address"))
    link.opened()
    refuse = _refusal(link.receive(hello_frame(ln_url="nobody"), 0.0), "invalid_ln_url")
    assert refuse.reason == "the payout address 'nobody' is not valid: not an address"


def test_an_oversized_hello_is_refused_as_too_big():
    link = new_link(max_hello_bytes=1024)
    link.opened()
    frame = hello_frame(ln_url="x" * 1500)
    refuse = _refusal(link.receive(frame, 0.0), "frame_too_large", 1009)
    assert str(len(frame)) in refuse.reason


def test_no_hello_in_time_is_refused_and_a_late_timeout_is_ignored():
    link = new_link()
    link.opened()
    _refusal(link.hello_timeout(), "hello_timeout")
    accepted, _ = admitted()
    assert accepted.hello_timeout() == NOTHING


def test_a_legacy_registration_is_admitted_without_a_welcome():
    link = new_link(v1=False)
    assert link.opened() == NOTHING  # no challenge: the legacy worker speaks first
    registration = (FIXTURES / "registration.json").read_text()
    [admit] = link.receive(registration, 0.0)
    assert isinstance(admit, Admit)
    assert admit.welcome is None
    worker = admit.worker
    assert worker.key.startswith("legacy-")
    assert worker.public_id == worker.key
    assert (worker.legacy, worker.max_jobs, worker.can_fetch, worker.earnings_key) == (
        True, 1, True, None)
    assert worker.vram_mb == orjson.loads(registration)["vram"]
    assert link.state is State.LEGACY


def test_the_real_workerbee_registration_is_admitted_with_its_vram_read_as_bytes():
    link = new_link(v1=False)
    [admit] = link.receive(orjson.dumps(LegacyWorker.WORKERBEE_REGISTRATION).decode(), 0.0)
    assert isinstance(admit, Admit)
    worker = admit.worker
    assert worker.vram_mb == LegacyWorker.WORKERBEE_VRAM_BYTES // 2**20 == 26_624
    assert worker.gpus == ["NVIDIA GeForce RTX 3090"]
    assert worker.worker_version == "0.2.4"
    # Its claimed capabilities and models are unverified: it stays a one-slot fetcher, in the
    # lowest routing tier, credited nothing.
    assert (worker.legacy, worker.max_jobs, worker.capabilities, worker.models,
            worker.earnings_key) == (True, 1, frozenset(), {}, None)
    assert link.state is State.LEGACY


@pytest.mark.parametrize("registration", [LegacyWorker.REGISTRATION,
                                          LegacyWorker.WORKERBEE_REGISTRATION])
def test_legacy_workers_off_refuses_every_registration_with_a_policy_close(registration):
    link = new_link(v1=False, legacy_workers="off")
    [refuse] = link.receive(orjson.dumps(registration).decode(), 0.0)
    assert isinstance(refuse, Refuse)
    assert (refuse.code, refuse.close_code) == ("legacy_disabled", CLOSE_POLICY)
    assert f"protocol {PROTOCOL_VERSION}" in refuse.reason
    assert decode(refuse.frame) == Refused(code="legacy_disabled", reason=refuse.reason)
    assert link.state is State.CLOSED
    assert link.worker is None


@pytest.mark.parametrize("mode", ["off", "unbilled"])
def test_the_legacy_setting_leaves_v1_workers_alone(mode):
    link = new_link(legacy_workers=mode)
    link.opened()
    [admit, *_] = link.receive(hello_frame(), 0.0)
    assert isinstance(admit, Admit)
    assert not admit.worker.legacy


def test_legacy_workers_unbilled_still_admits_them():
    link = new_link(v1=False, legacy_workers="unbilled")
    [admit] = link.receive(orjson.dumps(LegacyWorker.WORKERBEE_REGISTRATION).decode(), 0.0)
    assert isinstance(admit, Admit)
    assert admit.worker.legacy


def test_an_absurd_legacy_vram_is_refused_in_bytes_too():
    link = new_link(v1=False)
    registration = {**LegacyWorker.WORKERBEE_REGISTRATION, "vram": 2**44 + 1}  # > 16 TiB
    [refuse] = link.receive(orjson.dumps(registration).decode(), 0.0)
    assert isinstance(refuse, Refuse)
    assert refuse.code == "invalid_message"
    assert "vram" in refuse.reason


@pytest.mark.parametrize(
    ("frame", "code", "in_reason"),
    [
        ('{"type": "hello", "protocol": 1}', "unexpected_message", SUBPROTOCOL),
        ('{"cpu_count": 1, "vram": -5}', "invalid_message", "vram"),
        ("{broken", "invalid_json", "JSON"),
    ],
)
def test_a_first_frame_without_the_subprotocol_must_be_a_registration(frame, code, in_reason):
    link = new_link(v1=False)
    refuse = _refusal(link.receive(frame, 0.0), code)
    assert in_reason in refuse.reason


# --- job frames ----------------------------------------------------------------------------------


def test_job_frames_are_routed_to_their_job_and_the_rest_answered():
    link, leases = admitted()
    handle = lease(leases, "j1")
    chunk = Chunk(id="j1", seq=0, data={"x": 1})
    assert link.receive(encode(chunk), 1.0) == NOTHING
    assert link.receive(encode(Result(id="j1", usage=USAGE)), 2.0) == NOTHING
    assert handle.take_ready() == [chunk, Result(id="j1", usage=USAGE)]
    assert link.last_seen == 2.0
    # Frames after the end, or for another worker's job, are dropped, answered, not counted.
    for frame in (Chunk(id="j1", seq=1, data={}), Result(id="not-mine", usage=USAGE)):
        [error] = sent(link.receive(encode(frame), 3.0))
        assert (error["type"], error["code"], error["id"]) == ("error", "unknown_job", frame.id)
    assert handle.take_ready() == []
    assert link.bad_frames == 0
    assert sent(link.receive(encode(Ping(ts=1.5)), 4.0)) == [{"type": "pong", "ts": 1.5}]
    assert link.receive(encode(Pong(ts=1.5)), 4.0) == NOTHING


def test_a_malformed_answer_fails_the_job_and_the_worker_is_told():
    link, leases = admitted()
    handle = lease(leases, "j1")
    [error] = sent(link.receive(encode(Chunk(id="j1", seq=0, data={"choices": "x"})), 1.0))
    assert (error["code"], error["id"], error["retryable"]) == ("invalid_message", "j1", False)
    assert "choices" in error["message"]
    [event] = handle.take_ready()
    assert isinstance(event, JobError)
    assert (event.code, event.retryable) == ("invalid_answer", True)
    assert "malformed" in event.message
    assert handle.finished
    assert link.bad_frames == 1


def test_an_embeddings_result_without_vectors_is_malformed():
    link, leases = admitted()
    handle = lease(leases, "embd-1")
    [error] = sent(link.receive(encode(Result(id="embd-1", data={"object": "list"},
                                              usage=USAGE)), 1.0))
    assert error["code"] == "invalid_message"
    assert handle.finished


def test_status_changes_are_handed_to_the_registry():
    link, _ = admitted()
    models = [ModelDescriptor(name="new/model:Q4_0", loaded=True)]
    status = Status(max_jobs=3, models=models, paused="on battery", model_room_mb=512)
    [change] = link.receive(encode(status), 1.0)
    assert change == StatusChanged(3, models, status)
    bare = Status(active_jobs=1)  # still handed on: it says no download and no pause now
    assert link.receive(encode(bare), 1.0) == [StatusChanged(None, None, bare)]


@pytest.mark.parametrize(
    ("frame", "code", "job_id"),
    [
        ("{broken", "invalid_json", ""),
        ('{"id": "j-7"}', "unknown_type", "j-7"),
        ('{"type": "chunk", "id": "j-8", "seq": -1, "data": {}}', "invalid_message", "j-8"),
        ('{"type": "cancel", "id": "j-9"}', "unexpected_message", "j-9"),
        (None, "binary_frame", ""),
    ],
)
def test_each_bad_frame_is_answered_with_a_typed_error(frame, code, job_id):
    link, _ = admitted()
    [error] = sent(link.receive(frame, 1.0))
    assert (error["type"], error["code"], error["id"]) == ("error", code, job_id)
    assert error["message"]
    assert link.bad_frames == 1


@pytest.mark.parametrize("tokens", ["0", "-1", str(MAX_CHUNK_TOKENS + 1), '"3"', "true",
                                    "2.5", "2.0", "null", "[]"])
def test_a_malformed_token_count_gets_the_typed_error_and_feeds_nothing(tokens):
    link, leases = admitted()
    handle = lease(leases, "j1")
    frame = ('{"type": "chunk", "id": "j1", "seq": 0, "tokens": ' + tokens
             + ', "data": {"choices": [{"index": 0, "delta": {"content": "abc"}}]}}')
    [error] = sent(link.receive(frame, 1.0))
    assert (error["type"], error["code"], error["id"]) == ("error", "invalid_message", "j1")
    assert "tokens" in error["message"]
    assert handle.take_ready() == []
    assert link.bad_frames == 1


def test_a_joined_chunk_reaches_its_job_with_its_count():
    link, leases = admitted()
    handle = lease(leases, "j1")
    chunk = Chunk(id="j1", seq=0, tokens=3,
                  data={"choices": [{"index": 0, "delta": {"content": "a b c"}}]})
    assert link.receive(encode(chunk), 1.0) == NOTHING
    [fed] = handle.take_ready()
    assert fed.tokens == 3
    older = '{"type": "chunk", "id": "j1", "seq": 1, "data": {}}'  # no field: one token
    assert link.receive(older, 1.0) == NOTHING
    assert handle.take_ready()[0].tokens == 1


def test_too_many_bad_frames_close_the_link_and_unknown_jobs_are_not_counted():
    link, _ = admitted(max_bad_frames=3)
    unknown = encode(Result(id="nobody", usage=USAGE))
    for _ in range(5):
        sent(link.receive(unknown, 1.0))
    sent(link.receive("{broken", 1.0))
    sent(link.receive(encode(Welcome(session_id="x", worker_id="y", heartbeat_interval_s=1)),
                      1.0))
    assert link.bad_frames == 2
    assert link.receive("{broken", 1.0) == [Close(1008, "too many bad frames (3)")]
    assert link.state is State.CLOSED
    assert link.receive(encode(Ping(ts=1.0)), 2.0) == NOTHING  # the edge is hanging up


# --- heartbeats ----------------------------------------------------------------------------------


def test_heartbeat_pings_a_live_worker_and_closes_a_silent_one():
    link, _ = admitted(heartbeat_timeout_s=3.0)
    link.receive(encode(Pong(ts=0.0)), 10.0)
    assert sent(link.tick(12.5)) == [{"type": "ping", "ts": 12.5}]
    assert link.tick(13.5) == [Close(4001, "missed heartbeats")]
    assert link.state is State.CLOSED
    assert link.tick(20.0) == NOTHING
    legacy, _ = admitted(v1=False)
    assert legacy.tick(1000.0) == NOTHING  # legacy workers get no heartbeat


def test_the_queen_measures_its_round_trip_to_a_worker():
    """Challenge to hello, then each ping to its pong, by the queen's own clock (issue 19: a
    group is planned by it). A pong is believed only for the ping just sent: a worker can make
    itself look farther (answer late), never nearer."""
    link = QueenLink(Knobs(heartbeat_timeout_s=1000.0), FakeGate(), v1=True, now=100.0,
                     nonce=NONCE)
    link.opened()
    [admit] = link.receive(hello_frame(), 100.05)
    worker = admit.worker
    assert worker.rtt_ms == pytest.approx(50.0)
    link.registered({})
    sent(link.tick(110.0))
    link.receive(encode(Pong(ts=110.0)), 110.02)  # 20 ms: the average moves a third of the way
    assert worker.rtt_ms == pytest.approx(40.0)
    for forged in (Pong(ts=110.0), Pong(ts=110.019), Pong(ts=-5.0), Pong(ts=1e12)):
        link.receive(encode(forged), 110.5)  # a pong answered twice, or one no ping asked for
        assert worker.rtt_ms == pytest.approx(40.0)
    sent(link.tick(120.0))
    link.receive(encode(Pong(ts=120.0)), 300.0)  # stalled: counted as at most a minute
    assert worker.rtt_ms == pytest.approx(40.0 + (60_000.0 - 40.0) / 3)


# --- frames to the worker ------------------------------------------------------------------------


def test_a_v1_worker_gets_job_and_cancel_frames():
    link, _ = admitted()
    job = link.job_frame("j1", "/v1/chat/completions", {"model": MODEL, "stream": True},
                         continuation="so far")
    assert decode(job) == Job(id="j1", openai_url="/v1/chat/completions",
                              openai_req={"model": MODEL, "stream": True},
                              continuation="so far")
    assert decode(link.cancel_frame("j1", "client_gone")) == Cancel(id="j1",
                                                                    reason="client_gone")


def test_a_legacy_worker_gets_a_bare_non_streaming_request_and_no_cancel():
    link, _ = admitted(v1=False)
    request = orjson.loads((FIXTURES / "request.json").read_text())
    frame = link.job_frame("j1", request["openai_url"], {**request["openai_req"], "stream": True})
    sent_request = orjson.loads(frame)
    assert "type" not in sent_request
    assert LegacyRequest.model_validate(sent_request).openai_url == request["openai_url"]
    assert sent_request["openai_req"] == {**request["openai_req"], "stream": False}
    assert link.cancel_frame("j1", "timeout") is None  # cannot be cancelled: nothing is sent


# --- a legacy worker's answers -------------------------------------------------------------------


def test_a_legacy_answer_becomes_the_result_of_the_job_in_flight():
    link, leases = admitted(v1=False)
    handle = lease(leases, "job-42")
    answer_text = (FIXTURES / "response.json").read_text()
    assert link.receive(answer_text, 1.0) == NOTHING
    assert handle.finished is True
    [event] = handle.take_ready()
    assert isinstance(event, Result)
    assert event.id == "job-42"
    assert event.data == orjson.loads(answer_text)
    assert event.usage == Usage(prompt_tokens=56, completion_tokens=31, total_tokens=87)


def test_a_legacy_answer_without_usage_gets_zero_usage():
    link, leases = admitted(v1=False)
    handle = lease(leases, "job-1")
    link.receive('{"object": "list", "data": [{"index": 0, "embedding": [0.5]}]}', 1.0)
    [event] = handle.take_ready()
    assert isinstance(event, Result)
    assert event.usage == Usage(prompt_tokens=0, total_tokens=0)


@pytest.mark.parametrize(
    ("body", "code", "message"),
    [
        ({"error": {"message": "model not found", "code": "model_missing"}},
         "model_missing", "model not found"),
        ({"error": {"message": "out of memory"}}, "worker_error", "out of memory"),
        ({"error": "it broke"}, "worker_error", "it broke"),
    ],
)
def test_a_legacy_error_becomes_a_retryable_job_error(body, code, message):
    link, leases = admitted(v1=False)
    handle = lease(leases, "job-7")
    assert link.receive(orjson.dumps(body).decode(), 1.0) == NOTHING
    assert handle.finished is True
    [event] = handle.take_ready()
    assert isinstance(event, JobError)
    assert (event.id, event.retryable, event.code, event.message) == (
        "job-7", True, code, message)


def test_a_legacy_frame_with_no_job_in_flight_is_dropped():
    link, leases = admitted(v1=False)
    answer_text = (FIXTURES / "response.json").read_text()
    assert link.receive(answer_text, 1.0) == NOTHING  # no job at all: no error either
    handle = lease(leases, "job-1")
    handle.feed(JobError(id=handle.id, code="timeout", message="too slow"))
    handle.take_ready()
    assert link.receive(answer_text, 1.0) == NOTHING  # the job already ended
    assert handle.take_ready() == []
    assert link.bad_frames == 0


def test_a_legacy_frame_that_is_not_an_answer_is_counted_but_not_answered(caplog):
    link, leases = admitted(v1=False, max_bad_frames=3)
    handle = lease(leases, "job-1")
    with caplog.at_level(logging.WARNING, logger="queen_server.swarm.link"):
        assert link.receive('{"hello": "world"}', 1.0) == NOTHING
        assert link.receive("{broken", 1.0) == NOTHING
    assert [record.args[1] for record in caplog.records] == ["invalid_message", "invalid_json"]
    assert link.bad_frames == 2
    assert handle.finished is False
    malformed = link.receive('{"choices": [1]}', 1.0)  # a malformed answer fails the job
    assert malformed == [Close(1008, "too many bad frames (3)")]
    [event] = handle.take_ready()
    assert (event.code, event.retryable) == ("invalid_answer", True)


def test_a_fetch_failure_is_handed_on_and_queen_only_messages_are_refused():
    link, _ = admitted(max_bad_frames=10)
    failure = FetchFailed(name="org/repo:Q4_0", code="disk_full", message="no room")
    assert link.receive(encode(failure), 1.0) == [FetchRefused(failure)]
    # A worker that sends the queen's own commands back is answered, and it counts.
    for message in (Fetch(name="org/repo:Q4_0", repo_id="org/repo", revision="a" * 40,
                          paths=["m.gguf"], sha256="b" * 64, size_bytes=1),
                    Demand(models=[])):
        [error] = sent(link.receive(encode(message), 1.0))
        assert error["code"] == "unexpected_message"
    assert link.bad_frames == 2
    # A fetch failure that is not one (no name) is a bad frame, not a crash.
    [error] = sent(link.receive('{"type": "fetch_failed", "code": "x"}', 1.0))
    assert error["code"] == "invalid_message"


def test_group_reports_are_handed_on_and_hostile_ones_refused():
    link, _ = admitted(max_bad_frames=10)
    group = "0123456789abcdef"
    reports = [GroupMemberReady(group=group, host="192.168.1.5", port=40_001,
                                fingerprint="ab" * 32),
               GroupReady(group=group, load_s=2.5),
               GroupFailed(group=group, code="lost", message="the head ended")]
    for report in reports:
        assert link.receive(encode(report), 1.0) == [GroupReport(report)]
    # The queen's own group commands from a worker are refused, and counted.
    for message in (GroupEnd(group=group), GroupServe(group=group, head="abc", token="c" * 64,
                                                      layers=3, model="m")):
        [error] = sent(link.receive(encode(message), 1.0))
        assert error["code"] == "unexpected_message"
    # A member cannot point the head at the internet, a privileged port, or anything but an
    # address literal.
    for host, port in (("8.8.8.8", 40_001), ("192.168.1.5", 22), ("gate.example", 40_001),
                       ("0.0.0.0", 40_001)):
        frame = orjson.dumps({"type": "group_member_ready", "group": group, "host": host,
                              "port": port, "fingerprint": "ab" * 32}).decode()
        [error] = sent(link.receive(frame, 1.0))
        assert error["code"] == "invalid_message"
    assert link.bad_frames == 6


def test_relayed_frames_are_handed_on_by_channel_and_bad_binary_frames_refused():
    link, _ = admitted(max_bad_frames=10)
    group = "0123456789abcdef"
    for message in (GroupOpen(group=group, channel=7, member="m2"),
                    GroupClose(group=group, channel=7, reason="done")):
        assert link.receive(encode(message), 1.0) == [GroupReport(message)]
    frame = relay_frame(7, b"\x00rpc bytes")
    assert link.receive_bytes(frame, 2.0) == [RelayIn(7, frame)]
    assert link.last_seen == 2.0  # relayed traffic keeps the worker alive
    assert link.bad_frames == 0
    # Another tag, no payload, channel 0, too much payload, or half a header: typed errors.
    oversized = bytes((RELAY_TAG,)) + (1).to_bytes(4, "big") + b"x" * (MAX_RELAY_PAYLOAD + 1)
    for bad in (b"\x02\x00\x00\x00\x07abc", relay_frame(7, b"x")[:5], b"\x01\x00\x00\x00\x00a",
                oversized, b"\x01\x00"):
        [error] = sent(link.receive_bytes(bad, 3.0))
        assert error["code"] == "bad_relay_frame"
    assert link.bad_frames == 5


def test_a_binary_frame_before_the_welcome_is_refused():
    link = new_link()
    [refusal] = link.receive_bytes(relay_frame(1, b"x"), 0.0)
    assert isinstance(refusal, Refuse)
    assert refusal.code == "binary_frame"
