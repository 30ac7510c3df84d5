"""Double-entry postings and the accounts they move money between. Pure: no I/O.

Accounts (all in msat):

* ``deposits``                 where developers' money comes from (goes negative as it comes in)
* ``key:<id>:available``       a key's spendable balance
* ``key:<id>:reserved``        held for requests in flight
* ``worker:<pubkey>:earned``   a worker's earnings
* ``queen:fees``               the queen's share of every charge

A posting's amounts always sum to zero; its ``txn`` id is its idempotency key.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

DEPOSITS = "deposits"
QUEEN_FEES = "queen:fees"


def key_available(key_id: int) -> str:
    return f"key:{key_id}:available"


def key_reserved(key_id: int) -> str:
    return f"key:{key_id}:reserved"


def worker_earned(pubkey: str) -> str:
    return f"worker:{pubkey}:earned"


class UnbalancedPosting(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Posting:
    txn: str
    kind: str
    entries: tuple[tuple[str, int], ...]
    memo: str = ""

    def __post_init__(self) -> None:
        total = sum(amount for _, amount in self.entries)
        if total != 0:
            raise UnbalancedPosting(f"posting {self.txn} sums to {total} msat, not 0")
        if any(not isinstance(amount, int) for _, amount in self.entries):
            raise UnbalancedPosting(f"posting {self.txn} has a non-integer amount")


def _posting(txn: str, kind: str, entries: Iterable[tuple[str, int]], memo: str = "") -> Posting:
    return Posting(txn, kind, tuple((acct, amt) for acct, amt in entries if amt != 0), memo)


def deposit(key_id: int, amount_msat: int, txn: str, memo: str = "") -> Posting:
    return _posting(txn, "deposit",
                    [(DEPOSITS, -amount_msat), (key_available(key_id), amount_msat)], memo)


def reserve(key_id: int, amount_msat: int, job_id: str) -> Posting:
    return _posting(f"reserve:{job_id}", "reserve",
                    [(key_available(key_id), -amount_msat), (key_reserved(key_id), amount_msat)])


def release(key_id: int, amount_msat: int, job_id: str) -> Posting:
    return _posting(f"release:{job_id}", "release",
                    [(key_reserved(key_id), -amount_msat), (key_available(key_id), amount_msat)])


def settle(
    key_id: int,
    reserved_msat: int,
    charge_msat: int,
    job_id: str,
    worker_pubkey: str | None,
    worker_share_msat: int,
) -> Posting:
    """End a job: charge its cost out of the reservation, release the rest, and split the charge
    between the worker (its earnings) and the queen's fee."""
    if not 0 <= charge_msat <= reserved_msat:
        raise UnbalancedPosting(f"charge {charge_msat} is outside the reservation {reserved_msat}")
    share = worker_share_msat if worker_pubkey else 0
    if not 0 <= share <= charge_msat:
        raise UnbalancedPosting(f"worker share {share} is outside the charge {charge_msat}")
    entries = [
        (key_reserved(key_id), -reserved_msat),
        (key_available(key_id), reserved_msat - charge_msat),
        (QUEEN_FEES, charge_msat - share),
    ]
    if worker_pubkey:
        entries.append((worker_earned(worker_pubkey), share))
    return _posting(f"settle:{job_id}", "charge", entries)
