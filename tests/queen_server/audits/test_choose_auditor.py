"""Who audits a case (``cases.choose_auditor``): trusted first, then untrusted auditors
independent of the audited worker and of the first auditor, never an ineligible one."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from queen_server.audits.cases import case_for, choose_auditor
from shared_schema import ModelDescriptor
from shared_schema.capabilities import SCORE

SHA = "a" * 64
MODEL = "m"


@dataclass(frozen=True)
class Holder:
    key: str
    capabilities: frozenset[str] = frozenset({SCORE})
    free_slots: int = 1
    flagged: bool = False
    models: Mapping[str, ModelDescriptor] = field(default_factory=lambda: {
        MODEL: ModelDescriptor(name=MODEL, size_bytes=1, sha256=SHA)})

    def __hash__(self) -> int:
        return hash(self.key)


CASE = case_for(request_id="req-1", model=MODEL, sha256=SHA, worker_url="/v1/chat/completions",
                worker_req={"messages": [{"role": "user", "content": "hi"}]}, worker_key="worker",
                answer="an answer", claimed_completion_tokens=2, claimed_prompt_tokens=5,
                finish_reason="stop", single_worker=True)
RECORDS = {"good": ("good", 40), "new": ("unknown", 0), "new2": ("unknown", 0),
           "sybil": ("good", 90), "trusted": ("unknown", 0)}


def record(key: str) -> tuple[str, int]:
    return RECORDS.get(key, ("unknown", 0))


def choose(holders: list[Holder], **kwargs) -> str | None:
    assert CASE is not None
    chosen = choose_auditor(CASE, holders, trusted=kwargs.pop("trusted", ()), record=record,
                            **kwargs)
    return chosen.key if chosen is not None else None


def test_an_independent_newcomer_comes_before_a_dependent_worker_in_good_standing():
    holders = [Holder("sybil"), Holder("new")]
    assert choose(holders) == "sybil"  # the longest good record, without a rule
    assert choose(holders, independent=lambda worker: worker.key != "sybil") == "new"


def test_a_dependent_worker_is_still_asked_when_no_independent_one_is_free():
    holders = [Holder("sybil"), Holder("new", free_slots=0)]
    assert choose(holders, independent=lambda worker: worker.key == "new") == "sybil"


def test_a_trusted_auditor_comes_first_whatever_independence_says():
    holders = [Holder("good"), Holder("trusted")]
    assert choose(holders, trusted={"trusted"}, independent=lambda worker: False) == "trusted"


def test_within_the_independent_ones_good_standing_and_record_still_order():
    holders = [Holder("new"), Holder("good"), Holder("sybil")]
    assert choose(holders, independent=lambda worker: worker.key != "sybil") == "good"


def test_an_ineligible_auditor_is_never_chosen_even_alone():
    assert choose([Holder("sybil")], ineligible={"sybil"}) is None
    assert choose([Holder("sybil"), Holder("new")], ineligible={"sybil"}) == "new"


def test_the_audited_worker_the_excluded_and_the_flagged_are_never_chosen():
    holders = [Holder("worker"), Holder("good", flagged=True), Holder("new")]
    assert choose(holders, exclude={"new"}) is None


GROUP_CASE = case_for(request_id="req-g", model=MODEL, sha256=SHA,
                      worker_url="/v1/chat/completions",
                      worker_req={"messages": [{"role": "user", "content": "hi"}]},
                      worker_key="head", answer="an answer", claimed_completion_tokens=2,
                      claimed_prompt_tokens=5, finish_reason="stop", single_worker=True,
                      group=("head", "member-1", "member-2"))


def choose_for_group(holders: list[Holder], **kwargs) -> str | None:
    assert GROUP_CASE is not None
    chosen = choose_auditor(GROUP_CASE, holders, trusted=kwargs.pop("trusted", ()),
                            record=record, **kwargs)
    return chosen.key if chosen is not None else None


def test_a_groups_answer_is_never_audited_by_a_worker_of_that_group():
    """A member holding the file is no auditor of its own group's answer, even trusted and
    even when the judge would take it (issue 39: no member in common)."""
    holders = [Holder("member-1"), Holder("member-2")]
    assert choose_for_group(holders, trusted={"member-1"},
                            holds_group_model=lambda worker: True) is None


def test_a_groups_answer_needs_an_auditor_that_can_hold_the_model():
    holders = [Holder("good"), Holder("trusted")]
    assert choose_for_group(holders) is None  # no judge: a lone holder cannot load it
    big_enough = {"trusted"}
    assert choose_for_group(holders, trusted={"trusted"},
                            holds_group_model=lambda w: w.key in big_enough) == "trusted"
    assert choose_for_group(holders, trusted={"trusted"},
                            holds_group_model=lambda w: False) is None


def test_a_lone_answer_ignores_the_group_judge():
    assert choose([Holder("good")], holds_group_model=lambda w: False) == "good"
