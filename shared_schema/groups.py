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

Every figure here is a claim or an instruction: a member's address must be a private, loopback
or link-local IP literal on an unprivileged port (a member cannot make a head dial the wider
internet or a well-known service on its LAN), and every count is bounded.
"""

from __future__ import annotations

import ipaddress
from typing import Literal

from pydantic import Field, field_validator

from shared_schema.base import WireModel

__all__ = [
    "GROUP_FAILURES",
    "MAX_GROUP_LAYERS",
    "MAX_GROUP_MEMBERS",
    "GroupEnd",
    "GroupFailed",
    "GroupLead",
    "GroupLink",
    "GroupMemberReady",
    "GroupReady",
    "GroupServe",
]

MAX_GROUP_MEMBERS = 8  # the head included
MAX_GROUP_LAYERS = 4096  # per device; no GGUF has more blocks
MAX_MEMBER_DEVICES = 16

GROUP_ID = r"^[0-9a-f]{16,64}$"
LINK_TOKEN = r"^[0-9a-f]{64}$"
FINGERPRINT = r"^[0-9a-f]{64}$"
WORKER_ID = r"^[0-9A-Za-z_-]{1,64}$"

# Why a worker's part of a group cannot start or go on. ``not_allowed``: its owner does not let
# it join groups; ``unavailable``: its llama.cpp has no RPC backend; ``busy``: it is already in
# a group; ``paused``: its owner paused it; ``model_missing``: the head does not hold the file
# named; ``link_failed``: the head could not reach or authenticate to a member; ``load_failed``:
# llama.cpp could not load the model across the members; ``server_failed``: a member's RPC server
# or gate did not start, or died past its restarts; ``lost``: the group broke while serving.
GROUP_FAILURES = frozenset({"not_allowed", "unavailable", "busy", "paused", "model_missing",
                            "link_failed", "load_failed", "server_failed", "lost", "bad_plan"})


def _lan_address(value: str) -> str:
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


class GroupMemberReady(WireModel):
    """Member to queen: the gate listens here, with this certificate."""

    type: Literal["group_member_ready"] = "group_member_ready"
    group: str = Field(pattern=GROUP_ID)
    host: str = Field(max_length=64)
    port: int = Field(ge=1024, le=65535)
    fingerprint: str = Field(pattern=FINGERPRINT, description="SHA-256 of the gate's "
                             "certificate (DER), hex: the head pins it.")

    _lan_host = field_validator("host")(_lan_address)


class GroupLink(WireModel):
    """One member as the head is told it."""

    worker_id: str = Field(pattern=WORKER_ID)
    host: str = Field(max_length=64)
    port: int = Field(ge=1024, le=65535)
    fingerprint: str = Field(pattern=FINGERPRINT)
    token: str = Field(pattern=LINK_TOKEN)
    device_layers: list[int] = Field(min_length=1, max_length=MAX_MEMBER_DEVICES)

    _lan_host = field_validator("host")(_lan_address)
    _layers = field_validator("device_layers")(_layer_counts)


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
