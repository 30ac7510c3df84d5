"""Billing: developers' API keys, prices, and the double-entry ledger of msat."""
