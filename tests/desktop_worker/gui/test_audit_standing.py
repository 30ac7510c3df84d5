"""The audit standing from the queen's earnings answer: read leniently, said in plain words, and
told once by notification (pure: no Qt)."""

from __future__ import annotations

from typing import Any

import pytest

from desktop_worker.gui.notify import NotificationPolicy
from desktop_worker.gui.services.audit import (
    MAX_REASON,
    NOT_CHECKED,
    AuditStanding,
    audit_header_text,
    audit_text,
    clean_reason,
    read_audit,
)

CONTACT = "If you did not change the model file or the app, contact the queen's operator."


def raw(**overrides: Any) -> dict[str, Any]:
    values: dict[str, Any] = {"state": "good", "audited": 14, "failed": 0,
                              "payouts_held": False, "flagged_reason": None}
    values.update(overrides)
    return values


def standing(state: str = "good", audited: int = 14, failed: int = 0, held: bool = False,
             reason: str | None = None) -> AuditStanding:
    standing = read_audit(raw(state=state, audited=audited, failed=failed, payouts_held=held,
                              flagged_reason=reason))
    assert standing is not None
    return standing


# --- reading ----------------------------------------------------------------------------------

def test_a_full_audit_part_is_read():
    assert read_audit(raw(state="flagged", audited=40, failed=6, payouts_held=True,
                          flagged_reason="answers far less likely than the model's")) == \
        AuditStanding("flagged", 40, 6, True, "answers far less likely than the model's")


@pytest.mark.parametrize("value", [None, [], "flagged", 3, True])
def test_no_audit_object_means_nothing_to_show(value):
    assert read_audit(value) is None


@pytest.mark.parametrize("overrides", [
    {"state": "suspended"},  # a state this app does not know
    {"state": "FLAGGED"},
    {"state": None},
    {"state": ["flagged"]},
    {"audited": -1},
    {"audited": 14.0},
    {"audited": "14"},
    {"audited": True},  # JSON true is not a count
    {"audited": None},
    {"failed": False},
    {"failed": -3},
    {"audited": 10**13, "failed": 0},
    {"audited": 3, "failed": 4},  # more failed than checked
])
def test_malformed_required_parts_mean_nothing_to_show(overrides):
    assert read_audit(raw(**overrides)) is None


@pytest.mark.parametrize("missing", ["state", "audited", "failed"])
def test_a_missing_required_part_means_nothing_to_show(missing):
    body = raw()
    del body[missing]
    assert read_audit(body) is None


@pytest.mark.parametrize(("state", "held"), [("flagged", True), ("good", False),
                                             ("unknown", False)])
@pytest.mark.parametrize("value", ["missing", None, "yes", 1])
def test_payouts_held_that_is_not_a_boolean_follows_the_state(state, held, value):
    body = raw(state=state)
    if value == "missing":
        del body["payouts_held"]
    else:
        body["payouts_held"] = value
    result = read_audit(body)
    assert result is not None
    assert result.payouts_held is held


@pytest.mark.parametrize("value", [None, 42, ["why"], {"a": 1}, "", "   \n\t "])
def test_a_reason_that_is_no_text_is_dropped(value):
    result = read_audit(raw(state="flagged", flagged_reason=value))
    assert result is not None
    assert result.flagged_reason is None


def test_unknown_fields_are_ignored():
    assert read_audit(raw(extra={"nested": [1, 2]}, auditors=["a"])) == standing()


def test_the_reason_becomes_one_short_line():
    assert clean_reason("  usage\nclaimed\t3x  the\x00count \u202egnissim ") == \
        "usage claimed 3x the count gnissim"
    long = clean_reason("x" * 10_000)
    assert long is not None
    assert len(long) == MAX_REASON
    assert long.endswith("…")
    # Markup is kept as text: the labels show it literally (plain_label), nothing renders.
    assert clean_reason("<img src=http://evil/x>") == "<img src=http://evil/x>"


# --- plain words ------------------------------------------------------------------------------

def test_not_checked_yet():
    assert audit_text(standing("unknown", 0, 0)) == NOT_CHECKED
    assert NOT_CHECKED == ("Not checked yet: the queen checks some answers of new workers "
                           "against the same model on another computer.")


def test_checked_some_but_not_enough_yet():
    assert audit_text(standing("unknown", 1, 0)) == (
        "Checked 1 answer so far: it matched the model. The queen checks a few more before "
        "it trusts a new worker fully.")
    assert audit_text(standing("unknown", 3, 0)) == (
        "Checked 3 answers so far: all matched the model. The queen checks a few more before "
        "it trusts a new worker fully.")
    assert audit_text(standing("unknown", 5, 1)).startswith(
        "Checked 5 answers so far: 1 did not match, which is normal now and then.")


def test_good_standing_is_reassuring():
    assert audit_text(standing("good", 14, 0)) == "Checked 14 answers: all matched the model."
    assert audit_text(standing("good", 1, 0)) == "Checked 1 answer: it matched the model."
    assert audit_text(standing("good", 40, 1)) == (
        "Checked 40 answers: 1 did not match, which is normal now and then.")
    assert audit_text(standing("good", 1_250, 12)) == (
        "Checked 1,250 answers: 12 did not match, which is normal now and then.")


def test_good_with_no_checks_reads_as_not_checked_yet():
    assert audit_text(standing("good", 0, 0)) == NOT_CHECKED


def test_payouts_held_without_a_flag_is_said():
    assert audit_text(standing("good", 14, 0, held=True)) == (
        "Checked 14 answers: all matched the model. Your payouts are on hold for now.")
    assert audit_text(standing("unknown", 0, 0, held=True)) == (
        NOT_CHECKED + " Your payouts are on hold for now.")


def test_flagged_says_what_happened_and_what_to_do():
    text = audit_text(standing("flagged", 40, 6, held=True,
                               reason="answers far less likely than the model's"))
    assert text == (
        "This queen has stopped sending you work: checks found answers that did not match the "
        "model (answers far less likely than the model's). 6 of the 40 answers checked did "
        "not match. Your payouts are on hold. " + CONTACT)


def test_flagged_counts_singular_plural_and_all():
    one = audit_text(standing("flagged", 1, 1, held=True))
    assert "did not match the model. The one answer checked did not match." in one
    assert "All 20 answers checked did not match." in audit_text(standing("flagged", 20, 20))
    assert "1 of the 2 answers checked did not match." in audit_text(standing("flagged", 2, 1))


def test_flagged_without_reason_counts_or_hold():
    # A flag for usage claims can come with no failed re-scoring: no count sentence then.
    text = audit_text(standing("flagged", 12, 0, held=False))
    assert text == ("This queen has stopped sending you work: checks found answers that did "
                    "not match the model. " + CONTACT)


def test_the_header_speaks_only_of_a_flag():
    assert audit_header_text(None) == ""
    assert audit_header_text(standing("good")) == ""
    assert audit_header_text(standing("unknown", 0, 0)) == ""
    assert audit_header_text(standing("flagged", 9, 3, held=True, reason="x" * 150)) == (
        "This queen has stopped sending you work: checks found answers that did not match the "
        "model. Your payouts are on hold. See the Earnings tab.")
    assert "on hold" not in audit_header_text(standing("flagged", 9, 3, held=False))


# --- the notification -------------------------------------------------------------------------

def test_a_flag_is_notified_once_per_app_run():
    policy = NotificationPolicy()
    assert policy.audit(None) is None
    assert policy.audit(standing("unknown", 0, 0)) is None
    assert policy.audit(standing("good")) is None  # nothing was wrong: nothing to say
    flagged = standing("flagged", 40, 6, held=True, reason="garbage")
    notice = policy.audit(flagged)
    assert notice is not None
    assert notice.title == "The queen stopped sending you work"
    assert notice.level == "error"
    assert notice.message == audit_text(flagged)
    assert policy.audit(flagged) is None
    assert policy.audit(None) is None  # an unreadable answer is no news
    assert policy.audit(standing("flagged", 41, 6, held=True)) is None


def test_a_cleared_flag_is_told_and_a_new_flag_after_it_again():
    policy = NotificationPolicy()
    assert policy.audit(standing("flagged", 40, 6, held=True)) is not None
    cleared = policy.audit(standing("good", 40, 6))
    assert cleared is not None
    assert cleared.title == "Flag cleared"
    assert policy.audit(standing("good", 41, 6)) is None
    again = policy.audit(standing("flagged", 60, 12, held=True))
    assert again is not None
    assert again.title == "The queen stopped sending you work"
