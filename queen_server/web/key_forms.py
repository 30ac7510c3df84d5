"""The admin Keys page's forms, read into what ``billing.admin`` takes, or refused with a
message an operator understands (which field, and why).

Pure: the posted fields in, a typed action or a ``FormError`` out, so every bad input is tested
without a server, and nothing is written before the whole form has been read. The bounds are
the admin API's (``shared_schema.admin_types``): no amount past every bitcoin there will ever
be, no limit past 2^31 - 1.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

from shared_schema.admin_types import MAX_LIMIT, MAX_SATS

MAX_NAME = 200
MAX_REF = 100
_SEPARATORS = re.compile(r"[,_\s]")  # "1,000", "1_000" and "1 000" are a thousand


class FormError(ValueError):
    """A field the operator must fix; ``field`` names the input, for the page to point at."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


@dataclass(frozen=True)
class CreateKey:
    name: str
    credit_msat: int
    budget_msat: int | None
    rpm_limit: int | None
    concurrency_limit: int | None


@dataclass(frozen=True)
class CreditKey:
    key: str  # an id or a prefix, as ``KeyStore.find`` takes it
    msat: int
    ref: str | None


@dataclass(frozen=True)
class RevokeKey:
    key: str


KeyAction = CreateKey | CreditKey | RevokeKey
ACTIONS = ("create", "credit", "revoke")


def parse_sats(text: str | None, field: str, label: str, *, required: bool,
               at_least_msat: int = 0) -> int | None:
    """An amount of sats typed by a person, as msat; None when blank and not ``required``."""
    cleaned = _SEPARATORS.sub("", text or "")
    if not cleaned:
        if required:
            raise FormError(field, f"{label}: enter a number of sats.")
        return None
    try:
        sats = float(cleaned)
    except ValueError:
        raise FormError(field, f"{label}: {text!r} is not a number of sats.") from None
    if not math.isfinite(sats):
        raise FormError(field, f"{label}: {text!r} is not a number of sats.")
    if sats < 0:
        raise FormError(field, f"{label}: an amount cannot be negative.")
    if sats > MAX_SATS:
        raise FormError(field, f"{label}: {text} sats is more than every bitcoin there will "
                               f"ever be ({MAX_SATS:,} sats).")
    msat = round(sats * 1000)
    if msat < at_least_msat:
        raise FormError(field, f"{label}: enter at least {at_least_msat / 1000:g} sats.")
    return msat


def parse_limit(text: str | None, field: str, label: str) -> int | None:
    """A whole-number limit (requests per minute, at once); None when blank (no limit)."""
    cleaned = _SEPARATORS.sub("", text or "")
    if not cleaned:
        return None
    if not cleaned.isdigit() or not cleaned.isascii():
        raise FormError(field, f"{label}: enter a whole number, or leave it empty for no "
                               "limit.")
    value = int(cleaned)
    if not 1 <= value <= MAX_LIMIT:
        raise FormError(field, f"{label}: enter a number from 1 to {MAX_LIMIT:,}.")
    return value


def _key(form: Mapping[str, str]) -> str:
    key = (form.get("key") or "").strip()
    if not key:
        raise FormError("key", "Choose a key.")
    return key


def parse_key_form(form: Mapping[str, str]) -> KeyAction:
    """The action a posted Keys form asks for; raises ``FormError`` on any bad field."""
    action = form.get("action", "")
    if action == "create":
        name = (form.get("name") or "").strip()
        if not name:
            raise FormError("name", "Name: give the key a name (who or what it is for).")
        if len(name) > MAX_NAME or any(ord(c) < 0x20 for c in name):
            raise FormError("name", f"Name: at most {MAX_NAME} characters, on one line.")
        return CreateKey(
            name=name,
            credit_msat=parse_sats(form.get("credit_sats"), "credit_sats", "Starting credit",
                                   required=False) or 0,
            budget_msat=parse_sats(form.get("budget_sats"), "budget_sats", "Spend budget",
                                   required=False),
            rpm_limit=parse_limit(form.get("rpm_limit"), "rpm_limit", "Requests per minute"),
            concurrency_limit=parse_limit(form.get("concurrency_limit"), "concurrency_limit",
                                          "Requests at once"),
        )
    if action == "credit":
        key = _key(form)
        msat = parse_sats(form.get("sats"), "sats", "Amount", required=True, at_least_msat=1)
        if msat is None:  # not reached: a required amount is never blank
            raise FormError("sats", "Amount: enter a number of sats.")
        ref = (form.get("ref") or "").strip() or None
        if ref is not None and len(ref) > MAX_REF:
            raise FormError("ref", f"Reference: at most {MAX_REF} characters.")
        return CreditKey(key=key, msat=msat, ref=ref)
    if action == "revoke":
        return RevokeKey(key=_key(form))
    raise FormError("action", "Unknown action: use the page's own buttons.")
