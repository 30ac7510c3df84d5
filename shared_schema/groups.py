"""Model groups (issue 19): the frames with which the queen forms a group of workers that
serve one model together through llama.cpp's RPC backend, and the workers' answers.

The sequence (``docs/ARCHITECTURE.md``, "Model groups"):

1. To each member: ``GroupServe``. The member starts llama.cpp's RPC server on 127.0.0.1 and,
   before it, a gate that lets in only the named head with this link's one-time ``token``
   (HMAC over a fresh nonce; ``desktop_worker/groups/handshake.py``), over TLS with a throwaway
   certificate. It answers ``GroupMemberReady`` with the gate's address and the certificate's
   fingerprint, or ``GroupFailed``.
2. To the head: ``GroupLead``, naming every member's gate, fingerprint, token and layer counts.
   The head checks each path, loads the model across the members and answers ``GroupReady``
   (or ``GroupFailed``); from then on the queen routes the model's jobs to it.
3. ``GroupEnd`` from the queen to every part when the group ends (a member left or failed, the
   head left); ``GroupFailed`` from a worker whenever its part of a group cannot go on.

Two routes from the head to a member. **Direct** (``route="direct"``): the member's gate
listens on its LAN address over TLS and the head dials it. **Relayed** (``route="relayed"``,
for workers on different LANs or behind NAT): nothing listens; the member's ready and the
head's link carry no address, and the same handshake and RPC bytes go through the queen over
both workers' websockets. The head opens a *channel* (``GroupOpen``, a number it picks, naming
the member), the queen passes it on to that member only, and from then on each binary
websocket frame is ``RELAY_TAG``, the channel (4 bytes, big-endian) and up to
``MAX_RELAY_PAYLOAD`` bytes, forwarded unchanged to the other end; ``GroupClose`` from either
end (or the queen) ends a channel. The queen only relays between parts of one relayed group,
head to named member, and never reads the payload; the member's gate still checks the HMAC.

A member lets its head allocate at most ``GroupServe.share_mb`` per device (issue 34: its gate
validates every RPC command and counts every buffer, ``desktop_worker/groups/rpc_guard.py``);
a queen that sends no share (older than issue 34) leaves the member its own budget, the memory
it told the queen. A member whose gate refused a head's command ends its part with
``GroupFailed(code="head_protocol")``, and the queen blames that group's head.

Every figure here is a claim or an instruction: a member's address must be a private, loopback
or link-local IP literal on an unprivileged port (a member cannot make a head dial the wider
internet or a well-known service on its LAN), and every count is bounded.
"""

from __future__ import annotations

import ipaddress
from typing import Literal

from pydantic import Field, field_validator, model_validator

from shared_schema.base import WireModel
from shared_schema.errors import ProtocolError

__all__ = [
    "GROUP_FAILURES",
    "MAX_GROUP_LAYERS",
    "MAX_GROUP_MEMBERS",
    "MAX_MEMBER_DEVICES",
    "MAX_RELAY_CHANNEL",
    "MAX_RELAY_PAYLOAD",
    "MAX_SHARE_MB",
    "RELAY_TAG",
    "GroupClose",
    "GroupEnd",
    "GroupFailed",
    "GroupLead",
    "GroupLink",
    "GroupMemberReady",
    "GroupOpen",
    "GroupReady",
    "GroupServe",
    "parse_relay_frame",
    "relay_frame",
]

MAX_GROUP_MEMBERS = 8  # the head included
MAX_GROUP_LAYERS = 4096  # per device; no GGUF has more blocks
MAX_MEMBER_DEVICES = 16  # a worker's devices in one group (``Hello.device_free_mb`` too)
MAX_SHARE_MB = 1 << 24  # one device's share, 16 TiB (``hardware.MAX_VRAM_MB``)

GROUP_ID = r"^[0-9a-f]{16,64}$"
LINK_TOKEN = r"^[0-9a-f]{64}$"
FINGERPRINT = r"^[0-9a-f]{64}$"
WORKER_ID = r"^[0-9A-Za-z_-]{1,64}$"

Route = Literal["direct", "relayed"]
RELAY_TAG = 0x01  # the first byte of a relayed data frame (a JSON text frame never is)
RELAY_HEADER = 5  # the tag and the channel
MAX_RELAY_CHANNEL = (1 << 31) - 1
MAX_RELAY_PAYLOAD = 256 * 1024

# Why a worker's part of a group cannot start or go on. ``not_allowed``: its owner does not let
# it join groups; ``unavailable``: its llama.cpp has no RPC backend; ``busy``: it is already in
# a group; ``paused``: its owner paused it; ``model_missing``: the head does not hold the file
# named; ``link_failed``: the head could not reach or authenticate to a member; ``load_failed``:
# llama.cpp could not load the model across the members; ``server_failed``: a member's RPC server
# or gate did not start, or died past its restarts; ``lost``: the group broke while serving;
# ``head_protocol``: a member's gate refused an RPC command of the head (past the share, out of
# bounds, a forbidden op, ...): the queen blames the head.
GROUP_FAILURES = frozenset({"not_allowed", "unavailable", "busy", "paused", "model_missing",
                            "link_failed", "load_failed", "server_failed", "lost", "bad_plan",
                            "head_protocol"})


def _lan_address(value: str | None) -> str | None:
    if value is None:
        return None  # a relayed route: no address
    try:
        address = ipaddress.ip_address(value)
    except ValueError as exc:
        raise ValueError("a member's gate address must be an IP address literal") from exc
    if not (address.is_private or address.is_loopback or address.is_link_local):
        raise ValueError("a member's gate address must be private, loopback or link-local")
    if address.is_unspecified or address.is_multicast:
        raise ValueError("a member's gate address cannot be unspecified or multicast")
    return address.compressed


def _layer_counts(value: list[int]) -> list[int]:
    if any(n < 0 or n > MAX_GROUP_LAYERS for n in value):
        raise ValueError(f"each device holds 0 to {MAX_GROUP_LAYERS} layers")
    return value


def _one_route(model: GroupMemberReady | GroupLink) -> None:
    """A gate's address, port and fingerprint come together (direct) or not at all (relayed)."""
    given = [model.host is not None, model.port is not None, model.fingerprint is not None]
    if any(given) and not all(given):
        raise ValueError("host, port and fingerprint come together (a direct route) or are all "
                         "left out (a relayed route)")


class GroupServe(WireModel):
    """Queen to member: serve your devices to this group's head, behind a gate."""

    type: Literal["group_serve"] = "group_serve"
    group: str = Field(pattern=GROUP_ID)
    head: str = Field(pattern=WORKER_ID, description="The head's public worker id: the only "
                      "peer the gate lets in.")
    token: str = Field(pattern=LINK_TOKEN, description="This link's one-time secret (hex).")
    devices: int = Field(default=1, ge=1, le=MAX_MEMBER_DEVICES,
                         description="How many of its devices to serve (its first ones).")
    layers: int = Field(ge=1, le=MAX_GROUP_LAYERS * MAX_MEMBER_DEVICES,
                        description="The layers it will hold (for its log and its owner).")
    model: str = Field(min_length=1, max_length=400, description="The model, for its log.")
    route: Route = Field(default="direct", description="``direct``: a TLS gate on the LAN; "
                         "``relayed``: no listener, the head's bytes come through the queen.")
    share_mb: list[int] | None = Field(
        default=None, min_length=1, max_length=MAX_MEMBER_DEVICES,
        description="The most the head may allocate on each served device, MB (its layers, "
        "their KV cache and the compute headroom the queen planned); the gate refuses an "
        "allocation past it. Absent (an older queen): the member's own budget.")

    @field_validator("share_mb")
    @classmethod
    def _shares(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and any(not 0 <= mb <= MAX_SHARE_MB for mb in value):
            raise ValueError(f"each device's share is 0 to {MAX_SHARE_MB} MB")
        return value

    @model_validator(mode="after")
    def _one_share_per_device(self) -> GroupServe:
        if self.share_mb is not None and len(self.share_mb) != self.devices:
            raise ValueError(f"one share per served device ({self.devices}), not "
                             f"{len(self.share_mb)}")
        return self


class GroupMemberReady(WireModel):
    """Member to queen: the gate listens here, with this certificate (a direct route), or
    ready for relayed channels (no address)."""

    type: Literal["group_member_ready"] = "group_member_ready"
    group: str = Field(pattern=GROUP_ID)
    host: str | None = Field(default=None, max_length=64)
    port: int | None = Field(default=None, ge=1024, le=65535)
    fingerprint: str | None = Field(default=None, pattern=FINGERPRINT, description="SHA-256 of "
                                    "the gate's certificate (DER), hex: the head pins it.")

    _lan_host = field_validator("host")(_lan_address)

    @property
    def relayed(self) -> bool:
        return self.host is None

    @model_validator(mode="after")
    def _route(self) -> GroupMemberReady:
        _one_route(self)
        return self


class GroupLink(WireModel):
    """One member as the head is told it."""

    worker_id: str = Field(pattern=WORKER_ID)
    host: str | None = Field(default=None, max_length=64)
    port: int | None = Field(default=None, ge=1024, le=65535)
    fingerprint: str | None = Field(default=None, pattern=FINGERPRINT)
    token: str = Field(pattern=LINK_TOKEN)
    device_layers: list[int] = Field(min_length=1, max_length=MAX_MEMBER_DEVICES)

    _lan_host = field_validator("host")(_lan_address)
    _layers = field_validator("device_layers")(_layer_counts)

    @property
    def relayed(self) -> bool:
        """No address: the head reaches this member through the queen."""
        return self.host is None

    @model_validator(mode="after")
    def _route(self) -> GroupLink:
        _one_route(self)
        return self


class GroupLead(WireModel):
    """Queen to head: load ``model`` across these members, with these layer counts."""

    type: Literal["group_lead"] = "group_lead"
    group: str = Field(pattern=GROUP_ID)
    head: str = Field(pattern=WORKER_ID, description="The name the head gives at each gate (its "
                      "public worker id, as each member was told).")
    model: str = Field(min_length=1, max_length=400)
    sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$",
                               description="The file the queen pinned; the head must hold it.")
    n_ctx: int = Field(ge=16, le=1 << 20)
    head_layers: list[int] = Field(min_length=1, max_length=MAX_MEMBER_DEVICES,
                                   description="The head's own layers per device (a RAM-only "
                                   "head: one entry, its CPU layers).")
    members: list[GroupLink] = Field(min_length=1, max_length=MAX_GROUP_MEMBERS - 1)

    _layers = field_validator("head_layers")(_layer_counts)


class GroupReady(WireModel):
    """Head to queen: the model is loaded across the members; send its jobs."""

    type: Literal["group_ready"] = "group_ready"
    group: str = Field(pattern=GROUP_ID)
    load_s: float = Field(ge=0, le=86_400)


class GroupEnd(WireModel):
    """Queen to any part: the group is over; stop what you run for it."""

    type: Literal["group_end"] = "group_end"
    group: str = Field(pattern=GROUP_ID)
    reason: str = Field(default="", max_length=400)


class GroupFailed(WireModel):
    """Worker to queen: its part of the group could not start, or cannot go on."""

    type: Literal["group_failed"] = "group_failed"
    group: str = Field(pattern=GROUP_ID)
    code: str = Field(min_length=1, max_length=64)
    message: str = Field(default="", max_length=2000)
    member: str | None = Field(
        default=None, pattern=WORKER_ID,
        description="From the head: the member (public id) whose RPC server could not "
        "allocate the layers it was given, so claimed more memory than it has. The queen "
        "leaves that member out of groups for a while rather than the head; from anyone "
        "else it is ignored.")


class GroupOpen(WireModel):
    """Head to queen, then queen to that member: open relayed channel ``channel`` (a number the
    head picks, unique among its open ones) to ``member`` (its public worker id)."""

    type: Literal["group_open"] = "group_open"
    group: str = Field(pattern=GROUP_ID)
    channel: int = Field(ge=1, le=MAX_RELAY_CHANNEL)
    member: str = Field(pattern=WORKER_ID)


class GroupClose(WireModel):
    """Either end (or the queen) to the other: relayed channel ``channel`` is closed."""

    type: Literal["group_close"] = "group_close"
    group: str = Field(pattern=GROUP_ID)
    channel: int = Field(ge=1, le=MAX_RELAY_CHANNEL)
    reason: str = Field(default="", max_length=200)


def relay_frame(channel: int, payload: bytes) -> bytes:
    """A relayed data frame (binary): ``RELAY_TAG``, the channel, the payload."""
    if not 1 <= channel <= MAX_RELAY_CHANNEL:
        raise ValueError(f"a relay channel is 1 to {MAX_RELAY_CHANNEL} (got {channel})")
    if not 1 <= len(payload) <= MAX_RELAY_PAYLOAD:
        raise ValueError(f"a relayed payload is 1 to {MAX_RELAY_PAYLOAD} bytes "
                         f"(got {len(payload)})")
    return bytes((RELAY_TAG,)) + channel.to_bytes(4, "big") + payload


def parse_relay_frame(frame: bytes) -> tuple[int, memoryview]:
    """The channel and payload of a relayed data frame, without copying the payload; a frame
    that is not one (another tag, a bad channel, no payload or too much) is a ``ProtocolError``
    ``bad_relay_frame``."""
    if len(frame) <= RELAY_HEADER or frame[0] != RELAY_TAG:
        raise ProtocolError("bad_relay_frame", "a binary frame must be a relayed data frame "
                            f"(tag {RELAY_TAG}, a channel, 1 or more payload bytes)")
    if len(frame) - RELAY_HEADER > MAX_RELAY_PAYLOAD:
        raise ProtocolError("bad_relay_frame", f"a relayed payload is at most "
                            f"{MAX_RELAY_PAYLOAD} bytes")
    channel = int.from_bytes(frame[1:RELAY_HEADER], "big")
    if not 1 <= channel <= MAX_RELAY_CHANNEL:
        raise ProtocolError("bad_relay_frame", f"a relay channel is 1 to {MAX_RELAY_CHANNEL}")
    return channel, memoryview(frame)[RELAY_HEADER:]
