"""The relayed route of model groups (issue 19): the queen as a switchboard between a group's
head and its members when they cannot reach each other (different LANs, NAT, or an owner who
keeps ``lan_groups`` off), over the websockets both already hold to the queen.

The head opens a *channel* per connection llama.cpp makes to a member (``GroupOpen``: a number
it picks, the member's public id); ``GroupService.on_channel`` checks the head may, and this
table records both ends. From then on each binary frame a worker sends on that channel
(``shared_schema.groups.relay_frame``: a tag, the channel, the payload) is forwarded unchanged
to the other end; the queen reads only the five header bytes. ``GroupClose`` from either end
drops the channel and is passed on; a group that ends drops all of its channels (its parts are
told ``GroupEnd``, which closes theirs).

Per frame the work is one dictionary lookup and one send, whatever the number of workers or
groups. The sender's read loop awaits the send, so a slow receiver pushes back on the sender's
websocket (and through it on the sending worker) rather than growing a buffer here. A data
frame for no open channel (one that crossed a close, or a stray) is dropped and counted.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

from queen_server.swarm.registry import Registry
from queen_server.swarm.worker import Worker
from shared_schema import GroupClose, encode

__all__ = ["Channel", "GroupRelay", "RelayUsage"]

log = logging.getLogger(__name__)

HEADER = 5  # the relayed frame's tag and channel: not payload


@dataclass(eq=False)
class Channel:
    """One relayed connection between a group's head and one member."""

    group: str
    number: int
    head: Worker
    member: Worker
    bytes_to_member: int = 0
    bytes_to_head: int = 0


@dataclass(frozen=True)
class RelayUsage:
    """What a group's relayed channels carried (closed ones included)."""

    channels: int = 0  # open now
    opened: int = 0
    bytes_to_members: int = 0
    bytes_to_head: int = 0


class GroupRelay:
    """The open channels of every relayed group on this queen, keyed by each end."""

    def __init__(self, registry: Registry, *, max_channels: int = 8) -> None:
        """``max_channels``: the most channels open at once from a head to one member
        (llama.cpp opens one or two per server; the bound stops a head from making the queen
        keep a table without end)."""
        self.registry = registry
        self.max_channels = max_channels
        self._ends: dict[tuple[str, int], Channel] = {}  # (worker key, number) -> channel
        self._groups: dict[str, dict[int, Channel]] = {}
        self._usage: dict[str, RelayUsage] = {}
        self.dropped = 0  # data frames for no open channel

    # --- the table ------------------------------------------------------------------------

    def open(self, group: str, head: Worker, member: Worker, number: int) -> str | None:
        """Record channel ``number`` from ``head`` to ``member`` in ``group``; or say why not."""
        channels = self._groups.setdefault(group, {})
        if number in channels or (head.key, number) in self._ends:
            return f"channel {number} is already open"
        if (member.key, number) in self._ends:
            return f"channel {number} is already open at the member"
        if sum(1 for c in channels.values() if c.member is member) >= self.max_channels:
            return f"at most {self.max_channels} channels to one member are open at once"
        channel = Channel(group, number, head, member)
        channels[number] = channel
        self._ends[(head.key, number)] = channel
        self._ends[(member.key, number)] = channel
        usage = self._usage.get(group, RelayUsage())
        self._usage[group] = RelayUsage(usage.channels + 1, usage.opened + 1,
                                        usage.bytes_to_members, usage.bytes_to_head)
        return None

    def close(self, worker: Worker, number: int) -> Channel | None:
        """Drop the channel ``worker`` is an end of; None if it has no such channel."""
        channel = self._ends.get((worker.key, number))
        if channel is None or worker not in (channel.head, channel.member):
            return None
        self._drop(channel)
        return channel

    def end_group(self, group: str) -> None:
        """The group ended: every channel of it goes (its parts close their own ends)."""
        for channel in list(self._groups.pop(group, {}).values()):
            self._drop(channel)
        self._usage.pop(group, None)

    def usage(self, group: str) -> RelayUsage:
        """What ``group``'s channels carried: the closed ones' totals plus the open ones' bytes
        so far (a few channels per member: the work does not grow with the swarm)."""
        usage = self._usage.get(group, RelayUsage())
        live = self._groups.get(group, {}).values()
        return RelayUsage(usage.channels, usage.opened,
                          usage.bytes_to_members + sum(c.bytes_to_member for c in live),
                          usage.bytes_to_head + sum(c.bytes_to_head for c in live))

    def _drop(self, channel: Channel) -> None:
        for key in (channel.head.key, channel.member.key):
            if self._ends.get((key, channel.number)) is channel:
                del self._ends[(key, channel.number)]
        channels = self._groups.get(channel.group)
        if channels is not None and channels.get(channel.number) is channel:
            del channels[channel.number]
        usage = self._usage.get(channel.group)
        if usage is not None:
            self._usage[channel.group] = RelayUsage(
                usage.channels - 1, usage.opened,
                usage.bytes_to_members + channel.bytes_to_member,
                usage.bytes_to_head + channel.bytes_to_head)

    # --- the traffic ----------------------------------------------------------------------

    async def forward(self, worker: Worker, number: int, frame: bytes) -> bool:
        """Send ``frame`` to the other end of ``worker``'s channel ``number``. False when the
        worker has no such channel (the frame is dropped). A receiver that cannot be sent to
        loses the channel, and the sender is told ``GroupClose``."""
        channel = self._ends.get((worker.key, number))
        if channel is None:
            self.dropped += 1
            log.debug("dropped a relayed frame from %s on channel %d: not open",
                      worker.public_id, number)
            return False
        to_member = worker is channel.head
        peer = channel.member if to_member else channel.head
        connection = self.registry.connection(peer.key)
        try:
            if connection is None:
                raise ConnectionError("not connected")
            await connection.send_bytes(frame)
        except Exception as exc:  # the receiver is gone: its own cleanup ends the group
            log.info("group %s: channel %d to %s failed (%s)", channel.group, number,
                     peer.public_id, exc)
            self._drop(channel)
            await self.tell(worker, GroupClose(group=channel.group, channel=number,
                                               reason=f"{peer.public_id} cannot be reached"))
            return True
        if to_member:
            channel.bytes_to_member += len(frame) - HEADER
        else:
            channel.bytes_to_head += len(frame) - HEADER
        return True

    async def tell(self, worker: Worker, message: GroupClose) -> None:
        """A frame to ``worker`` if it is still connected (a failure is its cleanup's)."""
        connection = self.registry.connection(worker.key)
        if connection is not None:
            with contextlib.suppress(Exception):
                await connection.send_frame(encode(message))
