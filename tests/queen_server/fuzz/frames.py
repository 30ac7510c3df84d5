"""Bad frames for the queen's ``/worker`` websocket, and what the queen must answer to each.

The strategies make every kind of frame a worker might send: random text and bytes, truncated
and mistyped messages, queen-only messages, job frames naming another worker's job or none,
non-finite numbers, frames over the size limit, and answers to a worker's own job in good and bad
shapes. ``SessionOracle`` and ``expect_first`` say, from the protocol's own rules
(``shared_schema``), what the queen must answer. ``wsfuzz`` sends them to a real queen.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from hypothesis import strategies as st
from pydantic import ValidationError

from shared_schema import (
    PROTOCOL_VERSION,
    Chunk,
    Hello,
    JobError,
    LegacyRegistration,
    Ping,
    Pong,
    ProtocolError,
    Result,
    Status,
    decode,
    encode,
    loads_object,
    looks_like_registration,
)
from shared_schema.groups import parse_relay_frame

# The queen under fuzz runs with these limits (``wsfuzz.QUEEN_SETTINGS``): the smallest frame
# limit it allows, a small hello limit, and few bad frames before a close.
MAX_FRAME_BYTES = 64 * 1024
MAX_HELLO_BYTES = 8 * 1024
MAX_BAD_FRAMES = 8
UNKNOWN_JOB = "unknown_job"  # swarm.link.UNKNOWN_JOB, spelled out as the wire has it


@dataclass(frozen=True)
class Frame:
    """One frame a fuzzing worker sends; ``kind`` names the strategy that made it."""

    data: str | bytes
    kind: str

    def __repr__(self) -> str:
        shown = self.data if len(self.data) <= 200 else self.data[:200]
        return f"Frame({self.kind}, {len(self.data)} long, {shown!r})"


# --- strategies -------------------------------------------------------------------------------

HEX = "0123456789abcdef"
short_text = st.text(max_size=40)
json_scalars = (
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | short_text
)
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
counts = st.integers(min_value=0, max_value=10**6)
usages = st.fixed_dictionaries(
    {"prompt_tokens": counts, "completion_tokens": counts, "total_tokens": counts}
)


def hexes(n: int) -> st.SearchStrategy[str]:
    return st.text(HEX, min_size=n, max_size=n)


def dumps(value: Any) -> str:
    """JSON text for any generated value (the stdlib takes integers past 64 bits)."""
    return json.dumps(value, ensure_ascii=False)


def job_ids(other_jobs: list[str]) -> st.SearchStrategy[str]:
    named = [st.sampled_from(other_jobs)] if other_jobs else []
    return st.one_of(*named, st.sampled_from(["", "chatcmpl-0.1", "embd-0.1"]), short_text)


def message_dicts(other_jobs: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    """Well-formed protocol messages of every type, as dicts (queen-only types included)."""
    ids = job_ids(other_jobs)
    models = st.lists(
        st.fixed_dictionaries({"name": st.text(min_size=1, max_size=30)},
                              optional={"loaded": st.booleans(), "size_bytes": counts}),
        max_size=3,
    )
    finite = st.floats(min_value=-1e12, max_value=1e12)
    shapes = {
        "challenge": {"nonce": hexes(64)},
        "hello": {"protocol": st.just(PROTOCOL_VERSION), "worker_version": short_text,
                  "pubkey": hexes(64),
                  "signature": hexes(128), "cpu_count": counts, "disk_space": counts,
                  "vram": counts},
        "welcome": {"session_id": short_text, "worker_id": short_text,
                    "heartbeat_interval_s": st.floats(min_value=0.1, max_value=100)},
        "refused": {"code": short_text, "reason": short_text},
        "job": {"id": ids, "openai_url": st.just("/v1/chat/completions"),
                "openai_req": st.dictionaries(st.text(max_size=8), json_scalars, max_size=3)},
        "chunk": {"id": ids, "seq": counts,
                  "data": st.dictionaries(st.text(max_size=8), json_values, max_size=3)},
        "result": {"id": ids, "usage": usages},
        "error": {"id": ids, "code": short_text, "message": short_text,
                  "retryable": st.booleans()},
        "cancel": {"id": ids},
        "status": {"active_jobs": counts},
        "ping": {"ts": finite},
        "pong": {"ts": finite},
    }
    optional = {"status": {"max_jobs": st.integers(1, 256), "models": models,
                           "vram_free_mb": counts}}
    return st.one_of(*(
        st.fixed_dictionaries({"type": st.just(kind), **fields}, optional=optional.get(kind, {}))
        for kind, fields in shapes.items()
    ))


@st.composite
def wrong_types(draw: st.DrawFn, messages: st.SearchStrategy[dict[str, Any]]) -> str:
    """A well-formed message with one field replaced by any JSON value, or removed."""
    body = dict(draw(messages))
    name = draw(st.sampled_from(sorted(body)))
    if draw(st.booleans()):
        del body[name]
    else:
        body[name] = draw(json_values)
    return dumps(body)


@st.composite
def truncated(draw: st.DrawFn, messages: st.SearchStrategy[dict[str, Any]]) -> str:
    text = dumps(draw(messages))
    return text[: draw(st.integers(min_value=0, max_value=len(text) - 1))]


def oversized(limit: int) -> st.SearchStrategy[str | bytes]:
    """Frames over ``limit`` bytes: text or binary, JSON-looking or not."""
    sizes = st.integers(min_value=limit + 1, max_value=2 * limit)
    return st.one_of(
        sizes.map(lambda n: "x" * n),
        sizes.map(lambda n: b"\x00" * n),
        sizes.map(lambda n: '{"type": "status", "pad": "' + "y" * n + '"}'),
    )


def big_but_allowed(limit: int) -> st.SearchStrategy[str]:
    """Frames near the limit but under it: a valid status with padding, or broken JSON."""
    sizes = st.integers(min_value=limit // 2, max_value=limit - 100)
    return st.one_of(
        sizes.map(lambda n: '{"type": "status", "pad": "' + "y" * n + '"}'),
        sizes.map(lambda n: '{"type": "chunk", "id": "' + "z" * n),
    )


def of_kinds(kinds: dict[str, st.SearchStrategy[str | bytes]]) -> st.SearchStrategy[Frame]:
    """A frame of a kind drawn evenly (``one_of`` would favour the first strategies)."""
    return st.sampled_from(sorted(kinds)).flatmap(
        lambda kind: kinds[kind].map(lambda data: Frame(data, kind)))


def session_frames(other_jobs: list[str]) -> st.SearchStrategy[Frame]:
    """Every kind of frame a worker might send after its welcome, good or bad."""
    messages = message_dicts(other_jobs)
    ids = job_ids(other_jobs)
    job_frames = st.one_of(
        st.builds(lambda i, s: encode(Chunk(id=i, seq=s, data={"choices": []})), ids, counts),
        st.builds(lambda i: encode(Result(id=i, usage={"prompt_tokens": 1, "total_tokens": 1})),
                  ids),
        st.builds(lambda i: encode(JobError(id=i, code="x", message="y")), ids),
    )
    kinds: dict[str, st.SearchStrategy[str | bytes]] = {
        "text": st.text(max_size=200),
        "binary": st.binary(max_size=200),
        "json": json_values.map(dumps),
        "truncated": truncated(messages),
        "wrong_types": wrong_types(messages),
        "message": messages.map(dumps),
        "job_frame": job_frames,
        "non_finite": st.sampled_from(['{"type": "ping", "ts": NaN}',
                                       '{"type": "pong", "ts": Infinity}',
                                       '{"type": "ping", "ts": 1e999}']),
        "oversized": oversized(MAX_FRAME_BYTES),
        "big": big_but_allowed(MAX_FRAME_BYTES),
    }
    return of_kinds(kinds)


def answer_frames() -> st.SearchStrategy[list[dict[str, Any]]]:
    """A worker's answer to its own job, shapes good and bad: chunks, then maybe an end.

    The ``id`` is filled in with the real job's id when the frames are sent."""
    text = st.none() | short_text | json_scalars
    part = st.one_of(json_values, st.fixed_dictionaries(
        {}, optional={"role": text, "content": text}))
    choice = st.one_of(json_scalars, st.fixed_dictionaries({}, optional={
        "index": st.integers(0, 3) | json_scalars, "delta": part, "message": part,
        "finish_reason": st.none() | st.just("stop") | json_scalars}))
    data = st.fixed_dictionaries({}, optional={
        "choices": st.lists(choice, max_size=3) | json_values,
        "data": st.lists(st.one_of(json_scalars, st.fixed_dictionaries(
            {"index": st.integers(0, 3), "embedding": st.lists(st.floats(-1, 1), max_size=4)
             | json_values})), max_size=2) | json_values})
    big = st.integers(0, 10) | st.integers(2**31, 2**70)
    usage = st.fixed_dictionaries({"prompt_tokens": big, "completion_tokens": big,
                                   "total_tokens": big})
    chunk = st.fixed_dictionaries({"type": st.just("chunk"), "seq": st.integers(0, 5),
                                   "data": data})
    end = st.one_of(
        st.fixed_dictionaries({"type": st.just("result"), "data": data, "usage": usage}),
        st.fixed_dictionaries({"type": st.just("error"), "code": short_text,
                               "message": short_text, "retryable": st.booleans()}))
    return st.tuples(st.lists(chunk, max_size=3), st.lists(end, max_size=1)).map(
        lambda parts: parts[0] + parts[1])


def handshake_frames() -> st.SearchStrategy[Frame]:
    """First frames: garbage, broken or unsigned hellos, legacy-looking bodies, huge ones."""
    messages = message_dicts([])
    legacy = st.dictionaries(
        st.sampled_from(["ln_url", "cpu_count", "vram", "disk_space", "nv_gpus", "cl_gpus",
                         "nv_gpu_count", "type"]),
        json_values, max_size=5,
    )
    kinds: dict[str, st.SearchStrategy[str | bytes]] = {
        "text": st.text(max_size=200),
        "binary": st.binary(max_size=200),
        "json": json_values.map(dumps),
        "truncated": truncated(messages),
        "wrong_types": wrong_types(messages),
        "message": messages.map(dumps),
        "legacy": legacy.map(dumps),
        "registration": st.fixed_dictionaries(
            {"cpu_count": counts, "vram": counts},
            optional={"ln_url": st.none() | short_text, "disk_space": counts,
                      "nv_gpus": st.lists(st.fixed_dictionaries(
                          {"name": short_text, "memory": counts}), max_size=2)},
        ).map(dumps),
        "over_hello_limit": st.integers(MAX_HELLO_BYTES + 1, MAX_FRAME_BYTES - 100).map(
            lambda n: '{"type": "hello", "protocol": 1, "pad": "' + "p" * n + '"}'),
        "oversized": oversized(MAX_FRAME_BYTES),
    }
    return of_kinds(kinds)


# --- the oracle -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Expect:
    """What the queen must answer to one frame."""

    kind: Literal["error", "pong", "nothing", "close"]
    code: str | int | None = None  # the error's (or refusal's) code, or the close code
    job_id: str = ""
    ts: float = 0.0
    close: int | None = None  # the close code after a refusal


def frame_size(data: str | bytes) -> int:
    return len(data.encode() if isinstance(data, str) else data)


def named_job(data: str) -> str:
    try:
        job_id = loads_object(data).get("id")
    except ProtocolError:
        return ""
    return job_id[:128] if isinstance(job_id, str) else ""


@dataclass
class SessionOracle:
    """The queen's answers to a welcomed worker's frames, from the protocol's own rules."""

    max_bad: int = MAX_BAD_FRAMES
    max_frame: int = MAX_FRAME_BYTES
    bad: int = 0

    def expect(self, data: str | bytes) -> Expect:
        if frame_size(data) > self.max_frame:
            return Expect("close", 1009)
        if isinstance(data, bytes):
            try:
                parse_relay_frame(data)
            except ProtocolError:
                return self._bad("bad_relay_frame")
            return Expect("nothing")  # a relayed frame on no open channel: dropped
        try:
            message = decode(data)
        except ProtocolError as exc:
            return self._bad(exc.code, named_job(data))
        if isinstance(message, Chunk | Result | JobError):
            # The fuzzing worker holds no job, so every job frame names someone else's.
            return Expect("error", UNKNOWN_JOB, message.id[:128])
        if isinstance(message, Ping):
            return Expect("pong", ts=message.ts)
        if isinstance(message, Pong | Status):
            return Expect("nothing")
        return self._bad("unexpected_message", named_job(data))

    def _bad(self, code: str, job_id: str = "") -> Expect:
        self.bad += 1
        if self.bad >= self.max_bad:
            return Expect("close", 1008)
        return Expect("error", code, job_id)


def expect_first(data: str | bytes, *, v1: bool) -> Expect:
    """The queen's answer to a first frame: a ``refused`` with a code, then a close; or, for a
    legacy registration it accepts, nothing (it is registered and sent nothing)."""
    if frame_size(data) > MAX_FRAME_BYTES:
        return Expect("close", 1009)
    if isinstance(data, bytes):
        return Expect("error", "binary_frame", close=1008)
    if len(data) > MAX_HELLO_BYTES:
        return Expect("error", "frame_too_large", close=1009)
    try:
        body = loads_object(data)
    except ProtocolError as exc:
        return Expect("error", exc.code, close=1008)
    if v1:
        if body.get("type") != "hello":
            return Expect("error", "unexpected_message", close=1008)
        if body.get("protocol") != PROTOCOL_VERSION:
            return Expect("error", "protocol_version", close=1008)
        try:
            Hello.model_validate(body, extra="ignore")
        except ValidationError:
            return Expect("error", "invalid_message", close=1008)
        # Nothing generated here is signed over this connection's nonce.
        return Expect("error", "bad_signature", close=1008)
    if not looks_like_registration(body):
        return Expect("error", "unexpected_message", close=1008)
    try:
        LegacyRegistration.model_validate(body, extra="ignore")
    except ValidationError:
        return Expect("error", "invalid_message", close=1008)
    return Expect("nothing")
