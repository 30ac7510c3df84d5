"""The independence rule between two auditors (issue 39), and when an auditor stops being one."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from queen_server.audits.independence import (
    OUTVOTED_LIMIT,
    AuditorFacts,
    eligible_auditor,
    independent,
    network_of,
    why_dependent,
)

NOON = datetime(2027, 1, 11, 12, 0, tzinfo=UTC)


def facts(key: str, address: str | None, *, hours: float = 0.0, payout: str | None = None,
          family: str | None = None, first_seen: datetime | None = NOON) -> AuditorFacts:
    seen = first_seen + timedelta(hours=hours) if first_seen is not None else None
    return AuditorFacts(key, address, payout, family, seen)


def test_two_workers_apart_in_owner_network_and_time_are_independent():
    a = facts("a", "198.51.100.7", payout="alice@getalby.com", family="f" * 32)
    b = facts("b", "203.0.113.9", hours=5, payout="bob@walletofsatoshi.com", family="e" * 32)
    assert why_dependent(a, b) is None
    assert independent(a, b)
    assert independent(b, a)


def test_the_same_payout_address_is_the_same_owner_whatever_its_case():
    a = facts("a", "198.51.100.7", payout="Alice@GetAlby.com")
    b = facts("b", "203.0.113.9", hours=5, payout=" alice@getalby.com ")
    assert why_dependent(a, b) == "the same owner (the same payout address)"
    assert not independent(a, b)


def test_the_same_family_of_machines_is_the_same_owner():
    a = facts("a", "198.51.100.7", family="ab" * 16)
    b = facts("b", "203.0.113.9", hours=5, family="AB" * 16)
    assert why_dependent(a, b) == "the same owner (the same family of machines)"


def test_no_payout_address_on_either_side_is_no_owner_in_common():
    a = facts("a", "198.51.100.7", payout="")
    b = facts("b", "203.0.113.9", hours=5)
    assert independent(a, b)


@pytest.mark.parametrize(("one", "other", "network"), [
    ("198.51.100.7", "198.51.100.250", "198.51.100.0/24"),
    ("2001:db8:1:2::1", "2001:db8:1:ffff::9", "2001:db8:1::/48"),
    ("::ffff:198.51.100.7", "198.51.100.8", "198.51.100.0/24"),  # mapped IPv4 is IPv4
    ("[2001:db8:1::5]", "2001:db8:1:7::5", "2001:db8:1::/48"),
])
def test_the_same_slash_24_or_slash_48_is_one_network(one, other, network):
    a, b = facts("a", one), facts("b", other, hours=5)
    assert why_dependent(a, b) == f"the same network ({network})"


@pytest.mark.parametrize(("one", "other"), [
    ("198.51.100.7", "198.51.101.7"),  # the next /24
    ("2001:db8:1::1", "2001:db8:2::1"),  # the next /48
    ("198.51.100.7", "2001:db8:1::1"),
])
def test_the_next_network_over_is_another_network(one, other):
    assert independent(facts("a", one), facts("b", other, hours=5))


@pytest.mark.parametrize("address", [None, "", "testclient", "queen.example"])
def test_an_address_that_is_no_ip_makes_a_worker_independent_of_no_one(address):
    a, b = facts("a", address), facts("b", "203.0.113.9", hours=5)
    assert network_of(address) is None
    assert why_dependent(a, b) == "the queen does not know the network of one of them"


@pytest.mark.parametrize("minutes", [0, 1, 59])
def test_first_seen_within_the_hour_is_not_independent(minutes):
    a = facts("a", "198.51.100.7")
    b = facts("b", "203.0.113.9", hours=minutes / 60)
    assert why_dependent(b, a) == (f"first connected within the same hour ({minutes} minutes "
                                   f"apart)")


def test_first_seen_across_a_clock_hour_boundary_still_counts_as_within_the_hour():
    a = facts("a", "198.51.100.7", first_seen=datetime(2027, 1, 11, 10, 59, tzinfo=UTC))
    b = facts("b", "203.0.113.9", first_seen=datetime(2027, 1, 11, 11, 1, tzinfo=UTC))
    assert not independent(a, b)


def test_first_seen_an_hour_apart_is_independent_and_a_naive_time_reads_as_utc():
    a = facts("a", "198.51.100.7")
    b = facts("b", "203.0.113.9", first_seen=(NOON + timedelta(hours=1)).replace(tzinfo=None))
    assert independent(a, b)


def test_an_unknown_first_connection_is_not_independent():
    a = facts("a", "198.51.100.7")
    b = facts("b", "203.0.113.9", first_seen=None)
    assert why_dependent(a, b) == "the queen does not know when one of them first connected"


def test_a_worker_is_not_independent_of_itself():
    a = facts("a", "198.51.100.7")
    assert why_dependent(a, a) == "the same worker"


def test_an_auditor_outvoted_up_to_the_limit_loses_its_eligibility():
    assert OUTVOTED_LIMIT == 3
    assert all(eligible_auditor(n) for n in range(OUTVOTED_LIMIT))
    assert not eligible_auditor(OUTVOTED_LIMIT)
    assert not eligible_auditor(OUTVOTED_LIMIT + 10)
