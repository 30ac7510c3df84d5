"""How the app says who pays, how and when, and what each model earns and why (issue 35): pure
texts for each payout mode, tested without a window, with the figures a real worker sees."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta

from desktop_worker.gui.services.earnings import (
    HUB_RETRY_HINT,
    MANUAL,
    UNVERIFIED_HINT,
    payout_cells,
    payout_terms_text,
    price_cell,
    price_line,
    price_text,
    prices_text,
)
from desktop_worker.gui.services.payout_estimate import payout_outlook, soon_words, span_words
from shared_schema import ModelPrice, PayoutView, WorkerEarnings, WorkerModelPrice
from shared_schema.openai_types import DailyEarning

TODAY = date(2026, 5, 20)
THRESHOLD = 1_000_000  # 1,000 sats
NOTE = "Paid by hand every Friday; ask bob@queen.example"


def earnings(per_day_msat: int = 0, owed_msat: int = 0) -> WorkerEarnings:
    daily = [DailyEarning(day=TODAY - timedelta(days=n), earned_msat=per_day_msat)
             for n in range(29, -1, -1)]
    return WorkerEarnings(worker_id="w", jobs_settled=20, escrow_jobs_left=0, pending_msat=0,
                          available_msat=owed_msat, paid_msat=0, today_msat=per_day_msat,
                          total_msat=30 * per_day_msat, daily=daily)


def priced(name: str, basis: str | None, size_class: str = "tiny", earn: int = 160
           ) -> WorkerModelPrice:
    return WorkerModelPrice(name=name, earn_msat_per_1k_tokens=earn, price=ModelPrice(
        size_class=size_class, prompt_msat_per_1k=100, completion_msat_per_1k=200, basis=basis,
        reason="the queen's own words"))


def test_who_pays_in_each_mode():
    assert payout_terms_text("manual", None, None) == MANUAL
    assert payout_terms_text("manual", None, NOTE) == (
        f"This queen's operator pays by hand: ask them how and when. The operator says: "
        f"\u201c{NOTE}\u201d")
    assert payout_terms_text("lightning", "you@wallet.example", None) == (
        "Paid to you@wallet.example over Lightning, automatically.")
    assert "once you have a payout address" in payout_terms_text("lightning", None, None)
    assert payout_terms_text("none", None, NOTE) == "This queen does not pay its workers."
    assert payout_terms_text(None, "you@wallet.example", NOTE) == ""  # an older queen: unsaid


def test_a_hostile_queens_note_is_one_short_line():
    shown = payout_terms_text("manual", None, "Pay\nday\u202e<b>soon</b>" + "x" * 400)
    note = shown.removeprefix(MANUAL + " The operator says: ")
    assert "\n" not in note
    assert "\u202e" not in note
    assert note.startswith("\u201cPay day <b>soon</b>x")  # shown as text: the label is plain
    assert len(note) <= 162
    assert note.endswith("\u2026\u201d")


def test_the_next_automatic_payout_at_the_recent_rate():
    # 300 sats a day, 100 owed: 900 more sats is 3 days.
    steady = payout_outlook(earnings(300_000, 100_000), THRESHOLD, TODAY, "lightning", 600)
    assert steady is not None
    assert steady.eta == ("Next automatic payout when you reach 1,000 sats (about 3 days at "
                          "your recent rate).")
    assert steady.threshold == ("You are owed 100 sats. This queen pays automatically over "
                                "Lightning once you are owed 1,000 sats.")
    reached = payout_outlook(earnings(300_000, THRESHOLD), THRESHOLD, TODAY, "lightning", 600)
    assert reached.eta == ("You have reached 1,000 sats: the next automatic payout goes out "
                           "within about 10 minutes.")
    # A SmolLM2 worker (about 0.008 sats a job, 100 jobs a day) owed a single sat.
    slow = payout_outlook(earnings(800, 1_000), THRESHOLD, TODAY, "lightning", 600)
    assert slow.threshold.startswith("You are owed 1 sat.")
    assert slow.eta.endswith("(more than a year at your recent rate).")
    idle = payout_outlook(earnings(0, 1_000), THRESHOLD, TODAY, "lightning", 600)
    assert idle.eta == ("Next automatic payout when you reach 1,000 sats (no recent earnings to "
                        "tell when).")


def test_a_queen_whose_operator_pays_by_hand():
    steady = payout_outlook(earnings(300_000, 100_000), THRESHOLD, TODAY, "manual")
    assert steady.threshold == ("You are owed 100 sats. Once you are owed 1,000 sats, the queen "
                                "asks its operator to pay you, by hand.")
    assert steady.eta == ("At your recent rate you reach 1,000 sats in about 3 days; then the "
                          "operator pays you by hand.")
    reached = payout_outlook(earnings(0, THRESHOLD), THRESHOLD, TODAY, "manual")
    assert reached.eta == ("You have reached 1,000 sats: the queen asks its operator to pay you "
                           "by hand.")


def test_an_older_queen_keeps_the_old_words():
    older = payout_outlook(earnings(300_000, 100_000), THRESHOLD, TODAY)
    assert older.eta == "At this rate, the next payout comes in about 3 days."


def test_spans_and_passes_in_words():
    assert span_words(1 / 48) == "less than an hour"
    assert span_words(0.5) == "about 12 hours"
    assert span_words(400) == "more than a year"
    assert soon_words(600) == "within about 10 minutes"
    assert soon_words(30) == "within about 1 minute"
    assert soon_words(None) == "at the queen's next payout pass"


def test_payouts_in_words():
    when = datetime(2026, 5, 20, 9, 30, tzinfo=UTC)
    manual = PayoutView(id=1, amount_msat=1_000, state="manual", updated_at=when,
                        detail="no Lightning backend: settle by hand")
    assert payout_cells(manual) == ("2026-05-20 09:30", "1 sat", "Due by hand",
                                    "the operator pays this by hand: ask them if it has not "
                                    "arrived")
    failed = PayoutView(id=2, amount_msat=2_000_000, state="failed", updated_at=when,
                        detail="the wallet refused\nthe invoice")
    assert payout_cells(failed)[2:] == (
        "Failed", "the wallet refused the invoice; the queen tries again later")
    paid = PayoutView(id=3, amount_msat=1_000_000, state="paid", updated_at=when, detail="ok")
    assert payout_cells(paid)[1:] == ("1,000 sats", "Paid", "")
    odd = PayoutView(id=4, amount_msat=0, state="future", updated_at=when)
    assert payout_cells(odd)[2] == "future"


def test_what_each_model_earns_and_why():
    imported = priced("smollm2", "file_size")
    assert price_text(imported) == (
        "smollm2 earns you 0.16 sats per 1,000 tokens it writes (the tiny class): the queen "
        "could not read this model on the hub, so it prices it by the size of your file.")
    unverified = priced("my-model", "unverified", "xxl", 12_800)
    assert price_text(unverified).startswith(
        "my-model earns you 12.8 sats per 1,000 tokens it writes (the xxl class): the queen "
        "could not read this model's file on the hub, so it prices it as unverified")
    # The Models tab says what to do: add it by its hub name, or wait for the hub.
    assert price_line(unverified, True) == f"{price_text(unverified)} {UNVERIFIED_HINT}"
    hub_named = priced("org/repo-GGUF:Q4_K_M", "unverified", "xxl", 12_800)
    assert price_line(hub_named, True) == f"{price_text(hub_named)} {HUB_RETRY_HINT}"
    assert price_cell(unverified) == "xxl (unverified): 12.8 sats per 1k tokens"
    assert price_cell(imported) == "tiny: 0.16 sats per 1k tokens"
    assert price_cell(None) == "—"
    older = priced("m", None)
    assert price_text(older) == "m earns you 0.16 sats per 1,000 tokens it writes (the tiny class)."
    # The Earnings tab lists them by name; nothing on a queen that pays nothing.
    both = {"smollm2": imported, "my-model": unverified}
    assert prices_text(both, True).splitlines() == [price_text(unverified), price_text(imported)]
    assert prices_text(both, False) == ""
    # The Models tab's line for the selected model.
    assert price_line(imported, True) == price_text(imported)
    assert "earns nothing here" in price_line(imported, False)
    assert "while you earn" in price_line(None, None)


def test_a_hostile_queens_price_list_is_bounded_and_plain():
    flood = {f"m{i:03d}": priced(f"m{i:03d}", "verified") for i in range(500)}
    lines = prices_text(flood, True).splitlines()
    assert len(lines) == 9
    assert lines[-1] == "…and 492 more (the Models tab shows each)."
    odd = priced("evil\u202ename\nx", "verified", size_class="tiny\x00<b>")
    assert price_text(odd).startswith("evil name x earns you 0.16 sats per 1,000 tokens it "
                                      "writes (the tiny <b> class)")
