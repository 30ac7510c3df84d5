"""Double-entry postings and the accounts they move money between. Pure: no I/O.

Accounts (all in msat):

* ``deposits``                 where developers' money comes from (goes negative as it comes in)
* ``key:<id>:available``       a key's spendable balance
* ``key:<id>:reserved``        held for requests in flight
* ``worker:<pubkey>:pending``  a worker's earnings held in escrow
* ``worker:<pubkey>:available`` a worker's earnings that can be paid out
* ``queen:fees``               the queen's share of every charge
* ``payouts:in_flight``        payouts recorded but not yet known paid or failed
* ``worker:<pubkey>:paid``     what has been paid out to a worker (money that left)
* ``worker:<pubkey>:debt``     what a worker owes (at or below zero): a refund took back more
                               than it still held, because a payout had already sent it. Its
                               next payout repays it first

A refund or a rebill (an audit's exact counts) takes a job's charge back from where it went; a
payout reserves a worker's earnings. Each is one guarded step: its amounts are decided from
balances read under the accounts' locks (``LedgerStore.post_locked``), so whichever runs second
sees the other's effect.

A posting's amounts always sum to zero; its ``txn`` id is its idempotency key. ``worker_jobs``
counts settled jobs per worker, written in the same database transaction as the entries.
``guard`` names an account the posting may not take below zero: the store applies that entry as a
conditional update and refuses the whole posting when the balance cannot cover it (a reservation
from a key's ``available``, which several queen replicas may spend from at once).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

DEPOSITS = "deposits"
QUEEN_FEES = "queen:fees"
PAYOUTS_IN_FLIGHT = "payouts:in_flight"
DEBT_SUFFIX = ":debt"


def key_available(key_id: int) -> str:
    return f"key:{key_id}:available"


def key_reserved(key_id: int) -> str:
    return f"key:{key_id}:reserved"


def worker_pending(pubkey: str) -> str:
    return f"worker:{pubkey}:pending"


def worker_available(pubkey: str) -> str:
    return f"worker:{pubkey}:available"


def worker_debt(pubkey: str) -> str:
    return f"worker:{pubkey}{DEBT_SUFFIX}"


def may_go_negative(account: str) -> bool:
    """The deposit source, and workers' debts (what they owe is below zero)."""
    return account == DEPOSITS or account.endswith(DEBT_SUFFIX)


@dataclass(frozen=True, slots=True)
class JobCharge:
    """What a settled job was billed: its usage and the rates it was priced at, kept beside the
    posting so that an audit's exact counts can re-price it later (``takeback.rebilled``)."""

    job_id: str
    key_id: int
    size_class: str
    prompt_msat_per_1k: int
    completion_msat_per_1k: int
    prompt_tokens: int
    completion_tokens: int
    charge_msat: int


class UnbalancedPosting(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Posting:
    txn: str
    kind: str
    entries: tuple[tuple[str, int], ...]
    memo: str = ""
    worker_jobs: tuple[tuple[str, int], ...] = ()
    guard: str | None = None
    charge: JobCharge | None = None  # a settle's billing facts, stored with it

    def __post_init__(self) -> None:
        total = sum(amount for _, amount in self.entries)
        if total != 0:
            raise UnbalancedPosting(f"posting {self.txn} sums to {total} msat, not 0")
        if any(not isinstance(amount, int) for _, amount in self.entries):
            raise UnbalancedPosting(f"posting {self.txn} has a non-integer amount")
        if self.guard is not None and [account for account, amount in self.entries
                                       if account == self.guard and amount < 0] != [self.guard]:
            raise UnbalancedPosting(f"posting {self.txn} guards {self.guard}, which it must "
                                    "debit exactly once")

    @property
    def guarded_debit(self) -> int:
        """What the posting takes from its guarded account (0 when it has none)."""
        return -sum(amount for account, amount in self.entries if account == self.guard)


def _posting(
    txn: str,
    kind: str,
    entries: Iterable[tuple[str, int]],
    memo: str = "",
    worker_jobs: tuple[tuple[str, int], ...] = (),
    guard: str | None = None,
    charge: JobCharge | None = None,
) -> Posting:
    return Posting(txn, kind, tuple((acct, amt) for acct, amt in entries if amt != 0), memo,
                   worker_jobs, guard, charge)


def deposit(key_id: int, amount_msat: int, txn: str, memo: str = "") -> Posting:
    return _posting(txn, "deposit",
                    [(DEPOSITS, -amount_msat), (key_available(key_id), amount_msat)], memo)


def reserve(key_id: int, amount_msat: int, job_id: str) -> Posting:
    """Hold money for a request: refused by the store if ``available`` cannot cover it."""
    guard = key_available(key_id) if amount_msat > 0 else None
    return _posting(f"reserve:{job_id}", "reserve",
                    [(key_available(key_id), -amount_msat), (key_reserved(key_id), amount_msat)],
                    guard=guard)


def release(key_id: int, amount_msat: int, job_id: str) -> Posting:
    return _posting(f"release:{job_id}", "release",
                    [(key_reserved(key_id), -amount_msat), (key_available(key_id), amount_msat)])


def settle(
    key_id: int,
    reserved_msat: int,
    charge_msat: int,
    job_id: str,
    shares: Iterable[tuple[str, int]] = (),
    *,
    count_job_for: str | Iterable[str] | None = None,
    memo: str = "",
    charge: JobCharge | None = None,
) -> Posting:
    """End a job: charge its cost out of the reservation, release the rest, and split the charge
    between the workers' accounts (pending or available) and the queen's fee. ``shares`` has one
    ``(account, msat)`` per worker paid for the job: several when it failed over mid-answer.
    ``count_job_for`` is the worker (or the workers: a model group's members each completed
    their part) whose settled-job count this job raises. ``charge``: the job's billing facts,
stored with the posting (for a later rebill)."""
    if not 0 <= charge_msat <= reserved_msat:
        raise UnbalancedPosting(f"charge {charge_msat} is outside the reservation {reserved_msat}")
    paid = list(shares)
    if any(share < 0 for _, share in paid) or sum(share for _, share in paid) > charge_msat:
        raise UnbalancedPosting(f"worker shares {paid} are outside the charge {charge_msat}")
    entries = [
        (key_reserved(key_id), -reserved_msat),
        (key_available(key_id), reserved_msat - charge_msat),
        (QUEEN_FEES, charge_msat - sum(share for _, share in paid)),
        *paid,
    ]
    counted = [count_job_for] if isinstance(count_job_for, str) else list(count_job_for or ())
    jobs = tuple((key, 1) for key in dict.fromkeys(counted))
    return _posting(f"settle:{job_id}", "charge", entries, memo, jobs, charge=charge)


def release_escrow(pubkey: str, amount_msat: int) -> Posting:
    """A worker's escrow is over: its pending earnings become available (once per worker)."""
    return _posting(f"escrow-release:{pubkey}", "escrow",
                    [(worker_pending(pubkey), -amount_msat), (worker_available(pubkey),
                                                              amount_msat)])


def refund(job_id: str, key_id: int, amount_msat: int, takes: Iterable[tuple[str, int]],
           memo: str = "", *, prefix: str = "refund") -> Posting:
    """Give a developer back what a job cost (an audited answer that did not match the model):
    ``takes`` says which accounts give it back (the queen's fee, the worker's earnings, a
    worker's debt for what it no longer holds). ``prefix`` ``rebill``: give back the part of
    the charge that the audit's exact counts did not use (one per job; with nothing to give
    back, the posting has no entries and marks the job rebilled). Both are of kind ``refund``
    (a key's spend and a worker's credits count them)."""
    return _posting(f"{prefix}:{job_id}", "refund",
                    [(key_available(key_id), amount_msat),
                     *((account, -amount) for account, amount in takes)], memo)


def forfeit_escrow(pubkey: str, amount_msat: int, flag: int) -> Posting:
    """A flagged worker's pending earnings go to the queen (its ``flag``-th flag)."""
    return _posting(f"forfeit:{pubkey}:{flag}", "forfeit",
                    [(worker_pending(pubkey), -amount_msat), (QUEEN_FEES, amount_msat)])


def restore_escrow(pubkey: str, amount_msat: int, flag: int) -> Posting:
    """An admin cleared a false flag: what it forfeited becomes the worker's, to be paid."""
    return _posting(f"restore:{pubkey}:{flag}", "forfeit",
                    [(QUEEN_FEES, -amount_msat), (worker_available(pubkey), amount_msat)])


def worker_paid(pubkey: str) -> str:
    return f"worker:{pubkey}:paid"


def payout_start(pubkey: str, amount_msat: int, payout_id: int, repay_msat: int = 0) -> Posting:
    """Reserve a payout out of the worker's available earnings, after repaying its debt
    (``repay_msat``) out of them: guarded, so ``available`` never goes below zero."""
    return _posting(f"payout:{payout_id}", "payout",
                    [(worker_available(pubkey), -amount_msat - repay_msat),
                     (worker_debt(pubkey), repay_msat), (PAYOUTS_IN_FLIGHT, amount_msat)],
                    guard=worker_available(pubkey))


def payout_paid(pubkey: str, amount_msat: int, payout_id: int) -> Posting:
    return _posting(f"payout-paid:{payout_id}", "payout",
                    [(PAYOUTS_IN_FLIGHT, -amount_msat), (worker_paid(pubkey), amount_msat)])


def payout_failed(pubkey: str, amount_msat: int, payout_id: int) -> Posting:
    return _posting(f"payout-failed:{payout_id}", "payout",
                    [(PAYOUTS_IN_FLIGHT, -amount_msat), (worker_available(pubkey), amount_msat)])
