"""When the next payout comes, at the rate this worker earns now: pure, so the Earnings tab's
promise can be checked with the figures a real worker sees (a SmolLM2 job earns about 0.008
sats, so a 1,000-sat threshold is out of reach for it, and the app must say so rather than
hint at riches).

Everything is integer msat in and plain words out; the clock is passed in (``today``).

A queen that says how it pays (issue 35: ``payout_mode``) gets its own words: "Next automatic
payout when you reach 1,000 sats (about 3 days at your recent rate)" over Lightning, and on a
queen whose operator pays by hand, that the queen asks its operator to pay at the threshold.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date

from desktop_worker.gui.units import sats
from shared_schema import WorkerEarnings

RATE_WINDOW_DAYS = 7  # the earning rate is read over the last week (or since earning began)
YEAR_DAYS = 365


@dataclass(frozen=True)
class PayoutOutlook:
    """The Earnings tab's payout lines."""

    threshold: str  # "Payouts are sent once you are owed 1,000 sats."
    eta: str  # "At this rate: in about 3 days." / "…more than a year." / "No recent earnings."


def daily_rate_msat(earnings: WorkerEarnings, today: date) -> float:
    """msat earned per day lately: the last ``RATE_WINDOW_DAYS`` days of the queen's daily
    series, divided by the days since this worker first earned in that window (so a worker that
    began today is not diluted by six empty days before it existed). Without a daily series
    (an older queen), ``week_msat`` over 7 days."""
    window = [d for d in earnings.daily if 0 <= (today - d.day).days < RATE_WINDOW_DAYS]
    earned = sum(d.earned_msat for d in window)
    if earned <= 0:
        return earnings.week_msat / RATE_WINDOW_DAYS if earnings.week_msat > 0 else 0.0
    first = min(d.day for d in window if d.earned_msat > 0)
    days = max(1, (today - first).days + 1)
    return earned / days


def eta_text(owed_msat: int, threshold_msat: int, rate_msat_per_day: float) -> str:
    """How long until ``owed_msat`` reaches ``threshold_msat`` at ``rate_msat_per_day``."""
    if owed_msat >= threshold_msat:
        return "Enough is owed to you: the queen pays it at its next payout pass."
    if rate_msat_per_day <= 0:
        return "No recent earnings, so no estimate of the next payout yet."
    days = (threshold_msat - owed_msat) / rate_msat_per_day
    return f"At this rate, the next payout comes {_span(days)}."


def _span(days: float) -> str:
    """ "in about 3 days", "within the hour"."""
    return "within the hour" if days * 24 < 1 else f"in {span_words(days)}"


def span_words(days: float) -> str:
    """A wait in words: "about 3 days", "more than a year", "less than an hour"."""
    if days > YEAR_DAYS:
        return "more than a year"
    hours = days * 24
    if hours < 1:
        return "less than an hour"
    if hours < 36:
        n = round(hours)
        return f"about {n} hour{'s' if n != 1 else ''}"
    if days < 14:
        return f"about {round(days)} days"
    if days < 60:
        return f"about {round(days / 7)} weeks"
    return f"about {round(days / 30)} months"


def soon_words(interval_s: float | None) -> str:
    """When the queen's next payout pass comes, at most: "within about 10 minutes"."""
    if interval_s is None or interval_s <= 0:
        return "at the queen's next payout pass"
    minutes = max(1, -(-int(interval_s) // 60))
    return f"within about {minutes} minute{'s' if minutes != 1 else ''}"


def payout_outlook(
    earnings: WorkerEarnings, threshold_msat: int | None, today: date,
    mode: str | None = None, interval_s: float | None = None,
) -> PayoutOutlook | None:
    """The threshold and the estimate, or None when the threshold is unknown (an older queen).
    ``mode``: how the queen pays ("lightning", "manual"; None: it did not say), and
    ``interval_s`` how often it pays what is due."""
    if threshold_msat is None or threshold_msat <= 0:
        return None
    owed = earnings.available_msat + earnings.pending_msat
    rate = daily_rate_msat(earnings, today)
    target = sats(threshold_msat)
    if mode == "lightning":
        return PayoutOutlook(
            threshold=f"You are owed {sats(owed)}. This queen pays automatically over "
                      f"Lightning once you are owed {target}.",
            eta=automatic_eta(owed, threshold_msat, rate, interval_s))
    if mode == "manual":
        return PayoutOutlook(
            threshold=f"You are owed {sats(owed)}. Once you are owed {target}, the queen asks "
                      "its operator to pay you, by hand.",
            eta=manual_eta(owed, threshold_msat, rate))
    return PayoutOutlook(
        threshold=f"Payouts are sent once you are owed {sats(threshold_msat)} "
                  f"(now owed: {sats(owed)}).",
        eta=eta_text(owed, threshold_msat, rate),
    )


def automatic_eta(owed_msat: int, threshold_msat: int, rate_msat_per_day: float,
                  interval_s: float | None) -> str:
    """When the next automatic (Lightning) payout comes."""
    target = sats(threshold_msat)
    if owed_msat >= threshold_msat:
        return (f"You have reached {target}: the next automatic payout goes out "
                f"{soon_words(interval_s)}.")
    if rate_msat_per_day <= 0:
        return f"Next automatic payout when you reach {target} (no recent earnings to tell when)."
    days = (threshold_msat - owed_msat) / rate_msat_per_day
    return (f"Next automatic payout when you reach {target} ({span_words(days)} at your "
            "recent rate).")


def manual_eta(owed_msat: int, threshold_msat: int, rate_msat_per_day: float) -> str:
    """When the queen asks its operator to pay this worker by hand."""
    target = sats(threshold_msat)
    if owed_msat >= threshold_msat:
        return f"You have reached {target}: the queen asks its operator to pay you by hand."
    if rate_msat_per_day <= 0:
        return f"No recent earnings, so no estimate of when you reach {target}."
    days = (threshold_msat - owed_msat) / rate_msat_per_day
    return (f"At your recent rate you reach {target} {_span(days)}; then the operator pays "
            "you by hand.")
