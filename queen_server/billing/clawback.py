"""Money moved after a job is settled (issues 16 and 39): refunds, rebills at an audit's exact
counts, an escrow's release, its forfeit and its restoration.

Each is one guarded step (``LedgerStore.post_locked``): the accounts it may move are locked
(``FOR UPDATE`` on PostgreSQL, the file's write lock on SQLite), their balances read, the
posting decided from them (``takeback``, pure) and applied, in one transaction. A payout's
reservation (``payouts.runner``) locks the same worker accounts, so the two never interleave,
on one queen or across replicas: whichever runs second sees the other's effect. Each posting's
txn id makes it idempotent; the id is checked under the same locks, so two replicas doing one
step at once post it once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from queen_server.billing import ledger, takeback
from queen_server.billing.store import LedgerStore, Locked

log = logging.getLogger(__name__)


class Clawbacks:
    def __init__(self, store: LedgerStore) -> None:
        self.store = store

    async def refund(self, job_id: str, memo: str = "") -> ledger.Posting | None:
        """Give the developer back all that job ``job_id`` still holds of its charge
        (``refund:<job>``); None if it was refunded before or never charged."""
        return await self._take_back(job_id, "refund", memo, lambda left: sum(left.values()))

    async def rebill(self, job_id: str, prompt_tokens: int, completion_tokens: int,
                     memo: str = "") -> ledger.Posting | None:
        """Re-price the job at an audit's exact counts (at the rates it was billed at, kept
        in ``job_charges``) and give back what it was charged above that, from the fee and the
        workers in proportion to what each got. Posted once per job (``rebill:<job>``, with no
        entries when nothing is given back); nothing after a full refund, or for a job with no
        charge kept (charged nothing, or settled before charges were kept)."""
        charge = await self.store.job_charge(job_id)
        if charge is None:
            return None
        cut = charge.charge_msat - takeback.rebilled(charge, prompt_tokens, completion_tokens)
        memo = memo or (f"rebilled at the audit's counts: {prompt_tokens} prompt and "
                        f"{completion_tokens} completion tokens")
        return await self._take_back(job_id, "rebill", memo, lambda _left: cut,
                                     post_nothing=True)

    async def _take_back(self, job_id: str, prefix: str, memo: str,
                         amount: Callable[[dict[str, int]], int], *,
                         post_nothing: bool = False) -> ledger.Posting | None:
        """Give the key job ``job_id`` charged ``amount(what each recipient still holds of
        the charge)``, decided and posted under the accounts' locks. ``post_nothing``: post
        the empty posting too (it marks the job done)."""
        settled = await self.store.entries_of(f"settle:{job_id}")
        key_id = takeback.settled_key(settled)
        who = takeback.recipients(settled)
        if key_id is None or not who:
            return None
        refund, txn = f"refund:{job_id}", f"{prefix}:{job_id}"

        def build(locked: Locked) -> ledger.Posting | None:
            if refund in locked.txns or txn in locked.txns:
                return None  # refunded whole already, or this step was done before
            left = takeback.outstanding(settled, *locked.txns.values())
            owed = takeback.split(amount(left), left)
            total = sum(owed.values())
            if total <= 0 and not post_nothing:
                return None
            return ledger.refund(job_id, key_id, total, takeback.takes(owed, locked.balances),
                                 memo, prefix=prefix)

        posting = await self.store.post_locked(takeback.accounts(key_id, who), build,
                                               [refund, f"rebill:{job_id}"])
        if posting is not None:
            _, refunded = takeback.refunded(posting)
            debt = -sum(amount for account, amount in posting.entries
                        if account.endswith(ledger.DEBT_SUFFIX))
            log.info("%s of job %s: %d msat given back to key %d%s", prefix, job_id, refunded,
                     key_id, f" ({debt} msat of it now owed by the worker)" if debt else "")
        return posting

    async def release_escrow(self, pubkey: str) -> int:
        """Move what a worker's ``pending`` holds, read under its lock, to ``available``, once
        (``escrow-release:<key>``): never more than a refund left there, and a second release
        (another replica's count of the worker's jobs reached the end too) finds the first
        and posts nothing. Returns the msat released."""
        pending = ledger.worker_pending(pubkey)

        def build(locked: Locked) -> ledger.Posting | None:
            amount = locked.balances[pending]
            return ledger.release_escrow(pubkey, amount) if amount > 0 else None

        posting = await self.store.post_locked([pending, ledger.worker_available(pubkey)], build)
        return 0 if posting is None else -dict(posting.entries)[pending]

    async def forfeit_escrow(self, pubkey: str, flag: int) -> int:
        """A flagged worker's pending earnings, as read under the lock, go to the queen
        (``forfeit:<key>:<flag>``). Returns the msat forfeited."""
        pending = ledger.worker_pending(pubkey)

        def build(locked: Locked) -> ledger.Posting | None:
            amount = locked.balances[pending]
            return ledger.forfeit_escrow(pubkey, amount, flag) if amount > 0 else None

        posting = await self.store.post_locked([pending, ledger.QUEEN_FEES], build)
        return 0 if posting is None else -dict(posting.entries)[pending]

    async def restore_escrow(self, pubkey: str, flag: int) -> int:
        """Undo flag ``flag``'s forfeit (an admin cleared it): paid into available."""
        forfeited = sum(amount for account, amount in
                        await self.store.entries_of(f"forfeit:{pubkey}:{flag}")
                        if account == ledger.QUEEN_FEES)
        if forfeited <= 0 or not await self.store.post(
                ledger.restore_escrow(pubkey, forfeited, flag)):
            return 0
        return forfeited
