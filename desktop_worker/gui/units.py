"""Sats as the app writes them, with no Qt: the views, the services and the notifications'
pure policy all format money the same way."""

from __future__ import annotations

__all__ = ["sats", "sats_number"]


def sats(msat: int) -> str:
    """Millisatoshis as sats: ``1,234 sats``, ``1 sat``, or with the msat shown while under 100
    sats (``0.042 sats``: a small model's job earns a fraction of a sat)."""
    return f"{sats_number(msat)} sat{'' if msat == 1000 else 's'}"


def sats_number(msat: int) -> str:
    if msat % 1000 == 0 or msat >= 100_000:
        return f"{msat // 1000:,}"
    return f"{msat / 1000:,.3f}".rstrip("0").rstrip(".")
