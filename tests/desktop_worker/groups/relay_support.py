"""A tiny in-test switchboard: the queen's part of a relayed route (issue 19), without a queen.

It forwards exactly what the queen forwards: a head's ``GroupOpen`` to the member it names, the
channel number unchanged; each data frame to the other end of its channel; a ``GroupClose`` to
the other end, after which the channel is forgotten. Data for a channel it does not know is
dropped. Each end is a worker's pair of handlers: ``command`` (what the link's ``on_group``
gets) and ``data`` (its ``on_relay``, awaited, so backpressure reaches the sender as it would
through two websockets)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from desktop_worker.link.machine import RelayData
from shared_schema import GroupClose, GroupOpen

Command = Callable[[Any], None]
Data = Callable[[int, bytes], Awaitable[None]]


@dataclass
class End:
    command: Command
    data: Data


@dataclass
class Switchboard:
    ends: dict[str, End] = field(default_factory=dict)
    channels: dict[int, tuple[str, str]] = field(default_factory=dict)  # -> (head, member)
    opens: list[tuple[str, GroupOpen]] = field(default_factory=list)
    closes: list[tuple[str, GroupClose]] = field(default_factory=list)
    frames: int = 0  # data frames forwarded
    largest: int = 0  # the largest payload forwarded
    up: bool = True  # False: the queen is gone, nothing is forwarded
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)

    async def wait_until(self, done: Callable[[], bool], timeout_s: float = 10.0) -> None:
        """Waits until ``done()``, checked after each frame forwarded (what changes a
        channel's state at either end)."""
        async with asyncio.timeout(timeout_s), self.changed:
            await self.changed.wait_for(done)

    def attach(self, worker: str, command: Command, data: Data) -> None:
        self.ends[worker] = End(command, data)

    def sender(self, worker: str) -> Callable[[Any], Awaitable[None]]:
        """What ``worker``'s report callable hands the queen for a relayed frame."""

        async def send(message: Any) -> None:
            await self.forward(worker, message)

        return send

    async def forward(self, sender: str, message: Any) -> None:
        try:
            await self._forward(sender, message)
        finally:
            async with self.changed:
                self.changed.notify_all()

    async def _forward(self, sender: str, message: Any) -> None:
        if not self.up:
            return
        if isinstance(message, GroupOpen):
            self.opens.append((sender, message))
            if message.member not in self.ends:
                self.ends[sender].command(GroupClose(group=message.group,
                                                     channel=message.channel,
                                                     reason="no such member"))
                return
            self.channels[message.channel] = (sender, message.member)
            self.ends[message.member].command(message)
        elif isinstance(message, GroupClose):
            self.closes.append((sender, message))
            pair = self.channels.pop(message.channel, None)
            if pair is not None and sender in pair:
                self.ends[_other(pair, sender)].command(message)
        elif isinstance(message, RelayData):
            pair = self.channels.get(message.channel)
            if pair is None or sender not in pair:
                return
            self.frames += 1
            self.largest = max(self.largest, len(message.payload))
            await self.ends[_other(pair, sender)].data(message.channel, message.payload)
        else:
            raise TypeError(f"not a relayed frame: {message!r}")


def _other(pair: tuple[str, str], sender: str) -> str:
    return pair[1] if sender == pair[0] else pair[0]
