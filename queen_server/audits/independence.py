"""Whether two auditors are independent of each other, and when an auditor stops being one
(issue 39). Pure.

One untrusted auditor's failing verdict never fails a job: a second must agree. Two keys are
cheap, so agreeing is not enough: the two must be independent, or a Sybil pair (two keys of
one party) could fail every audit of an honest worker between them. Two workers are
independent when the queen can tell them apart on everything it sees of them itself or that
ties them to one person:

* **no owner in common**: the same payout address (where their earnings go), or the same
  family of machines (``Hello.group_family``, the owner's family code hashed with this queen's
  origin, issue 34). Both are the worker's own words: they catch a careless pair, not a
  careful one; the next two rules do not depend on what a worker says;
* **no network in common**: the address the queen saw each one's websocket come from, in the
  same /24 (IPv4) or /48 (IPv6, what one site is given); an IPv4 address mapped into IPv6
  counts as IPv4. A worker whose address the queen does not know is independent of no one;
* **not new together**: they first connected to this queen (``workers.first_seen``, kept
  across restarts) at least ``SAME_HOUR_S`` apart. A pair made for an attack usually starts
  together; keys aged apart cost the attacker hours of waiting per pair.

``why_dependent`` names the first rule a pair breaks (None: independent); ``independent`` is
its yes or no.

An auditor whose failing verdict a second opinion contradicts is *outvoted*: either it lied,
or the case sat within a rounding error of the line (two honest auditors score the same text
with the same file, so they agree except on such near ties). ``OUTVOTED_LIMIT`` outvotes make
it ineligible as an auditor, and its own answers are audited at the new-worker rate.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from datetime import UTC, datetime

# Two workers that first connected less than this apart are not independent.
SAME_HOUR_S = 3600.0
# Outvotes that end an auditor's eligibility. One or two can befall an honest auditor (a job
# whose suspicion sits at the fail line, where another machine's arithmetic tips it the other
# way); a liar that fails honest work is outvoted on each failure an independent auditor
# re-scores, so three stop it after at most three wasted second opinions. The count never
# decays: eligibility is a privilege, and an operator can ask again through the database.
OUTVOTED_LIMIT = 3
IPV4_PREFIX = 24
IPV6_PREFIX = 48


@dataclass(frozen=True, slots=True)
class AuditorFacts:
    """What independence is judged on, for one worker, as the queen saw it when it joined."""

    key: str
    address: str | None = None  # where its websocket came from (``Worker.peer_host``)
    payout: str | None = None  # its payout address (``Worker.ln_url``), as written
    family: str | None = None  # its owner's family of machines (``Worker.group_family``)
    first_seen: datetime | None = None  # when it first connected to this queen

    @property
    def network(self) -> str | None:
        """Its /24 (IPv4) or /48 (IPv6) network, or None where the address is not an IP."""
        return network_of(self.address)

    @property
    def owners(self) -> frozenset[tuple[str, str]]:
        """What ties it to an owner, as ``(what, value)``: its payout address (case and spaces
        aside) and its family of machines."""
        marks = set()
        if self.payout and self.payout.strip():
            marks.add(("payout address", self.payout.strip().lower()))
        if self.family:
            marks.add(("family of machines", self.family.lower()))
        return frozenset(marks)


def network_of(address: str | None) -> str | None:
    """The network an address belongs to for independence: ``"203.0.113.0/24"``,
    ``"2001:db8:1::/48"``; None for None, a host name, or anything else not an IP address."""
    if not address:
        return None
    try:
        ip = ipaddress.ip_address(address.strip().strip("[]").split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    prefix = IPV4_PREFIX if ip.version == 4 else IPV6_PREFIX
    return str(ipaddress.ip_network(f"{ip}/{prefix}", strict=False))


def _utc(moment: datetime) -> datetime:
    """SQLite hands timestamps back without their zone: they were written in UTC."""
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def why_dependent(a: AuditorFacts, b: AuditorFacts, *,
                  same_hour_s: float = SAME_HOUR_S) -> str | None:
    """Why ``a`` and ``b`` are not independent, in words; None when they are."""
    if a.key == b.key:
        return "the same worker"
    shared = sorted(a.owners & b.owners)
    if shared:
        return f"the same owner (the same {shared[0][0]})"
    net_a, net_b = a.network, b.network
    if net_a is None or net_b is None:
        return "the queen does not know the network of one of them"
    if net_a == net_b:
        return f"the same network ({net_a})"
    if a.first_seen is None or b.first_seen is None:
        return "the queen does not know when one of them first connected"
    apart_s = abs((_utc(a.first_seen) - _utc(b.first_seen)).total_seconds())
    if apart_s < same_hour_s:
        return f"first connected within the same hour ({apart_s / 60:.0f} minutes apart)"
    return None


def independent(a: AuditorFacts, b: AuditorFacts, *, same_hour_s: float = SAME_HOUR_S) -> bool:
    """Whether two workers' verdicts may count as two opinions (``why_dependent`` is None)."""
    return why_dependent(a, b, same_hour_s=same_hour_s) is None


def eligible_auditor(outvoted: int, *, limit: int = OUTVOTED_LIMIT) -> bool:
    """Whether a worker outvoted ``outvoted`` times may still audit others."""
    return outvoted < limit
