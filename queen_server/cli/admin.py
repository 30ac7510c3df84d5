"""``apiary-queen`` admin commands: ``db upgrade``, ``keys ...`` and ``ledger check``.

They open the queen's database directly, so they work whether or not the queen is running; a
running queen picks up new keys, revocations and deposits within ``APIARY_BILLING_REFRESH_S``.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import TextIO

from queen_server.billing import ledger
from queen_server.billing.admin import create_key, credit_key, list_keys, sats_to_msat
from queen_server.billing.keys import KeyStore
from queen_server.billing.store import LedgerStore
from queen_server.identity import public_id
from queen_server.settings import QueenSettings
from queen_server.storage.engine import Database
from queen_server.storage.queries import recent_payouts
from shared_schema.admin_types import MAX_SATS

CLI_PAYOUTS = 50  # payouts `payouts list` shows


def sats(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of sats") from None
    if not 0 <= value <= MAX_SATS:  # also refuses nan and inf
        raise argparse.ArgumentTypeError(f"must be between 0 and {MAX_SATS:,} sats "
                                         "(every bitcoin there will ever be)")
    return value


def add_commands(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    db = commands.add_parser("db", help="database maintenance")
    db.add_subparsers(dest="action", required=True, metavar="ACTION").add_parser(
        "upgrade", help="apply the schema migrations (the queen also does this on start)")

    keys = commands.add_parser("keys", help="developers' API keys")
    actions = keys.add_subparsers(dest="action", required=True, metavar="ACTION")
    create = actions.add_parser("create", help="make a key (shown once)")
    create.add_argument("--name", required=True)
    create.add_argument("--credit-sats", type=sats, default=0)
    create.add_argument("--rpm", type=int, help="requests per minute allowed")
    create.add_argument("--concurrency", type=int, help="requests at once allowed")
    create.add_argument("--budget-sats", type=sats, help="the most this key may ever spend")
    actions.add_parser("list", help="list keys with their balances")
    revoke = actions.add_parser("revoke", help="revoke a key")
    revoke.add_argument("key", help="the key's id or prefix (from `keys list`)")
    credit = actions.add_parser("credit", help="add sats to a key's balance")
    credit.add_argument("key", help="the key's id or prefix")
    credit.add_argument("sats", type=sats)
    credit.add_argument("--ref", help="an idempotency reference: the same ref credits once")

    payouts = commands.add_parser("payouts", help="payouts to workers")
    payouts.add_subparsers(dest="action", required=True, metavar="ACTION").add_parser(
        "list", help="recent payouts and their state")

    ledger_cmd = commands.add_parser("ledger", help="the money ledger")
    ledger_cmd.add_subparsers(dest="action", required=True, metavar="ACTION").add_parser(
        "check", help="verify that the ledger balances and the cached balances match it")


def run_command(settings: QueenSettings, args: argparse.Namespace, out: TextIO) -> int:
    return asyncio.run(_run(settings, args, out))


async def _run(settings: QueenSettings, args: argparse.Namespace, out: TextIO) -> int:
    db = Database(settings.db, lock_timeout_s=settings.db_lock_timeout_s)
    try:
        revision = await db.upgrade()
        if args.command == "db":
            out.write(f"database {db.url.render_as_string(hide_password=True)} is at revision "
                      f"{revision}\n")
            return 0
        keys, store = KeyStore(db.engine), LedgerStore(db.engine)
        if args.command == "ledger":
            return await _check(store, out)
        if args.command == "payouts":
            return await _list_payouts(db, out)
        if args.action == "create":
            budget = sats_to_msat(args.budget_sats) if args.budget_sats is not None else None
            secret, record = await create_key(
                keys, store, args.name, credit_msat=sats_to_msat(args.credit_sats),
                rpm_limit=args.rpm, concurrency_limit=args.concurrency, budget_msat=budget)
            out.write(f"created key {record.id} ({record.name}) with {args.credit_sats:g} sats\n"
                      f"{secret}\n"
                      "This key is shown once. Store it now: only its hash is kept.\n")
        elif args.action == "list":
            out.write(f"{'id':>4}  {'prefix':<15} {'name':<24} {'available sats':>15} "
                      f"{'reserved':>9}  status\n")
            for key in await list_keys(keys, store):
                status = "revoked" if key.revoked else "active"
                out.write(f"{key.id:>4}  {key.prefix:<15} {key.name[:24]:<24} "
                          f"{key.available_msat / 1000:>15,.3f} "
                          f"{key.reserved_msat / 1000:>9,.3f}  {status}\n")
        elif args.action == "revoke":
            record = await keys.find(args.key)
            await keys.revoke(record.id)
            out.write(f"revoked key {record.id} ({record.name})\n")
        elif args.action == "credit":
            record, applied = await credit_key(keys, store, args.key, sats_to_msat(args.sats),
                                               args.ref)
            balance = await store.balance(ledger.key_available(record.id))
            verb = "credited" if applied else "already credited (same --ref)"
            out.write(f"{verb} {args.sats:g} sats to key {record.id}; available now "
                      f"{balance / 1000:,.3f} sats\n")
        return 0
    finally:
        await db.close()


async def _list_payouts(db: Database, out: TextIO) -> int:
    rows = await recent_payouts(db.engine, CLI_PAYOUTS)
    out.write(f"{'id':>5}  {'worker':<12} {'sats':>12}  {'state':<9} {'when':<16} detail\n")
    for row in rows:
        out.write(f"{row.id:>5}  {public_id(row.worker_key):<12} {row.amount_msat / 1000:>12,.3f}"
                  f"  {row.state:<9} {row.updated_at:%Y-%m-%d %H:%M} {row.detail[:60]}\n")
    if not rows:
        out.write("no payouts yet\n")
    return 0


async def _check(store: LedgerStore, out: TextIO) -> int:
    report = await store.check()
    out.write(f"{report.txns} transactions, {report.entries} entries, sum {report.total_msat} "
              "msat\n")
    for txn in report.unbalanced_txns:
        out.write(f"UNBALANCED transaction {txn}\n")
    for account, (cached, derived) in sorted(report.drift.items()):
        out.write(f"DRIFT {account}: cached {cached} msat, ledger says {derived} msat\n")
    for account, amount in sorted(report.negative.items()):
        out.write(f"NEGATIVE {account}: {amount} msat\n")
    out.write("ledger is clean\n" if report.clean else "ledger has problems\n")
    return 0 if report.clean else 1

