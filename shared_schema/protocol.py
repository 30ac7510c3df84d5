"""Protocol v1 between the queen and its workers: one JSON text frame per message.

Every message is a pydantic model with a ``type`` literal; ``Message`` is their discriminated
union. ``encode`` turns a message into a frame, ``decode`` turns a frame into a message and raises
``ProtocolError`` for anything else. See docs/ARCHITECTURE.md for the sequence.

The framing is still the ``apiary.v1`` subprotocol; ``PROTOCOL_VERSION`` (2) counts changes
to what is signed: since 2, the hello and the earnings header name the queen's origin
(``queen_origin``), and a queen refuses older workers with a reason that says to upgrade.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import orjson
from pydantic import Field, TypeAdapter, ValidationError, field_validator

from shared_schema import capabilities as caps
from shared_schema.base import WireModel
from shared_schema.errors import InvalidQueenUrl, ProtocolError
from shared_schema.groups import (
    MAX_MEMBER_DEVICES,
    GroupClose,
    GroupEnd,
    GroupFailed,
    GroupLead,
    GroupMemberReady,
    GroupOpen,
    GroupReady,
    GroupServe,
)
from shared_schema.hardware import (
    MAX_CPUS,
    MAX_DISK_GB,
    MAX_DISK_MB,
    MAX_GPUS,
    MAX_VRAM_MB,
    ClGpu,
    DownloadProgress,
    ModelDescriptor,
    NvGpu,
    empty_to_none,
)
from shared_schema.openai_types import Usage
from shared_schema.placement import Demand, Fetch, FetchFailed
from shared_schema.training import AdapterRef, Uploaded

# 2: the hello and earnings signatures name the queen's origin (``queen_origin``), so neither
# can be relayed to another queen. A queen refuses a hello of any other version.
PROTOCOL_VERSION = 2
HELLO_SIGNATURE_CONTEXT = b"apiary-hello/2"
EARNINGS_SIGNATURE_CONTEXT = b"apiary-earnings/2"
# v1 workers offer this websocket subprotocol. A connection without it is a legacy worker: the
# queen sends it no challenge and waits for its bare registration, as the original server did.
SUBPROTOCOL = "apiary.v1"
# A worker with this capability can continue an answer another worker began (``Job.continuation``).
# The others are in ``shared_schema.capabilities``.
CAPABILITY_CONTINUE = caps.CONTINUE
# The most engine chunks one ``Chunk`` frame may join (``Chunk.tokens``, ``Welcome.chunk_tokens``).
MAX_CHUNK_TOKENS = 4096

# Close codes the queen uses on the worker websocket (RFC 6455 private range for our own).
CLOSE_GOING_AWAY = 1001
CLOSE_POLICY = 1008
CLOSE_TOO_BIG = 1009
CLOSE_REPLACED = 4000
CLOSE_HEARTBEAT = 4001

# The memory of each device a worker gives a model group (issue 19), MB, in llama.cpp's device
# order: a claim like any other, bounded per device and in count; the queen's planner clamps it.
DeviceFreeMb = Annotated[list[Annotated[int, Field(ge=0, le=MAX_VRAM_MB, strict=True)]],
                         Field(min_length=1, max_length=MAX_MEMBER_DEVICES)]
DEVICE_FREE_MB_HELP = (
    "The memory, MB, of each device this worker gives a model group (its GPUs; its CPU, at its "
    "pool's budget, when it has none or its owner keeps layers off them), in llama.cpp's device "
    "order. None: an older worker, or one that does not join groups.")


class Challenge(WireModel):
    type: Literal["challenge"] = "challenge"
    nonce: str = Field(pattern=r"^[0-9a-f]{32,128}$")
    protocol: int = PROTOCOL_VERSION


# Ed25519 public keys of small order (libsodium's blocklist, read with the sign bit cleared).
# Nobody holds their private keys, yet forged signatures verify under them for a share of all
# messages (the all-zero key with an all-zero signature: about one nonce in four). Refused.
SMALL_ORDER_KEYS = frozenset({
    "0000000000000000000000000000000000000000000000000000000000000000",
    "0100000000000000000000000000000000000000000000000000000000000000",
    "26e8958fc2b227b045c3f489f2ef98f0d5dfac05d3c63339b13802886d53fc05",
    "c7176a703d4dd84fba3c0b760d10670f2a2053fa2c39ccc64ec7fd7792ac037a",
    "ecffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f",
    "edffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f",
    "eeffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f",
})


def is_small_order_key(pubkey: str) -> bool:
    """Whether a hex Ed25519 public key is one that anyone can forge signatures for."""
    raw = bytearray(bytes.fromhex(pubkey))
    if len(raw) != 32:
        return False
    raw[31] &= 0x7F
    return raw.hex() in SMALL_ORDER_KEYS


def _usable_key(value: str) -> str:
    if is_small_order_key(value):
        raise ValueError("a small-order Ed25519 key, which anyone can sign for")
    return value


class Hello(WireModel):
    """The worker's answer to a challenge: who it is, what it has, signed with its key."""

    type: Literal["hello"] = "hello"
    protocol: int
    worker_version: str
    pubkey: str = Field(pattern=r"^[0-9a-f]{64}$", description="Ed25519 public key, hex.")
    _no_small_order_key = field_validator("pubkey")(_usable_key)
    signature: str = Field(pattern=r"^[0-9a-f]{128}$", description="Ed25519 signature, hex.")
    # The original registration fields.
    ln_url: str | None = Field(default=None, max_length=2048)
    _no_empty_ln_url = field_validator("ln_url")(empty_to_none)
    cpu_count: int = Field(ge=0, le=MAX_CPUS)
    disk_space: int = Field(ge=0, le=MAX_DISK_GB, description="Free disk for models, GB.")
    vram: int = Field(ge=0, le=MAX_VRAM_MB, description="Total GPU memory, MB.")
    nv_gpu_count: int = Field(default=0, ge=0, le=MAX_GPUS)
    nv_driver_version: str | None = None
    nv_gpus: list[NvGpu] = Field(default_factory=list)
    cl_driver_version: str | None = None
    cl_gpus: list[ClGpu] = Field(default_factory=list)
    # Added by protocol v1.
    models: list[ModelDescriptor] = Field(default_factory=list)
    capabilities: list[str] = Field(default_factory=list)
    max_jobs: int = Field(default=1, ge=1, le=256)
    # Added for models on demand (issue 17); None from older workers.
    memory_budget_mb: int | None = Field(
        default=None, ge=0, le=MAX_VRAM_MB,
        description="RAM the worker lets loaded models use (its pool's budget), MB.")
    model_room_mb: int | None = Field(
        default=None, ge=0, le=MAX_DISK_MB,
        description="Room for another model: free disk and what the owner's quota leaves, MB.")
    swarm_models: bool = Field(
        default=False, description="The owner lets the swarm choose this worker's models "
        "(it pulls what is in demand and evicts the least recently used).")
    # Added for model groups (issue 19); None from older workers and builds without RPC.
    llama_build: str | None = Field(
        default=None, max_length=128, pattern=r"^[\x21-\x7e]+$",
        description="The llama.cpp build (ggml version and commit, RPC protocol): only workers "
        "of one build are grouped.")
    lan_hint: str | None = Field(
        default=None, pattern=r"^[0-9a-f]{32}$",
        description="A hash of the worker's local network; the queen joins it to the address "
        "it sees, so only workers behind one address can share a LAN.")
    device_free_mb: DeviceFreeMb | None = Field(default=None, description=DEVICE_FREE_MB_HELP)
    # Added for the volunteer's safety (issue 34); None from older workers and from owners who
    # let their worker join any group.
    group_family: str | None = Field(
        default=None, pattern=r"^[0-9a-f]{32}$",
        description="The owner's family of machines (an HMAC of the owner's family code and "
        "this queen's origin): the worker joins only groups whose every part has the same "
        "family. None: groups of workers without one.")


class Welcome(WireModel):
    type: Literal["welcome"] = "welcome"
    session_id: str
    worker_id: str = Field(description="The worker's short public id.")
    heartbeat_interval_s: float = Field(gt=0)
    protocol: int = PROTOCOL_VERSION
    # Whether this queen pays its workers (billing on), and from what balance it pays out.
    # None: an older queen that does not say.
    pays_workers: bool | None = None
    payout_threshold_msat: int | None = Field(default=None, ge=0, le=2**63 - 1)
    # What developers ask this queen for (issue 17); None from an older queen.
    demand: Demand | None = None
    # The most engine chunks this queen takes joined in one ``Chunk`` (its ``tokens``); None
    # from an older queen, which counts every chunk as one: a worker then joins none.
    chunk_tokens: int | None = Field(default=None, ge=1, le=MAX_CHUNK_TOKENS)


class Refused(WireModel):
    type: Literal["refused"] = "refused"
    code: str
    reason: str


# A job's prompt-cache scope (``Job.cache_scope``): 128 bits of an HMAC, in lowercase hex.
CACHE_SCOPE = r"^[0-9a-f]{32}$"


class Job(WireModel):
    type: Literal["job"] = "job"
    id: str
    openai_url: str
    openai_req: dict[str, Any]
    continuation: str | None = Field(
        default=None,
        description="Assistant text another worker already delivered for this request: continue "
        "it, with no end of turn inserted, and send only the new text. Sent only to workers "
        f"with the '{CAPABILITY_CONTINUE}' capability.",
    )
    cache_scope: str | None = Field(
        default=None,
        pattern=CACHE_SCOPE,
        description="Whose prompt cache this job may use: 32 hex digits the queen derives from "
        "the caller (an HMAC under a secret of its own, so a worker can neither tell who the "
        "caller is nor link scopes across queens). A worker reuses a cached prefix only between "
        "jobs of the same scope; None (audits' score jobs, embeddings): no reuse across jobs.",
    )
    adapter: AdapterRef | None = Field(
        default=None,
        description="A fine-tuned model (issue 37): the request's model is this adapter's "
        "'ft:' name, served as its base plus the LoRA adapter the worker fetches from the queen "
        "(by path and token, checked by sha256). Sent only to workers with the 'lora' "
        "capability that hold the base.",
    )


class Chunk(WireModel):
    """One streamed piece of a job: ``data`` is an OpenAI ``chat.completion.chunk`` object.

    ``tokens``: how many of the engine's chunks this frame joins (a worker joins the chunks it
    made while its last frame was being sent, when the queen's welcome names ``chunk_tokens``).
    A claim, like every count a worker sends: the queen believes it only up to what the text it
    delivered can hold. An older worker leaves it out (one per frame)."""

    type: Literal["chunk"] = "chunk"
    id: str
    seq: int = Field(ge=0)
    data: dict[str, Any]
    tokens: int = Field(default=1, ge=1, le=MAX_CHUNK_TOKENS, strict=True)


class Result(WireModel):
    """The end of a job. For a streamed job ``data`` may be empty; ``usage`` is always true."""

    type: Literal["result"] = "result"
    id: str
    data: dict[str, Any] = Field(default_factory=dict)
    usage: Usage


class JobError(WireModel):
    """A job failed on the worker; or, sent by the queen, a frame the worker sent was bad.

    The queen answers every bad frame after the welcome with an ``error``: ``code`` is the
    ``ProtocolError`` code (``invalid_json``, ``unknown_type``, ``invalid_message``,
    ``binary_frame``, ``unexpected_message``, ``unknown_job``) and ``id`` the job the frame
    named, or "". A worker logs it; too many bad frames close the session (``CLOSE_POLICY``).
    """

    type: Literal["error"] = "error"
    id: str
    code: str
    message: str
    retryable: bool = False


class TrainReport(WireModel):
    """A training job's progress (issue 37, ``shared_schema.training``): after ``step`` of
    ``total_steps`` optimizer steps, in epoch ``epoch`` (from 1), the mean ``loss`` of the steps
    since the last report and the tokens trained so far; ``checkpoint``: the checkpoint taken
    after this step, already uploaded. Claims, like every count a worker sends: the queen keeps
    only what it can check (steps and tokens never going back, tokens within its bound,
    checkpoints it received whole)."""

    type: Literal["train_report"] = "train_report"
    id: str
    step: int = Field(ge=0, le=100_000_000, strict=True)
    total_steps: int = Field(ge=1, le=100_000_000, strict=True)
    epoch: int = Field(ge=1, le=50, strict=True)
    loss: float = Field(ge=0, le=1e6, allow_inf_nan=False)
    trained_tokens: int = Field(ge=0, le=10**12, strict=True)
    checkpoint: Uploaded | None = None


class Cancel(WireModel):
    type: Literal["cancel"] = "cancel"
    id: str
    reason: str = "cancelled"


class Status(WireModel):
    """The worker's load and holdings; may arrive at any time after the welcome."""

    type: Literal["status"] = "status"
    active_jobs: int = Field(default=0, ge=0)
    max_jobs: int | None = Field(default=None, ge=1, le=256)
    models: list[ModelDescriptor] | None = None
    downloads: list[DownloadProgress] = Field(default_factory=list)
    vram_free_mb: int | None = Field(default=None, ge=0, le=MAX_VRAM_MB)
    disk_space: int | None = Field(default=None, ge=0, description="Free disk for models, GB.")
    model_room_mb: int | None = Field(default=None, ge=0, le=MAX_DISK_MB)
    paused: str | None = Field(
        default=None, max_length=200, description="Why the owner paused this worker (on "
        "battery, the GPU in use, outside its hours); None: not paused. A paused worker takes "
        "no jobs and no fetches.")
    device_free_mb: DeviceFreeMb | None = Field(
        default=None, description=DEVICE_FREE_MB_HELP + " Left out: unchanged.")


class Ping(WireModel):
    type: Literal["ping"] = "ping"
    ts: float = 0.0


class Pong(WireModel):
    type: Literal["pong"] = "pong"
    ts: float = 0.0


Message = Annotated[
    Challenge | Hello | Welcome | Refused | Job | Chunk | Result | JobError | Cancel | Status
    | TrainReport | Ping | Pong | Demand | Fetch | FetchFailed | GroupServe | GroupMemberReady
    | GroupLead | GroupReady | GroupEnd | GroupFailed | GroupOpen | GroupClose,
    Field(discriminator="type"),
]
MESSAGE_ADAPTER: TypeAdapter[Message] = TypeAdapter(Message)


def encode(message: WireModel) -> str:
    """Serialise a message into one text frame."""
    return message.model_dump_json()


def decode(frame: str | bytes) -> Message:
    """Parse one frame into a message, ignoring unknown fields.

    Raises ``ProtocolError`` with code ``invalid_json``, ``unknown_type`` or ``invalid_message``.
    """
    try:
        return MESSAGE_ADAPTER.validate_json(frame, extra="ignore")
    except ValidationError as exc:
        raise _protocol_error(frame, exc) from exc


def _protocol_error(frame: str | bytes, exc: ValidationError) -> ProtocolError:
    first = exc.errors(include_url=False)[0]
    kind = first["type"]
    if kind == "json_invalid":
        return ProtocolError("invalid_json", f"frame is not valid JSON: {first['msg']}")
    if kind in {"union_tag_invalid", "union_tag_not_found", "model_attributes_type"}:
        return ProtocolError("unknown_type", f"frame has no known message type: {first['msg']}")
    where = ".".join(str(p) for p in first["loc"][1:]) or "frame"
    return ProtocolError("invalid_message", f"{where}: {first['msg']}")


# --- the queen's origin and what workers sign ------------------------------------------------

_SCHEMES = {"ws": "http", "wss": "https", "http": "http", "https": "https"}
_DEFAULT_PORTS = {"http": 80, "https": 443}
_HOST_NAME = re.compile(r"^[a-z0-9_]([a-z0-9_-]{0,62})(\.[a-z0-9_]([a-z0-9_-]{0,62}))*$")


def queen_origin(url: str) -> str:
    """The origin a queen URL names, the one string both sides sign and check.

    ``ws`` becomes ``http`` and ``wss`` ``https`` (a queen serves its websocket and its HTTP
    routes on one origin); the host is lower-cased (IDNA-encoded if it is not ASCII, IPv6 in
    brackets in its compressed form); the scheme's default port (80, 443) is dropped; user
    info, path, query and fragment are dropped. ``wss://Queen.Example:443/worker`` ->
    ``https://queen.example``. Raises ``InvalidQueenUrl`` (a ``ValueError``) for anything else.
    """
    if not isinstance(url, str) or not url.strip():
        raise InvalidQueenUrl("the queen URL is empty")
    text = url.strip()
    if any(ord(c) < 0x21 or c == "\x7f" for c in text):
        raise InvalidQueenUrl(f"the queen URL {text[:200]!r} holds spaces or control characters")
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError as exc:
        raise InvalidQueenUrl(f"the queen URL {text[:200]!r} is not a URL: {exc}") from exc
    scheme = _SCHEMES.get(parts.scheme.lower())
    if scheme is None:
        raise InvalidQueenUrl(f"the queen URL {text[:200]!r} must start with ws://, wss://, "
                              "http:// or https://")
    host = _origin_host(parts.hostname or "", text)
    if port == 0:
        raise InvalidQueenUrl(f"the queen URL {text[:200]!r} has port 0")
    if port is None or port == _DEFAULT_PORTS[scheme]:
        return f"{scheme}://{host}"
    return f"{scheme}://{host}:{port}"


def _origin_host(host: str, url: str) -> str:
    """``urlsplit``'s host (lower-cased, brackets gone) as an origin writes it, or
    ``InvalidQueenUrl``."""
    if not host:
        raise InvalidQueenUrl(f"the queen URL {url[:200]!r} names no host")
    if ":" in host:
        try:
            return f"[{ipaddress.IPv6Address(host).compressed}]"
        except ValueError as exc:
            raise InvalidQueenUrl(f"the queen URL {url[:200]!r} has a bad IPv6 address") from exc
    host = host.removesuffix(".")
    if not host.isascii():
        try:
            host = host.encode("idna").decode("ascii")
        except UnicodeError as exc:
            raise InvalidQueenUrl(f"the queen URL {url[:200]!r} has a host name that IDNA "
                                  f"cannot encode: {exc}") from exc
    if len(host) > 253 or not _HOST_NAME.match(host):
        raise InvalidQueenUrl(f"the queen URL {url[:200]!r} has a host name with characters no "
                              "host name may hold")
    return host


def _checked_origin(origin: str) -> bytes:
    """An origin as it goes into a signed payload: it must already be ``queen_origin``'s
    form, so no two spellings of one queen ever sign differently."""
    if queen_origin(origin) != origin:
        raise InvalidQueenUrl(f"{origin[:200]!r} is not a normalised origin; pass it through "
                              "queen_origin() first")
    return origin.encode()


def hello_signing_payload(nonce: str, pubkey: str, ln_url: str | None, origin: str) -> bytes:
    """The bytes a worker signs: the queen it dialled, the queen's nonce, its own key and its
    payout address.

    ``origin`` is ``queen_origin`` of the URL the worker itself dialled (never one a queen
    tells it): a hostile queen that passes another queen's challenge to a worker gets back a
    signature for its own origin, which the other queen refuses. Signing the payout address
    means only the holder of the key can change where it is paid. The context string changed
    with the origin (``apiary-hello/2``), so no signature of the old, unbound form verifies.
    """
    # No address and an empty one sign alike: both mean "don't pay me".
    return b"\n".join([HELLO_SIGNATURE_CONTEXT, _checked_origin(origin), nonce.encode(),
                       pubkey.encode(), (ln_url or "").encode()])


EARNINGS_AUTH_SCHEME = "Apiary-Worker"
EARNINGS_AUTH_MAX_SKEW_S = 300


def earnings_auth_payload(pubkey: str, timestamp: int, origin: str) -> bytes:
    """What a worker signs to read its own earnings over HTTP: the queen's origin (as for the
    hello), its key and the current time.

    The header is ``Authorization: Apiary-Worker <pubkey>.<unix time>.<signature hex>``; the
    queen accepts a time within ``EARNINGS_AUTH_MAX_SKEW_S`` of its own, signed for one of its
    own origins (so a header sent to one queen cannot be replayed at another).
    """
    return b"\n".join([EARNINGS_SIGNATURE_CONTEXT, _checked_origin(origin), pubkey.encode(),
                       str(timestamp).encode()])


def loads_object(frame: str | bytes) -> dict[str, Any]:
    """Parse a frame that must be a JSON object (used for legacy, untyped frames)."""
    try:
        value = orjson.loads(frame)
    except orjson.JSONDecodeError as exc:
        raise ProtocolError("invalid_json", f"frame is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ProtocolError("invalid_message", "frame is not a JSON object")
    return value
