"""Model groups (issue 19) in the owner's words: what this worker does for a group right now,
and whether this build can join groups at all.

A worker serving layers for a group takes no jobs of its own, so without a word the app would
say "waiting for jobs" for as long as the group lasts and the owner would wonder why nothing
arrives. ``group_status`` reads the worker's ``GroupRoles`` (its current part and the queen's
command that made it) into a plain ``GroupStatus``; ``group_text`` and ``group_detail`` say it
("Serving 12 layers of SmolLM2 for a group", "Leading a group of 3 workers for SmolLM2").
``GroupWatch`` polls that status on the GUI thread (``GroupRoles`` has no events to listen to,
and a read of two attributes a second costs nothing) and says when it changes.

The model's name comes from the queen: it is shortened for the status line and shown only in
plain-text labels; ``tooltip_safe`` keeps it from being read as markup where a tray tooltip may
be rendered as rich text. ``groups_unavailable`` words why a build cannot join (no RPC backend in
its llama.cpp), for the Settings tab's switch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from PySide6.QtCore import QObject, QTimer, Signal

from desktop_worker.groups.rpc import RpcProbe
from shared_schema.groups import GroupLead, GroupServe

log = logging.getLogger(__name__)

MODEL_CHARS = 48  # the most of a model's name the status line shows
POLL_MS = 1000
# Markup's characters and their look-alikes: single angle quotation marks, a fullwidth "&".
_LOOKALIKES = str.maketrans({"<": "\u2039", ">": "\u203a", "&": "\uff06"})


class RolesLike(Protocol):
    """What the status reads of ``desktop_worker.groups.roles.GroupRoles``."""

    @property
    def part(self) -> Any: ...


@dataclass(frozen=True, slots=True)
class GroupStatus:
    """This worker's part in one group, as the owner is told of it."""

    group: str
    role: Literal["member", "head"]
    model: str
    ready: bool  # a member serving its layers; a head whose group answers requests
    layers: int | None = None  # a member's: how many of the model's layers it holds
    workers: int | None = None  # a head's: the group's size, itself included
    relayed: bool = False  # a member reached through the queen (not over the home network)


def group_status(roles: RolesLike | None) -> GroupStatus | None:
    """The part ``roles`` plays now, or None when it is in no group (or has ended its part)."""
    part = getattr(roles, "part", None) if roles is not None else None
    if part is None or getattr(part, "ended", False):
        return None
    command = getattr(part, "command", None)
    ready = bool(getattr(part, "ready", False))
    if isinstance(command, GroupServe):
        return GroupStatus(group=part.group, role="member", model=command.model, ready=ready,
                           layers=command.layers, relayed=command.route == "relayed")
    if isinstance(command, GroupLead):
        return GroupStatus(group=part.group, role="head", model=command.model, ready=ready,
                           workers=len(command.members) + 1)
    # A part made without its command (an older caller): say what can be said.
    model = getattr(part, "model", None) or "a large model"
    return GroupStatus(group=part.group, role=part.role, model=model, ready=ready)


def short_model(name: str, limit: int = MODEL_CHARS) -> str:
    """A model's name for one line: whitespace folded, at most ``limit`` characters."""
    folded = " ".join(name.split()) or "a model"
    return folded if len(folded) <= limit else folded[: limit - 1].rstrip() + "…"


def tooltip_safe(text: str) -> str:
    """``text`` with the characters markup is made of replaced by look-alikes, for a tray
    tooltip: some platforms render a tooltip that looks like HTML as HTML (and others never
    unescape entities), so neither escaping nor leaving it works everywhere. A real model name
    holds none of these characters."""
    return text.translate(_LOOKALIKES)


def group_text(status: GroupStatus, *, working: bool = False) -> str:
    """The status line while this worker is in a group."""
    model = short_model(status.model)
    if status.role == "member":
        if not status.ready:
            return f"Joining a group for {model}…"
        layers = status.layers
        what = f"{layers} layer{'s' if layers != 1 else ''}" if layers else "part"
        return f"Serving {what} of {model} for a group"
    size = f"a group of {status.workers} workers" if status.workers else "a group"
    if not status.ready:
        return f"Setting up {size} for {model}…"
    text = f"Leading {size} for {model}"
    return f"{text}: serving a job" if working else text


def group_detail(status: GroupStatus) -> str:
    """The line under the status: why no jobs of its own arrive, or how the group serves."""
    if status.role == "member":
        return ("While it does, this computer takes no requests of its own; you are paid for "
                "the share of the model it holds.")
    return "Requests for this model run across the group's computers, led by this one."


def groups_unavailable(probe: RpcProbe | None) -> str | None:
    """Why this build cannot join groups (for the Settings switch), or None when it can or
    when it is not known yet."""
    if probe is None or probe.available:
        return None
    reason = probe.reason.strip()
    return "This build cannot join groups" + (f" ({reason})." if reason else ".")


class GroupWatch(QObject):
    """Polls ``read`` every ``interval_ms`` while started; ``changed`` carries the new
    ``GroupStatus`` (or None) each time it differs from the last. Widget-free."""

    changed = Signal(object)  # GroupStatus | None

    def __init__(self, read: Callable[[], GroupStatus | None], *, interval_ms: int = POLL_MS,
                 parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.read = read
        self.status: GroupStatus | None = None
        self.timer = QTimer(self)
        self.timer.setInterval(interval_ms)
        self.timer.timeout.connect(self.poll)

    def start(self) -> None:
        self.timer.start()
        self.poll()

    def stop(self) -> None:
        """Stop polling; the worker is in no group any more."""
        self.timer.stop()
        self._set(None)

    def poll(self) -> None:
        try:
            status = self.read()
        except Exception:  # the status line must never take the app down
            log.exception("could not read the worker's group state")
            return
        self._set(status)

    def _set(self, status: GroupStatus | None) -> None:
        if status != self.status:
            self.status = status
            if status is None:
                log.info("this worker is in no group now")
            else:
                log.info("group %s: this worker's part: %s", status.group, group_text(status))
            self.changed.emit(status)
