"""Why the worker is not earning, decided without a window (issue 35): the header's reason and
fix, a reason fitted to the header a sentence at a time, the Jobs tab's line, the tray's pause
words and the fixes offered for each failure."""

from __future__ import annotations

import pytest

from desktop_worker.errors import HandshakeRefusedError, LinkError, ModelStoreError
from desktop_worker.gui.jobs_table import jobs_summary
from desktop_worker.gui.services.settings import probe_verdict
from desktop_worker.gui.services.worker import (
    FIX_LABELS,
    MORE,
    NO_MODEL_YET,
    NOT_STARTED,
    NOT_STARTED_AT_LAUNCH,
    OWNER_STOPPED,
    TRAY_PAUSE,
    as_sentence,
    fit_reason,
    fix_for,
    not_earning,
    paused_detail,
    reconnect_fix,
)
from desktop_worker.link_probe import ProbeResult


def test_a_stopped_worker_says_why_with_the_fix() -> None:
    # No model: nothing Start could serve, so the fix is adding one, whatever else holds.
    for stopped, at_launch in ((False, False), (True, True)):
        assert not_earning(has_model=False, stopped_by_owner=stopped,
                           starts_at_launch=at_launch) == (NO_MODEL_YET, "models")
    # The owner's Stop, this run: said as theirs, and that it lasts over a restart.
    assert not_earning(has_model=True, stopped_by_owner=True, starts_at_launch=False) == (
        OWNER_STOPPED, None)
    assert "even after a restart" in OWNER_STOPPED
    # A launch that did not start earning: said, with what changes it.
    assert not_earning(has_model=True, stopped_by_owner=False, starts_at_launch=False) == (
        NOT_STARTED_AT_LAUNCH, None)
    assert not_earning(has_model=True, stopped_by_owner=False, starts_at_launch=True) == (
        NOT_STARTED, None)
    # Every reason is whole sentences that name the button (the header's toggle or the fix).
    for reason in (NO_MODEL_YET, OWNER_STOPPED, NOT_STARTED_AT_LAUNCH, NOT_STARTED):
        assert reason[0].isupper()
        assert reason.endswith(".")
        assert "Start Earning" in reason
    assert FIX_LABELS["models"] == "Add a model"


def test_errors_are_said_as_sentences() -> None:
    assert as_sentence("there is no model to serve yet: add one in the Models tab") == (
        "There is no model to serve yet: add one in the Models tab.")
    assert as_sentence("Already whole.") == "Already whole."
    assert as_sentence("Retrying now…") == "Retrying now…"
    assert as_sentence("  ") == ""


def test_each_failure_offers_the_fix_that_fixes_it() -> None:
    assert fix_for(HandshakeRefusedError("invalid_ln_url", "bad address")) == "payout"
    assert fix_for(HandshakeRefusedError("version", "too old")) is None
    assert fix_for(LinkError("the queen URL 'x' is not a websocket URL")) == "queen_url"
    assert fix_for(ModelStoreError("no such model")) == "models"
    assert FIX_LABELS["queen_url"] == "Fix the queen URL"
    assert FIX_LABELS["payout"] == "Fix the payout address"
    # Waiting to reconnect: Retry now, unless no queen answers there at all.
    assert reconnect_fix("refused") == "retry"
    assert reconnect_fix("timeout") == "retry"
    assert reconnect_fix("not_a_queen") == "queen_url"
    assert FIX_LABELS["retry"] == "Retry now"


def under(chars: int):
    """A stand-in for the header's measure: what fits is at most ``chars`` characters."""
    return lambda text: len(text) <= chars


def test_a_reason_that_fits_is_shown_whole() -> None:
    text = ("Start was skipped: The model download failed: could not reach 127.0.0.1: check "
            "your internet connection, then retry.")
    assert fit_reason(text, under(len(text))) == text


def test_a_long_reason_is_cut_between_sentences_never_inside_one() -> None:
    first = "Cannot reach the queen: connection refused."
    second = "The queen may be restarting."
    third = "Apiary tries again by itself."
    text = f"{first} {second} {third}"
    assert fit_reason(text, under(len(text) - 1)) == f"{first} {second} {MORE}"
    assert fit_reason(text, under(len(first) + len(second) + 3)) == f"{first} {second} {MORE}"
    assert fit_reason(text, under(len(first) + len(second))) == f"{first} {MORE}"
    # The dots of an address do not end a sentence.
    text = "Start was skipped: could not reach 127.0.0.1: check your connection. Then retry."
    assert fit_reason(text, under(len(text) - 3)).startswith(
        "Start was skipped: could not reach 127.0.0.1: check your connection. ")


def test_a_first_sentence_too_long_alone_is_cut_between_words() -> None:
    text = "the queen refused this worker: " + "very " * 40 + "long."
    shown = fit_reason(text, under(60))
    assert len(shown) <= 60
    assert shown.endswith(MORE)
    assert text.startswith(shown.removesuffix(MORE))
    assert not shown.removesuffix(MORE).endswith(" ")
    # Nothing fits at all: one word, rather than nothing.
    assert fit_reason("a b", under(0)) == "a" + MORE


def test_the_trays_pause_is_said_as_the_owners_with_how_to_undo_it() -> None:
    assert paused_detail(TRAY_PAUSE) == ("You paused earning from the tray. Click Resume to take "
                                         "jobs again.")
    assert paused_detail("on battery") == ("Paused: on battery. Earning resumes by itself when "
                                           "that changes.")
    assert FIX_LABELS["resume"] == "Resume"


@pytest.mark.parametrize(("earning", "settled_before", "expected"), [
    (False, False, "No jobs yet. Click Start Earning and jobs appear here as the queen sends "
                   "them."),
    (True, False, "No jobs yet. Jobs appear here as the queen sends them."),
    # The header shows today's sats from earlier sessions: "no jobs yet" would be untrue.
    (True, True, "No jobs since the app opened; earlier ones are in the Earnings tab. Jobs "
                 "appear here as the queen sends them."),
    (False, True, "No jobs since the app opened; earlier ones are in the Earnings tab. Click "
                  "Start Earning and jobs appear here as the queen sends them."),
])
def test_the_jobs_line_says_what_is_true(earning: bool, settled_before: bool,
                                         expected: str) -> None:
    assert jobs_summary(served=0, tokens=0, earning=earning,
                        settled_before=settled_before) == expected


def test_the_jobs_line_counts_this_sessions_jobs() -> None:
    for earning in (True, False):
        assert jobs_summary(served=3, tokens=1234, earning=earning, settled_before=True) == (
            "3 job(s) served since the app opened, 1,234 tokens generated.")


def test_test_connections_verdict() -> None:
    assert probe_verdict(ProbeResult(True, "connected as worker abc", "ok")) == (
        True, "✓ connected as worker abc")
    assert probe_verdict(ProbeResult(False, "connection refused", "refused")) == (
        False, "✗ connection refused")
