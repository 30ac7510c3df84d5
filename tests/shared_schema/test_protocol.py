"""Protocol v1 messages: round trips, lenient decoding, strict construction, hello signatures."""

from __future__ import annotations

import orjson
import pytest
from pydantic import ValidationError

from queen_server.errors import HandshakeRefused
from queen_server.identity import public_id, verify_hello
from shared_schema import (
    PROTOCOL_VERSION,
    Cancel,
    Challenge,
    Chunk,
    ClGpu,
    DownloadProgress,
    Hello,
    InvalidQueenUrl,
    Job,
    JobError,
    LegacyRegistration,
    ModelDescriptor,
    NvGpu,
    Ping,
    Pong,
    ProtocolError,
    Refused,
    Result,
    Status,
    Usage,
    Welcome,
    decode,
    earnings_auth_payload,
    encode,
    hello_signing_payload,
    loads_object,
)
from tests.support.workers import ECHO_MODEL, new_key, pubkey_hex, signed_hello

NONCE = "0123456789abcdef" * 4
PUBKEY = "ab" * 32
SIGNATURE = "cd" * 64
SHA = "ef" * 32


def _hello(**overrides: object) -> Hello:
    fields: dict[str, object] = {
        "protocol": PROTOCOL_VERSION,
        "worker_version": "1.2.3",
        "pubkey": PUBKEY,
        "signature": SIGNATURE,
        "ln_url": "lnurl1dp68gurn8ghj7",
        "cpu_count": 16,
        "disk_space": 250,
        "vram": 24576,
        "nv_gpu_count": 1,
        "nv_driver_version": "550.54.14",
        "nv_gpus": [
            NvGpu(
                name="NVIDIA GeForce RTX 4090",
                memory=24564,
                memory_free_mb=20000,
                compute_capability="8.9",
                utilization_pct=3,
                uuid="GPU-1234",
            )
        ],
        "cl_driver_version": "3.0",
        "cl_gpus": [ClGpu(name="gfx1100", vendor="AMD", memory=16384, driver_version="3.0")],
        "models": [
            ModelDescriptor(
                name=ECHO_MODEL,
                file_name="echo.Q4_K_M.gguf",
                size_bytes=123456,
                sha256=SHA,
                parameter_count=135_000_000,
                quant="Q4_K_M",
                context_length=8192,
                loaded=True,
            )
        ],
        "capabilities": ["chat", "embeddings", "stream"],
        "max_jobs": 4,
    }
    fields.update(overrides)
    return Hello(**fields)


USAGE = Usage(prompt_tokens=7, completion_tokens=3, total_tokens=10)

EVERY_MESSAGE = [
    Challenge(nonce=NONCE),
    _hello(),
    Welcome(session_id="s-1", worker_id="abcdefghijkl", heartbeat_interval_s=15.0),
    Refused(code="bad_signature", reason="the hello's signature does not verify"),
    Job(
        id="job-1",
        openai_url="/v1/chat/completions",
        openai_req={"model": ECHO_MODEL, "messages": [{"role": "user", "content": "hi"}]},
    ),
    Chunk(
        id="job-1",
        seq=3,
        data={"choices": [{"index": 0, "delta": {"content": " hi"}, "finish_reason": None}]},
    ),
    Result(
        id="job-1",
        data={"choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}]},
        usage=USAGE,
    ),
    JobError(id="job-1", code="engine_failed", message="out of memory", retryable=True),
    Cancel(id="job-1", reason="client_gone"),
    Status(
        active_jobs=2,
        max_jobs=8,
        models=[ModelDescriptor(name=ECHO_MODEL, size_bytes=1000, loaded=False)],
        downloads=[
            DownloadProgress(
                name="org/repo:Q8_0", downloaded_bytes=10, total_bytes=100, bytes_per_s=2.5
            )
        ],
        vram_free_mb=1024,
        disk_space=99,
    ),
    Ping(ts=1234.5),
    Pong(ts=1234.5),
]


@pytest.mark.parametrize("message", EVERY_MESSAGE, ids=lambda m: m.type)
def test_every_message_round_trips(message):
    frame = encode(message)
    assert isinstance(frame, str)
    decoded = decode(frame)
    assert type(decoded) is type(message)
    assert decoded == message
    # Bytes frames decode the same way.
    assert decode(frame.encode()) == message


def test_every_message_type_is_covered():
    types = {message.type for message in EVERY_MESSAGE}
    assert types == {
        "challenge", "hello", "welcome", "refused", "job", "chunk", "result", "error",
        "cancel", "status", "ping", "pong",
    }


def test_decode_ignores_unknown_top_level_fields():
    frame = encode(Cancel(id="job-9", reason="timeout"))
    body = orjson.loads(frame)
    body["added_in_protocol_v7"] = {"anything": [1, 2, 3]}
    decoded = decode(orjson.dumps(body))
    assert decoded == Cancel(id="job-9", reason="timeout")


def test_decode_ignores_unknown_nested_fields():
    body = orjson.loads(encode(_hello()))
    body["nv_gpus"][0]["pcie_gen"] = 4
    body["cl_gpus"][0]["new_thing"] = "x"
    body["models"][0]["license"] = "apache-2.0"
    decoded = decode(orjson.dumps(body))
    assert decoded == _hello()

    status = orjson.loads(encode(EVERY_MESSAGE[9]))
    status["downloads"][0]["eta_s"] = 12
    status["models"][0]["arch"] = "llama"
    assert decode(orjson.dumps(status)) == EVERY_MESSAGE[9]

    result = orjson.loads(encode(EVERY_MESSAGE[6]))
    result["usage"]["prompt_tokens_details"] = {"cached_tokens": 0}
    assert decode(orjson.dumps(result)) == EVERY_MESSAGE[6]


def test_decode_keeps_openai_payloads_untouched():
    """Free-form payloads are relayed: their unknown keys are data, not protocol fields."""
    request = {"model": "m", "messages": [], "logit_bias": {"42": -100}, "x_vendor": True}
    decoded = decode(encode(Job(id="j", openai_url="/v1/chat/completions", openai_req=request)))
    assert isinstance(decoded, Job)
    assert decoded.openai_req == request


@pytest.mark.parametrize(
    ("cls", "fields"),
    [
        (Cancel, {"id": "j", "surprise": 1}),
        (Ping, {"ts": 1.0, "extra": "x"}),
        (Chunk, {"id": "j", "seq": 0, "data": {}, "sequence": 0}),
        (Status, {"active_jobs": 0, "gpu_temp": 70}),
        (NvGpu, {"name": "g", "memory": 1, "pcie_gen": 4}),
    ],
)
def test_constructing_with_an_unknown_field_raises(cls, fields):
    with pytest.raises(ValidationError) as info:
        cls(**fields)
    assert info.value.errors()[0]["type"] == "extra_forbidden"


@pytest.mark.parametrize(
    ("cls", "fields"),
    [
        (Chunk, {"id": "j", "seq": "three", "data": {}}),
        (Chunk, {"id": "j", "seq": -1, "data": {}}),
        (Chunk, {"id": "j", "seq": 0, "data": ["not", "an", "object"]}),
        (Job, {"id": 17, "openai_url": "/v1/chat/completions", "openai_req": {}}),
        (Result, {"id": "j", "usage": {"prompt_tokens": -1, "total_tokens": 0}}),
        (JobError, {"id": "j", "code": "c", "message": "m", "retryable": "perhaps"}),
        (Challenge, {"nonce": "not-hex"}),
        (Welcome, {"session_id": "s", "worker_id": "w", "heartbeat_interval_s": 0}),
    ],
)
def test_constructing_with_a_wrong_type_raises(cls, fields):
    with pytest.raises(ValidationError):
        cls(**fields)


def test_constructing_a_hello_with_a_bad_key_or_too_many_jobs_raises():
    with pytest.raises(ValidationError):
        _hello(pubkey="zz" * 32)
    with pytest.raises(ValidationError):
        _hello(signature="cd" * 10)
    with pytest.raises(ValidationError):
        _hello(max_jobs=0)
    with pytest.raises(ValidationError):
        _hello(max_jobs=257)


@pytest.mark.parametrize("field", ["vram", "cpu_count", "disk_space", "nv_gpu_count"])
def test_hardware_past_any_real_machine_is_refused(field):
    with pytest.raises(ValidationError, match=field):
        _hello(**{field: 18 * 2**60})
    with pytest.raises(ValidationError, match=field):
        LegacyRegistration.model_validate({field: 18 * 2**60})
    _hello(vram=80 * 1024 * 16, cpu_count=256, disk_space=100_000, nv_gpu_count=16)  # a big rig


@pytest.mark.parametrize("frame", ["garbage", "", "{", '{"type": "ping",}', b"\xff\xfe"])
def test_decode_garbage_is_invalid_json(frame):
    with pytest.raises(ProtocolError) as info:
        decode(frame)
    assert info.value.code == "invalid_json"
    assert info.value.message


@pytest.mark.parametrize(
    "frame",
    ['{"type": "nope"}', '{"type": 5}', "{}", '{"id": "j", "seq": 0, "data": {}}'],
)
def test_decode_bad_or_missing_type_is_unknown_type(frame):
    with pytest.raises(ProtocolError) as info:
        decode(frame)
    assert info.value.code == "unknown_type"


@pytest.mark.parametrize(
    ("frame", "where"),
    [
        ('{"type": "chunk", "id": "j", "seq": -1, "data": {}}', "seq"),
        ('{"type": "chunk", "id": "j", "seq": "x", "data": {}}', "seq"),
        ('{"type": "chunk", "id": "j", "data": {}}', "seq"),
        ('{"type": "job", "id": 5, "openai_url": "/v1/x", "openai_req": {}}', "id"),
        ('{"type": "status", "models": [{"name": ""}]}', "models.0.name"),
        ('{"type": "result", "id": "j", "usage": {"prompt_tokens": 1}}', "usage.total_tokens"),
    ],
)
def test_decode_wrong_field_is_invalid_message(frame, where):
    with pytest.raises(ProtocolError) as info:
        decode(frame)
    assert info.value.code == "invalid_message"
    assert info.value.message.startswith(f"{where}:")


@pytest.mark.parametrize("frame", ["[1, 2]", "42", "null", '"ping"'])
def test_decode_a_json_value_that_is_not_an_object_is_refused(frame):
    with pytest.raises(ProtocolError) as info:
        decode(frame)
    # Same code loads_object uses for a non-object frame.
    assert info.value.code == "invalid_message"
    with pytest.raises(ProtocolError) as legacy:
        loads_object(frame)
    assert legacy.value.code == info.value.code


def test_loads_object():
    assert loads_object(b'{"a": [1, {"b": null}]}') == {"a": [1, {"b": None}]}
    with pytest.raises(ProtocolError) as info:
        loads_object("{oops")
    assert info.value.code == "invalid_json"


# --- hello signing ---------------------------------------------------------------------------


ORIGIN = "https://queen.example"


def test_hello_signing_payload_covers_origin_nonce_pubkey_and_ln_url():
    base = hello_signing_payload(NONCE, PUBKEY, "lnurl-a", ORIGIN)
    assert base == hello_signing_payload(NONCE, PUBKEY, "lnurl-a", ORIGIN)
    assert base.startswith(b"apiary-hello/2\n")  # the old, unbound form was apiary-hello/1
    assert NONCE.encode() in base
    assert PUBKEY.encode() in base
    assert b"lnurl-a" in base
    assert ORIGIN.encode() in base
    variants = {
        hello_signing_payload("f" * 64, PUBKEY, "lnurl-a", ORIGIN),
        hello_signing_payload(NONCE, "12" * 32, "lnurl-a", ORIGIN),
        hello_signing_payload(NONCE, PUBKEY, "lnurl-b", ORIGIN),
        hello_signing_payload(NONCE, PUBKEY, None, ORIGIN),
        hello_signing_payload(NONCE, PUBKEY, "lnurl-a", "http://queen.example"),
        hello_signing_payload(NONCE, PUBKEY, "lnurl-a", "https://queen.example:8443"),
        # The protocol-1 payload: what an old worker signs, never what this one checks.
        b"\n".join([b"apiary-hello/1", NONCE.encode(), PUBKEY.encode(), b"lnurl-a"]),
    }
    assert base not in variants
    assert len(variants) == 7


@pytest.mark.parametrize("origin", ["wss://queen.example/worker", "https://Queen.Example",
                                    "https://queen.example:443", "https://queen.example\nx",
                                    "", "queen.example"])
def test_payloads_take_only_normalised_origins(origin):
    with pytest.raises(InvalidQueenUrl):
        hello_signing_payload(NONCE, PUBKEY, None, origin)
    with pytest.raises(InvalidQueenUrl):
        earnings_auth_payload(PUBKEY, 1_700_000_000, origin)


def test_earnings_payload_names_the_queen():
    payload = earnings_auth_payload(PUBKEY, 1_700_000_000, ORIGIN)
    assert payload == b"apiary-earnings/2\nhttps://queen.example\n" + PUBKEY.encode() + \
        b"\n1700000000"
    assert payload != earnings_auth_payload(PUBKEY, 1_700_000_000, "https://other.example")


def test_signed_hello_verifies_for_its_origin_only():
    key = new_key()
    hello = signed_hello(key, NONCE, models=[], ln_url="http://pay.example/me", origin=ORIGIN)
    assert hello.pubkey == pubkey_hex(key)
    assert verify_hello(hello, NONCE, [ORIGIN]) == ORIGIN
    # It still verifies after crossing the wire, and the origin it names is the one returned.
    assert verify_hello(decode(encode(hello)), NONCE,
                        ["http://127.0.0.1:8000", ORIGIN]) == ORIGIN
    with pytest.raises(HandshakeRefused) as info:
        verify_hello(hello, NONCE, ["https://evil.example", "http://queen.example"])
    assert info.value.code == "bad_signature"
    with pytest.raises(HandshakeRefused):
        verify_hello(hello, NONCE, [])  # a queen that knows no origin of its own accepts none


def test_signed_hello_without_ln_url_verifies():
    key = new_key()
    verify_hello(signed_hello(key, NONCE, models=[], origin=ORIGIN), NONCE, [ORIGIN])


def test_hello_signed_over_another_nonce_is_refused():
    key = new_key()
    hello = signed_hello(key, NONCE, models=[], sign_nonce="9" * 64, origin=ORIGIN)
    with pytest.raises(HandshakeRefused) as info:
        verify_hello(hello, NONCE, [ORIGIN])
    assert info.value.code == "bad_signature"
    # And a correctly signed hello replayed against a fresh nonce is refused too.
    good = signed_hello(key, NONCE, models=[], origin=ORIGIN)
    with pytest.raises(HandshakeRefused) as replay:
        verify_hello(good, "a" * 64, [ORIGIN])
    assert replay.value.code == "bad_signature"


def test_hello_with_a_changed_ln_url_is_refused():
    key = new_key()
    hello = signed_hello(key, NONCE, models=[], ln_url="http://pay.example/owner", origin=ORIGIN)
    hijacked = hello.model_copy(update={"ln_url": "http://pay.example/thief"})
    with pytest.raises(HandshakeRefused) as info:
        verify_hello(hijacked, NONCE, [ORIGIN])
    assert info.value.code == "bad_signature"
    dropped = hello.model_copy(update={"ln_url": None})
    with pytest.raises(HandshakeRefused):
        verify_hello(dropped, NONCE, [ORIGIN])


def test_hello_signed_by_another_key_is_refused():
    hello = signed_hello(new_key(), NONCE, models=[], origin=ORIGIN)
    impostor = hello.model_copy(update={"pubkey": pubkey_hex(new_key())})
    with pytest.raises(HandshakeRefused) as info:
        verify_hello(impostor, NONCE, [ORIGIN])
    assert info.value.code == "bad_signature"


def test_public_id_is_stable_and_short():
    key = pubkey_hex(new_key())
    first = public_id(key)
    assert first == public_id(key)
    assert len(first) == 12
    assert first == first.lower()
    assert first.isalnum()
    assert public_id(pubkey_hex(new_key())) != first
    # A fixed key maps to a fixed id, across processes and releases.
    # sha256 of the raw key bytes, base32, first 12 characters, lower case.
    assert public_id("00" * 32) == "mzuhvlpymk6x"


def test_empty_payout_address_means_none():
    assert _hello(ln_url="").ln_url is None


def test_a_chunk_says_how_many_tokens_it_joins_and_an_older_one_means_one():
    from shared_schema.protocol import MAX_CHUNK_TOKENS

    joined = decode(encode(Chunk(id="j", seq=3, data={}, tokens=7)))
    assert (joined.seq, joined.tokens) == (3, 7)
    older = decode('{"type": "chunk", "id": "j", "seq": 0, "data": {}}')
    assert older.tokens == 1
    for bad in (0, -1, MAX_CHUNK_TOKENS + 1, "2", True, 2.0):
        with pytest.raises(ProtocolError) as caught:
            decode(orjson.dumps({"type": "chunk", "id": "j", "seq": 0, "data": {},
                                 "tokens": bad}))
        assert caught.value.code == "invalid_message"
        assert "tokens" in caught.value.message


def test_a_welcome_from_an_older_queen_names_no_chunk_tokens():
    bare = decode('{"type": "welcome", "session_id": "s", "worker_id": "w", '
                  '"heartbeat_interval_s": 15}')
    assert bare.chunk_tokens is None
    assert decode(encode(Welcome(session_id="s", worker_id="w", heartbeat_interval_s=1,
                                 chunk_tokens=64))).chunk_tokens == 64
