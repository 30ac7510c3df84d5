"""The held-out check's pure rules (issue 37): which examples a job holds back, what a held-out
example asks a scorer, and when an adapter learned."""

from __future__ import annotations

import json

import pytest

from queen_server.finetune.checks import (
    HoldOut,
    Scored,
    ScoreRequest,
    example_of,
    fitted,
    judge,
    mismatched,
)


def test_a_tenth_is_held_back_by_the_seed_at_least_one_at_most_the_bound_never_all():
    rule = HoldOut(0.1, 16)
    assert len(rule.indexes(40, 7)) == 4
    assert rule.indexes(40, 7) == rule.indexes(40, 7)  # the same on every replica
    assert rule.indexes(40, 7) != rule.indexes(40, 8)
    assert len(rule.indexes(10, 1)) == 1
    assert len(rule.indexes(50_000, 1)) == 16
    assert rule.indexes(1, 1) == frozenset()  # a lone example is trained on
    assert HoldOut(0.1, 0).indexes(40, 1) == frozenset()  # the check switched off
    assert HoldOut(0.9, 100).count(3) == 2
    assert HoldOut(0.1, 16).sample(12, 3) == frozenset(range(12))
    assert len(HoldOut(0.1, 16).sample(100, 3)) == 16


def test_the_last_assistant_text_is_scored_given_the_conversation_before_it():
    row = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                        {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"},
                        {"role": "assistant", "content": "a2"}],
           "tools": [{"type": "function", "function": {"name": "f"}}]}
    example = example_of(b"\xef\xbb\xbf" + json.dumps(row).encode())
    assert example is not None
    assert example.answer == "a2"
    assert [m["content"] for m in example.messages] == ["s", "q", "a1", "q2"]
    request = example.request("m")
    assert request["temperature"] == 0
    assert request["tools"] == row["tools"]
    for bad in (b"not json", b"[]", json.dumps({"messages": [
            {"role": "assistant", "content": "alone"}]}).encode(),
                json.dumps({"messages": [{"role": "user", "content": "q"},
                                         {"role": "assistant", "tool_calls": []}]}).encode()):
        assert example_of(bad) is None


def test_an_answer_is_cut_to_the_context_and_a_prompt_too_long_is_skipped():
    example = ScoreRequest(({"role": "user", "content": "q"},), "é" * 500)
    assert fitted(example, None) is example
    cut = fitted(example, 300)
    assert cut is not None
    assert 0 < len(cut.answer.encode()) < 300
    assert cut.answer == "é" * len(cut.answer)  # whole characters
    long = ScoreRequest(({"role": "user", "content": "x" * 400},), "a")
    assert fitted(long, 256) is None


def test_the_adapter_learned_only_below_the_base_by_the_margin():
    base = [Scored((-2.0, -2.0)), Scored((-1.0,))]
    better = [Scored((-1.0, -1.0)), Scored((-0.5,))]
    verdict = judge(base, better, 0.01)
    assert verdict.learned
    assert verdict.base_loss == pytest.approx(5 / 3)  # token-weighted
    assert verdict.adapter_loss == pytest.approx(2.5 / 3)
    assert not judge(base, base, 0.01).learned  # changed nothing
    almost = [Scored((-1.99, -1.99)), Scored((-0.99,))]
    assert not judge(base, almost, 0.01).learned  # within the margin
    assert not judge(base, [Scored((-3.0, -3.0)), Scored((-2.0,))], 0.01).learned
    assert "did not learn: held-out loss" in judge(base, base, 0.01).message
    assert mismatched(base, better) is None
    assert mismatched(base, [Scored((-1.0,)), Scored((-0.5,))]) == 0
    assert mismatched(base, better[:1]) == 1
    with pytest.raises(ValueError, match="no answer tokens"):
        judge([], [], 0.01)
