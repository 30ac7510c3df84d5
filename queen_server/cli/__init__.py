"""``apiary-queen``: serve the queen, and its admin commands (keys, credit, ledger, payouts)."""

from queen_server.cli.main import main

__all__ = ["main"]
