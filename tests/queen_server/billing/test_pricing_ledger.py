import json

import pytest

from queen_server.billing import ledger
from queen_server.billing.pricing import DEFAULT_PRICES, Price, PriceTable, PricingError
from queen_server.billing.service import estimate_prompt_tokens


def test_size_class_comes_from_the_parameter_count():
    table = PriceTable()
    assert table.for_parameters(135_000_000).size_class == "tiny"
    assert table.for_parameters(7_000_000_000).size_class == "medium"
    assert table.for_parameters(70_000_000_000).size_class == "xxl"
    assert table.for_parameters(None).size_class == "xxl"  # unknown: never undercharge


def test_cost_rounds_up_to_the_next_msat_and_is_integer():
    price = Price("t", None, 100, 200)
    assert price.cost_msat(7, 8) == 1 + 2
    assert price.cost_msat(1000, 1000) == 300
    assert price.cost_msat(0, 0) == 0
    assert isinstance(price.cost_msat(3, 3), int)


def test_max_completion_tokens_a_budget_covers():
    price = Price("t", None, 100, 200)
    assert price.max_completion_tokens(10_000, 1000) == (10_000 - 100) * 1000 // 200
    assert price.max_completion_tokens(50, 1000) == 0


def test_price_file(tmp_path):
    path = tmp_path / "prices.json"
    path.write_text(json.dumps([
        {"size_class": "any", "max_params": None, "prompt_msat_per_1k": 1,
         "completion_msat_per_1k": 2}]))
    assert PriceTable.from_file(path).for_parameters(10).completion_msat_per_1k == 2
    path.write_text(json.dumps([{"size_class": "x", "max_params": 5, "prompt_msat_per_1k": 1,
                                 "completion_msat_per_1k": 2, "typo": 1}]))
    with pytest.raises(PricingError, match="typo"):
        PriceTable.from_file(path)
    with pytest.raises(PricingError, match="largest"):
        PriceTable([DEFAULT_PRICES[0]])


def test_postings_always_balance():
    pending = ledger.worker_pending("ab" * 32)
    posting = ledger.settle(1, reserved_msat=500, charge_msat=120, job_id="j",
                            shares=[(pending, 96)], count_job_for="ab" * 32)
    assert sum(amount for _, amount in posting.entries) == 0
    assert dict(posting.entries) == {"key:1:reserved": -500, "key:1:available": 380,
                                     "queen:fees": 24, pending: 96}
    assert posting.worker_jobs == (("ab" * 32, 1),)
    release = ledger.release_escrow("ab" * 32, 96)
    assert dict(release.entries) == {pending: -96, ledger.worker_available("ab" * 32): 96}
    assert posting.txn == "settle:j"
    with pytest.raises(ledger.UnbalancedPosting):
        ledger.Posting("t", "x", (("a", 1), ("b", -2)))
    with pytest.raises(ledger.UnbalancedPosting):
        ledger.settle(1, 100, 200, "j")


def test_prompt_estimate_is_an_upper_bound_in_characters():
    assert estimate_prompt_tokens(["hello", ""]) == 5 + 8 + 8
