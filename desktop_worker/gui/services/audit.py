"""This worker's audit standing at its queen, in plain words (pure: no Qt, no I/O).

A queen that audits (issue 16) re-scores a sample of this worker's answers on another worker
holding the same model file, and says in its signed ``/worker/earnings`` answer how that went:

    "audit": {"state": "unknown" | "good" | "flagged", "audited": int, "failed": int,
              "payouts_held": bool, "flagged_reason": str | null}

Older queens send no ``audit``. The answer comes from a server the owner may not control, so
it is read leniently: anything missing or malformed in the required parts means "no standing
to show" (``read_audit`` returns None), never an error; the optional parts fall back to what
the state implies. The texts are for a hobbyist who has never seen a terminal: what the checks
are, that a mismatch now and then is normal, and, when flagged, what happened and what to do.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, cast

AuditState = Literal["unknown", "good", "flagged"]
STATES: tuple[AuditState, ...] = ("unknown", "good", "flagged")
# Counts past this are not a real queen's: the answer is treated as malformed.
MAX_COUNT = 10**12
# The queen's reason is shown inside a sentence, a header line and a notification: a sane cap.
MAX_REASON = 160
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2066-\u2069]+")

NOT_CHECKED = ("Not checked yet: the queen checks some answers of new workers against the "
               "same model on another computer.")
CONTACT = ("If you did not change the model file or the app, contact the queen's operator.")
FLAGGED = ("This queen has stopped sending you work: checks found answers that did not match "
           "the model")


@dataclass(frozen=True)
class AuditStanding:
    """What the queen's audits say about this worker (see the module docstring)."""

    state: AuditState
    audited: int
    failed: int
    payouts_held: bool
    flagged_reason: str | None = None

    @property
    def flagged(self) -> bool:
        return self.state == "flagged"


def _count(value: object) -> int | None:
    """A non-negative JSON integer (``true`` is not a count), else None."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_COUNT:
        return None
    return value


def clean_reason(value: object) -> str | None:
    """The queen's reason as one short line of text: control and direction-changing
    characters become spaces, runs of spaces one, and it is cut at ``MAX_REASON``
    characters. None when there is no text."""
    if not isinstance(value, str):
        return None
    text = " ".join(_CONTROL.sub(" ", value).split()).strip()
    if not text:
        return None
    if len(text) > MAX_REASON:
        text = text[:MAX_REASON - 1].rstrip() + "…"
    return text


def read_audit(raw: object) -> AuditStanding | None:
    """The ``audit`` part of an earnings answer, or None when it is absent or unusable (not
    an object, an unknown state, counts that are not non-negative integers, more failed
    than audited). ``payouts_held`` that is not a boolean is taken from the state (held when
    flagged); a ``flagged_reason`` that is not text is dropped."""
    if not isinstance(raw, dict):
        return None
    state = raw.get("state")
    if not isinstance(state, str) or state not in STATES:
        return None
    audited = _count(raw.get("audited"))
    failed = _count(raw.get("failed"))
    if audited is None or failed is None or failed > audited:
        return None
    held = raw.get("payouts_held")
    if not isinstance(held, bool):
        held = state == "flagged"
    return AuditStanding(cast(AuditState, state), audited, failed, held,
                         clean_reason(raw.get("flagged_reason")))


def _answers(count: int) -> str:
    return f"{count:,} answer{'' if count == 1 else 's'}"


def _failed_of(standing: AuditStanding) -> str:
    """" 3 of the 40 answers checked did not match." ("" when none failed)."""
    failed, audited = standing.failed, standing.audited
    if failed == 0:
        return ""
    if failed == audited:
        return (" The one answer checked did not match." if audited == 1
                else f" All {audited:,} answers checked did not match.")
    return f" {failed:,} of the {audited:,} answers checked did not match."


def audit_text(standing: AuditStanding) -> str:
    """The Earnings tab's line (and the flagged notification's body), in plain words."""
    held = " Your payouts are on hold." if standing.payouts_held else ""
    if standing.state == "flagged":
        reason = f" ({standing.flagged_reason})" if standing.flagged_reason else ""
        return f"{FLAGGED}{reason}.{_failed_of(standing)}{held} {CONTACT}"
    if standing.audited == 0:
        return NOT_CHECKED + (" Your payouts are on hold for now." if held else "")
    if standing.failed == 0:
        matched = "it matched" if standing.audited == 1 else "all matched"
        result = f"{matched} the model"
    else:
        result = f"{standing.failed:,} did not match, which is normal now and then"
    if standing.state == "unknown":
        text = (f"Checked {_answers(standing.audited)} so far: {result}. The queen checks a "
                "few more before it trusts a new worker fully.")
    else:
        text = f"Checked {_answers(standing.audited)}: {result}."
    return text + (" Your payouts are on hold for now." if held else "")


def audit_header_text(standing: AuditStanding | None) -> str:
    """The header's warning: only when flagged ("" otherwise), short enough for its two
    reserved lines; the Earnings tab has the whole story."""
    if standing is None or not standing.flagged:
        return ""
    held = " Your payouts are on hold." if standing.payouts_held else ""
    return f"{FLAGGED}.{held} See the Earnings tab."
