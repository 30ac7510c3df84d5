"""The earnings answer's payout terms and model prices (issue 35) are additive: an older queen's
answer still reads, a newer queen's unknown payout mode does not make the answer unreadable, and
a model price from an older queen has no basis."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from shared_schema import ModelPrice, WorkerEarnings, WorkerModelPrice

OLDER_QUEEN = {"worker_id": "w_ab12", "jobs_settled": 3, "escrow_jobs_left": 0,
               "pending_msat": 0, "available_msat": 1000, "paid_msat": 0, "today_msat": 1000,
               "total_msat": 1000, "pays_workers": True, "payout_threshold_msat": 1_000_000}


def test_an_older_queens_answer_reads_with_no_terms():
    earnings = WorkerEarnings.model_validate(OLDER_QUEEN)
    assert (earnings.payout_mode, earnings.payout_note, earnings.payout_address) == (
        None, None, None)
    assert earnings.models == []
    assert ModelPrice.model_validate({"size_class": "tiny", "prompt_msat_per_1k": 100,
                                      "completion_msat_per_1k": 200}).basis is None


def test_a_newer_queens_mode_and_fields_do_not_make_the_answer_unreadable():
    newer = {**OLDER_QUEEN, "payout_mode": "onchain", "payout_note": "n", "later_field": 1,
             "models": [{"name": "m", "earn_msat_per_1k_tokens": 160, "shiny": True,
                         "price": {"size_class": "tiny", "prompt_msat_per_1k": 100,
                                   "completion_msat_per_1k": 200, "basis": "future",
                                   "reason": "r"}}]}
    earnings = WorkerEarnings.model_validate(newer, extra="ignore")
    assert earnings.payout_mode == "onchain"  # the app treats a mode it does not know as unsaid
    assert earnings.models[0].price.basis == "future"


@pytest.mark.parametrize("bad", [{"earn_msat_per_1k_tokens": -1}, {"name": ""}])
def test_a_model_price_is_checked(bad):
    good = {"name": "m", "earn_msat_per_1k_tokens": 1,
            "price": {"size_class": "tiny", "prompt_msat_per_1k": 1, "completion_msat_per_1k": 1}}
    WorkerModelPrice.model_validate(good)
    with pytest.raises(ValidationError):
        WorkerModelPrice.model_validate({**good, **bad})
