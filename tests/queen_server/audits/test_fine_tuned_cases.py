"""Answers of fine-tuned (``ft:``) models are audit cases (issue 37) carrying the model's
identity (its base, the base's file, its adapter), and only a holder of the base's file with
``lora`` and ``score`` may audit one: never the audited worker, never one without ``lora``, never
one holding another file of the base, nor one that names the ``ft:`` model but not its base."""

from __future__ import annotations

from queen_server.audits.cases import AuditCase, case_for, choose_auditor
from shared_schema import ModelDescriptor
from shared_schema.capabilities import LORA, SCORE
from tests.queen_server.audits.test_choose_auditor import Holder, record

BASE = "test-org/echo-GGUF:Q4_K_M"
FT = f"ft:{BASE}:zorbania:0123456789ab"
SHA = "a" * 64
ADAPTER = "b" * 64


def case(model: str, **kwargs) -> AuditCase | None:
    return case_for(
        request_id="req-1", model=model, sha256=SHA, worker_url="/v1/chat/completions",
        worker_req={"model": model, "messages": [{"role": "user", "content": "hi"}],
                    "temperature": 0},
        worker_key="worker", answer="one two three", claimed_completion_tokens=3,
        claimed_prompt_tokens=9, finish_reason="stop", single_worker=True, **kwargs)


def holder(key: str, *, lora: bool = True, sha256: str = SHA, name: str = BASE,
           **kwargs) -> Holder:
    caps = frozenset({SCORE, LORA} if lora else {SCORE})
    return Holder(key, capabilities=caps, models={
        name: ModelDescriptor(name=name, size_bytes=1, sha256=sha256)}, **kwargs)


def chosen(found: AuditCase, holders: list[Holder], **kwargs) -> str | None:
    auditor = choose_auditor(found, holders, trusted=kwargs.pop("trusted", ()),
                             record=record, **kwargs)
    return auditor.key if auditor is not None else None


def test_a_fine_tuned_answer_is_a_case_of_its_base_s_file_and_its_adapter():
    found = case(FT, base=BASE, adapter_sha256=ADAPTER)
    assert found is not None
    assert (found.model, found.base, found.sha256, found.adapter_sha256) == (
        FT, BASE, SHA, ADAPTER)
    assert found.held_as == BASE
    job = found.job()
    assert job["model"] == FT  # the score job names the ft: model (its Job.adapter's name)
    assert job["request"]["model"] == FT
    # Its base's answer is a case of the base alone.
    plain = case(BASE)
    assert plain is not None
    assert (plain.base, plain.adapter_sha256, plain.held_as) == (None, None, BASE)


def test_a_fine_tuned_answer_without_its_identity_is_no_case_and_a_base_s_takes_no_adapter():
    assert case(FT) is None  # no base, no adapter: nothing an auditor could load
    assert case(FT, base=BASE) is None
    assert case(FT, adapter_sha256=ADAPTER) is None
    assert case(BASE, base=BASE, adapter_sha256=ADAPTER) is None


def test_only_a_lora_holder_of_the_base_s_file_audits_a_fine_tuned_answer():
    found = case(FT, base=BASE, adapter_sha256=ADAPTER)
    assert found is not None
    plain = holder("good", lora=False)  # the longest record, but no lora
    other_file = holder("sybil", sha256="c" * 64)  # lora, another file under the base's name
    names_ft = holder("new2", name=FT)  # says it holds the ft: name itself, not the base
    assert chosen(found, [plain, other_file, names_ft]) is None
    assert chosen(found, [plain, other_file, names_ft], busy_too=True) is None
    assert chosen(found, [plain, other_file, names_ft, holder("new")]) == "new"
    # Even trusted: a trusted auditor without lora cannot load the adapter.
    assert chosen(found, [plain, holder("new")], trusted={"good"}) == "new"
    # The base's own answer: the holder without lora will do (the best record).
    base_case = case(BASE)
    assert base_case is not None
    assert chosen(base_case, [plain, holder("new")]) == "good"


def test_never_the_audited_worker_nor_an_excluded_or_busy_one():
    found = case(FT, base=BASE, adapter_sha256=ADAPTER)
    assert found is not None
    assert chosen(found, [holder("worker")]) is None  # the audited worker itself
    assert chosen(found, [holder("worker"), holder("new")], exclude={"new"}) is None
    assert chosen(found, [holder("new", free_slots=0)]) is None
    assert chosen(found, [holder("new", free_slots=0)], busy_too=True) == "new"
