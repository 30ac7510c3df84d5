"""The LAN hint a worker sends in its hello (issue 19): a hash of the local network it reaches
the queen through, never the network itself.

Two workers on one LAN reach the queen from the same network (say 192.168.1.0/24) and, behind
one NAT, from the same public address. The queen joins the hint to the address it sees
(``Worker.lan``), so a worker cannot claim another household's LAN by copying its hint.
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import socket
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import psutil

log = logging.getLogger(__name__)

Interfaces = Callable[[], Mapping[str, Sequence[Any]]]


def local_address(queen_host: str) -> str | None:
    """The local address this machine reaches ``queen_host`` from (a UDP "connect" sends
    nothing; it only asks the routing table)."""
    try:
        infos = socket.getaddrinfo(queen_host, 9, type=socket.SOCK_DGRAM)
    except (OSError, UnicodeError):
        return None
    for family, kind, proto, _, address in infos:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.connect(address)
                return str(probe.getsockname()[0])
        except OSError:
            continue
    return None


def network_of(address: str, interfaces: Interfaces = psutil.net_if_addrs) -> str | None:
    """The network (``192.168.1.0/24``) of the interface holding ``address``."""
    for entries in interfaces().values():
        for entry in entries:
            if entry.address == address and entry.netmask:
                try:
                    return str(ipaddress.ip_network(f"{address}/{entry.netmask}", strict=False))
                except ValueError:
                    return None
    return None


def lan_hint(queen_host: str, interfaces: Interfaces = psutil.net_if_addrs) -> str | None:
    """32 hex digits naming the local network towards ``queen_host``; None when unknown."""
    address = local_address(queen_host)
    network = network_of(address, interfaces) if address else None
    if network is None:
        return None
    return hashlib.sha256(f"apiary-lan-hint|{network}".encode()).hexdigest()[:32]
