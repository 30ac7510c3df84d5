"""Taking a job's charge back from where it went (issue 39): a refund gives the developer the
whole charge back, a rebill the part that an audit's exact counts did not use. Pure: the store
reads the balances under the accounts' locks (``LedgerStore.post_locked``), and these functions
decide the posting from them.

Who gives it back: each recipient of the charge (the queen's fee, each worker's share) in
proportion to what it still holds of it. A worker gives from its pending earnings first, then
its available ones; what it no longer holds (a payout already sent it, or a flag forfeited it)
becomes its debt (``worker:<key>:debt``, below zero), which its next payout repays first. The
developer always gets the whole amount back at once: the client was charged for an answer the
audit did not accept, and the worker that served it, not the developer or the other workers,
owes what it was already paid. No liability account goes below zero, and every posting sums to
zero.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping

from queen_server.billing import ledger
from queen_server.billing.pricing import Price
from queen_server.billing.shares import apportion

QUEEN = ""  # the queen's fee, as a recipient (a worker is named by its key)

Entries = Iterable[tuple[str, int]]


def recipients(entries: Entries) -> dict[str, int]:
    """A posting's net movement by recipient: the queen's fee (``QUEEN``) and each worker
    (its pending, available and debt accounts together)."""
    out: dict[str, int] = defaultdict(int)
    for account, amount in entries:
        if account == ledger.QUEEN_FEES:
            out[QUEEN] += amount
        elif account.startswith("worker:"):
            out[account.split(":")[1]] += amount
    return dict(out)


def settled_key(entries: Entries) -> int | None:
    """The key a settle posting charged (None: not a charge)."""
    for account, _ in entries:
        if account.startswith("key:") and account.endswith(":reserved"):
            return int(account.split(":")[1])
    return None


def outstanding(settled: Entries, *returned: Entries) -> dict[str, int]:
    """What each recipient still holds of a job's charge: what the settle gave it, less what a
    rebill (or refund) of the job took back."""
    left = recipients(settled)
    for entries in returned:
        for who, amount in recipients(entries).items():
            left[who] = left.get(who, 0) + amount
    return {who: amount for who, amount in left.items() if amount > 0}


def accounts(key_id: int, who: Iterable[str]) -> list[str]:
    """Every account a take-back from ``who`` to key ``key_id`` may touch (to lock them)."""
    names = {ledger.key_available(key_id), ledger.QUEEN_FEES}
    for pubkey in who:
        if pubkey != QUEEN:
            names |= {ledger.worker_pending(pubkey), ledger.worker_available(pubkey),
                      ledger.worker_debt(pubkey)}
    return sorted(names)


def split(amount_msat: int, held: Mapping[str, int]) -> dict[str, int]:
    """``amount_msat`` taken from the recipients in proportion to what each holds of the
    charge (never more than that)."""
    who = sorted(held)
    if amount_msat <= 0 or not who:
        return {}
    amount_msat = min(amount_msat, sum(held[name] for name in who))
    return dict(zip(who, apportion(amount_msat, [held[name] for name in who]), strict=True))


def takes(owed: Mapping[str, int], balances: Mapping[str, int]) -> list[tuple[str, int]]:
    """The accounts ``owed`` (msat by recipient) comes out of, as ``(account, msat)``: the
    queen's fees; a worker's pending earnings, then its available ones, then its debt."""
    out: list[tuple[str, int]] = []
    for who, amount in sorted(owed.items()):
        if amount <= 0:
            continue
        if who == QUEEN:
            out.append((ledger.QUEEN_FEES, amount))
            continue
        left = amount
        for account in (ledger.worker_pending(who), ledger.worker_available(who)):
            taken = max(0, min(left, balances.get(account, 0)))
            out.append((account, taken))
            left -= taken
        out.append((ledger.worker_debt(who), left))
    return [(account, amount) for account, amount in out if amount > 0]


def rebilled(charge: ledger.JobCharge, prompt_tokens: int, completion_tokens: int) -> int:
    """What the job costs at an audit's exact counts: each count above the billed one changes
    nothing (the client is never charged more than it paid), and the result is capped at the
    charge (a hold may have capped it)."""
    price = Price(charge.size_class, None, charge.prompt_msat_per_1k,
                  charge.completion_msat_per_1k)
    cost = price.cost_msat(max(0, min(prompt_tokens, charge.prompt_tokens)),
                           max(0, min(completion_tokens, charge.completion_tokens)))
    return min(cost, charge.charge_msat)


def refunded(posting: ledger.Posting) -> tuple[int, int]:
    """``(key id, msat)``: the key a take-back posting gave back to, and how much."""
    for account, amount in posting.entries:
        if account.startswith("key:") and account.endswith(":available"):
            return int(account.split(":")[1]), amount
    return 0, 0


def taken_from_pending(posting: ledger.Posting) -> dict[str, int]:
    """What a take-back took from each worker's pending earnings (to correct a cache)."""
    return {account.split(":")[1]: -amount for account, amount in posting.entries
            if account.startswith("worker:") and account.endswith(":pending") and amount < 0}
