"""When the tray notifies: the pure policy, with a fake clock."""

from __future__ import annotations

from datetime import UTC, datetime

from desktop_worker.gui.notify import NotificationPolicy
from shared_schema import PayoutView


def payout(id_: int, state: str, sats: int = 100) -> PayoutView:
    return PayoutView(id=id_, amount_msat=sats * 1000, state=state, updated_at=datetime.now(UTC))


def test_the_first_job_served_is_announced_once():
    policy = NotificationPolicy()
    assert policy.job_finished("engine_error") is None
    first = policy.job_finished("ok")
    assert first is not None
    assert first.title == "First job served"
    assert policy.job_finished("ok") is None


def test_no_first_job_notice_for_a_worker_the_queen_already_paid():
    policy = NotificationPolicy()
    policy.already_served(jobs_settled=12)
    assert policy.job_finished("ok") is None


def test_a_payout_is_announced_when_it_becomes_paid():
    policy = NotificationPolicy()
    assert policy.payouts([payout(1, "paid")]) == []  # the first look only takes note
    assert policy.payouts([payout(1, "paid"), payout(2, "invoiced")]) == []
    [notice] = policy.payouts([payout(1, "paid"), payout(2, "paid", sats=2500)])
    assert notice.title == "Payout sent"
    assert "2,500 sats" in notice.message
    assert policy.payouts([payout(1, "paid"), payout(2, "paid")]) == []


def test_disconnected_for_over_a_minute_is_told_once_per_outage():
    policy = NotificationPolicy(disconnect_after_s=60)
    assert policy.link("connecting", 0) is None
    assert policy.tick(100) is None  # never connected yet: that is not an outage
    assert policy.link("connected", 100) is None
    assert policy.link("disconnected", 200) is None
    assert policy.link("connecting", 201) is None
    assert policy.tick(259) is None
    notice = policy.tick(261)
    assert notice is not None
    assert notice.title == "Disconnected"
    assert notice.level == "warning"
    assert "1 minute" in notice.message
    assert policy.tick(400) is None
    back = policy.link("connected", 410)
    assert back is not None
    assert back.title == "Reconnected"
    # A short blip is not worth a notice.
    assert policy.link("disconnected", 500) is None
    assert policy.link("connected", 530) is None
    assert policy.tick(600) is None


def test_stopping_is_not_an_outage():
    policy = NotificationPolicy(disconnect_after_s=60)
    policy.link("connected", 0)
    policy.link("disconnected", 10)
    policy.link("stopped", 11)
    assert policy.tick(1000) is None


def test_errors_always_reach_the_owner():
    notice = NotificationPolicy().error("the queen refused this worker: bad key")
    assert notice.level == "error"
    assert "refused" in notice.message


def test_on_a_queen_that_does_not_pay_the_first_job_promises_nothing():
    policy = NotificationPolicy()
    policy.queen_pays(False)
    notice = policy.job_finished("ok")
    assert notice is not None
    assert "does not pay" in notice.message
    assert "Earnings show" not in notice.message


def test_an_older_queen_that_does_not_say_keeps_the_usual_first_job_notice():
    policy = NotificationPolicy()
    policy.queen_pays(None)
    assert "Earnings show in the Earnings tab" in policy.job_finished("ok").message


def test_sats_waiting_without_a_payout_address_are_told_once():
    policy = NotificationPolicy()
    assert policy.sats_waiting(0, has_payout_address=False) is None  # nothing owed yet
    assert policy.sats_waiting(5_000, has_payout_address=True) is None
    notice = policy.sats_waiting(8, has_payout_address=False)
    assert notice is not None
    assert notice.level == "warning"
    assert "0.008 sats" in notice.message
    assert "payout address" in notice.message
    assert policy.sats_waiting(9_000, has_payout_address=False) is None  # once per app run


def test_no_payout_address_nudge_on_a_queen_that_does_not_pay():
    policy = NotificationPolicy()
    policy.queen_pays(False)
    assert policy.sats_waiting(5_000, has_payout_address=False) is None
