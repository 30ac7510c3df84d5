"""Audit cases and how an auditor's result is read into the decision rule's ``JobScore``."""

from __future__ import annotations

from typing import Any

from queen_server.audits.cases import AuditCase, case_for, read_score
from queen_server.audits.decision import DEFAULT_BANDS, judge

ANSWER = "one two three four"


def case(claimed_prompt_tokens: int) -> AuditCase | None:
    return case_for(
        request_id="req-1", model="m", sha256="a" * 64,
        worker_url="/v1/chat/completions",
        worker_req={"messages": [{"role": "user", "content": "hi"}], "temperature": 0},
        worker_key="w" * 64, answer=ANSWER, claimed_completion_tokens=4,
        claimed_prompt_tokens=claimed_prompt_tokens, finish_reason="stop", single_worker=True)


def score_data(prompt_tokens: int) -> dict[str, Any]:
    return {"object": "apiary.score", "prompt_tokens": prompt_tokens, "answer_tokens": 4,
            "logprobs": [-0.1] * 4, "argmax": [True] * 4, "best_logprobs": [-0.1] * 4,
            "end_logprob": -0.05, "end_best_logprob": -0.05, "temperature": 0.0}


def test_read_score_carries_the_auditors_count_and_the_billed_claim():
    audit = case(claimed_prompt_tokens=90)
    assert audit is not None
    assert audit.claimed_prompt_tokens == 90
    score = read_score(audit, score_data(prompt_tokens=21))
    assert (score.prompt_tokens, score.claimed_prompt_tokens) == (21, 90)
    assert judge(score, DEFAULT_BANDS).reason == ("claimed 90 prompt tokens; the auditor "
                                                  "counted 21")


def test_an_honest_prompt_claim_reads_as_a_pass():
    audit = case(claimed_prompt_tokens=21)
    assert audit is not None
    score = read_score(audit, score_data(prompt_tokens=21))
    assert (score.prompt_tokens, score.claimed_prompt_tokens) == (21, 21)
    assert not judge(score, DEFAULT_BANDS).failed


def json_case(**request: Any) -> AuditCase:
    made = case_for(
        request_id="req-2", model="m", sha256="a" * 64, worker_url="/v1/chat/completions",
        worker_req={"messages": [{"role": "user", "content": "hi"}], "temperature": 0,
                    "response_format": {"type": "json_object"}, **request},
        worker_key="w" * 64, answer=ANSWER, claimed_completion_tokens=4,
        claimed_prompt_tokens=21, finish_reason="stop", single_worker=True)
    assert made is not None
    return made


def test_a_constrained_answer_is_judged_on_its_scores_only_when_the_auditor_replayed_them():
    """A grammar or penalties change what the honest worker drew from: an auditor from before
    issue 39 scored without them (usage only); one that replays them is judged as free text."""
    audit = json_case(presence_penalty=1.0)
    assert not audit.comparable
    misses = dict(score_data(21), argmax=[False] * 4, logprobs=[-5.0] * 4)
    old = read_score(audit, misses)
    assert not old.comparable
    assert judge(old, DEFAULT_BANDS).suspicion is None  # only the usage was checked
    new = read_score(audit, dict(misses, constraints_replayed=True))
    assert new.comparable
    verdict = judge(new, DEFAULT_BANDS)
    assert verdict.failed, verdict  # four clear misses of four greedy tokens


def test_an_answer_its_format_refuses_fails_whatever_its_scores():
    audit = json_case()
    score = read_score(audit, dict(score_data(21), constraints_replayed=True,
                                   format_broken_at=0))
    verdict = judge(score, DEFAULT_BANDS)
    assert verdict.failed
    assert "leaves the requested response_format at its token 1" in verdict.reason
    kept = read_score(audit, dict(score_data(21), constraints_replayed=True))
    assert not judge(kept, DEFAULT_BANDS).failed


def test_a_json_answers_whitespace_may_have_cost_a_token_a_character():
    """Seen in an end-to-end run: SmolLM2 under the JSON grammar wrote 23 tokens that the
    auditor's tokenizer reads as 3 (the grammar takes whitespace a character at a time; the
    tokenizer merges the run). Under a JSON format such a claim is honest; for free text it is
    not."""
    spaced = "{" + "\n" + " " * 19 + "}"
    data = dict(score_data(21), answer_tokens=3, logprobs=[-0.1] * 3, argmax=[True] * 3,
                best_logprobs=[-0.1] * 3, constraints_replayed=True)

    def claimed(response_format: dict[str, Any] | None) -> Any:
        extra = {"response_format": response_format} if response_format else {}
        made = case_for(
            request_id="req-3", model="m", sha256="a" * 64, worker_url="/v1/chat/completions",
            worker_req={"messages": [{"role": "user", "content": "hi"}], "temperature": 0,
                        **extra},
            worker_key="w" * 64, answer=spaced, claimed_completion_tokens=23,
            claimed_prompt_tokens=21, finish_reason="stop")
        assert made is not None
        return judge(read_score(made, data), DEFAULT_BANDS)

    assert not claimed({"type": "json_object"}).failed
    assert claimed(None).reason == "claimed 23 completion tokens; the auditor counted 3"
