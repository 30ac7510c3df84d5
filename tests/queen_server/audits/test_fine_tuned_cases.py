"""Answers of fine-tuned (``ft:``) models are not audited yet (issue 37): no case is made for
them, while the same answer of the base model is a case."""

from __future__ import annotations

from queen_server.audits.cases import AuditCase, case_for

BASE = "test-org/echo-GGUF:Q4_K_M"


def case(model: str) -> AuditCase | None:
    return case_for(
        request_id="req-1", model=model, sha256="a" * 64, worker_url="/v1/chat/completions",
        worker_req={"model": model, "messages": [{"role": "user", "content": "hi"}],
                    "temperature": 0},
        worker_key="w" * 64, answer="one two three", claimed_completion_tokens=3,
        claimed_prompt_tokens=9, finish_reason="stop", single_worker=True)


def test_a_fine_tuned_model_s_answer_makes_no_case_and_its_base_s_does():
    assert case(BASE) is not None
    assert case(f"ft:{BASE}:zorbania:0123456789ab") is None
