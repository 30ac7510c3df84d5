"""Deciding a take-back (``billing.takeback``, pure): who gives back what, out of which account."""

from __future__ import annotations

from queen_server.billing import ledger, takeback

W, V = "aa" * 32, "bb" * 32


def test_a_worker_gives_from_pending_then_available_then_owes_the_rest():
    balances = {ledger.worker_pending(W): 30, ledger.worker_available(W): 50}
    takes = takeback.takes({W: 100, takeback.QUEEN: 25}, balances)
    assert takes == [(ledger.QUEEN_FEES, 25), (ledger.worker_pending(W), 30),
                     (ledger.worker_available(W), 50), (ledger.worker_debt(W), 20)]
    posting = ledger.refund("j", 1, 125, takes)
    assert dict(posting.entries)[ledger.worker_debt(W)] == -20  # owed: below zero
    assert takeback.takes({W: 10}, balances) == [(ledger.worker_pending(W), 10)]


def test_a_cut_is_split_by_what_each_still_holds_and_never_more():
    assert takeback.split(150, {takeback.QUEEN: 60, W: 240}) == {takeback.QUEEN: 30, W: 120}
    assert sum(takeback.split(7, {takeback.QUEEN: 1, W: 2, V: 4}).values()) == 7
    assert takeback.split(1_000, {W: 40}) == {W: 40}
    assert takeback.split(0, {W: 40}) == {}


def test_what_is_outstanding_after_a_rebill():
    settled = ledger.settle(1, 500, 300, "j", [(ledger.worker_available(W), 240)]).entries
    assert takeback.settled_key(settled) == 1
    rebill = ledger.refund("j", 1, 150, [(ledger.QUEEN_FEES, 30),
                                          (ledger.worker_pending(W), 100),
                                          (ledger.worker_debt(W), 20)], prefix="rebill")
    assert rebill.txn == "rebill:j"
    assert takeback.outstanding(settled, rebill.entries) == {takeback.QUEEN: 30, W: 120}


def test_a_rebill_never_charges_more_than_was_paid():
    charge = ledger.JobCharge("j", 1, "t", 1_000, 2_000, 400, 30, 460)
    assert takeback.rebilled(charge, 120, 35) == 120 + 60  # completion stays as billed
    assert takeback.rebilled(charge, 10_000, 10_000) == 460
    capped = ledger.JobCharge("j", 1, "t", 1_000, 2_000, 400, 30, 300)  # the hold capped it
    assert takeback.rebilled(capped, 400, 30) == 300
    assert takeback.rebilled(charge, -5, 0) == 0


def test_a_payout_repays_the_debt_out_of_available_and_is_guarded():
    posting = ledger.payout_start(W, 100, 7, repay_msat=20)
    assert dict(posting.entries) == {ledger.worker_available(W): -120,
                                     ledger.worker_debt(W): 20, ledger.PAYOUTS_IN_FLIGHT: 100}
    assert posting.guard == ledger.worker_available(W)
    assert ledger.may_go_negative(ledger.worker_debt(W))
    assert not ledger.may_go_negative(ledger.worker_available(W))
