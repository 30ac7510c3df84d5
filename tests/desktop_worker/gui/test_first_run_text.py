"""What the first-run wizard decides, without a window (``services/first_run.py``), and which hub
name a local file goes in under (``services/demand.py``'s ``hub_name_of``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from desktop_worker.gui.services.advice import SMOLLM2
from desktop_worker.gui.services.demand import hub_name_of, pinned_candidates
from desktop_worker.gui.services.first_run import (
    WizardChoices,
    hub_offline_note,
    next_blocked_by,
    probe_outcome_text,
    queen_prefill,
    ready_summary,
    same_attempt,
)
from desktop_worker.link_probe import ProbeResult
from desktop_worker.settings import DEVELOPER_QUEEN_URL
from shared_schema import Demand, ModelDemand

SHA = "ab" * 32
OTHER_SHA = "cd" * 32


@pytest.mark.parametrize(("current", "shipped", "shown"), [
    (DEVELOPER_QUEEN_URL, False, ""),  # only the developer default: empty, with a placeholder
    (f" {DEVELOPER_QUEEN_URL} ", False, ""),
    (DEVELOPER_QUEEN_URL, True, DEVELOPER_QUEEN_URL),  # an installer named it on purpose
    ("wss://queen.example/worker", False, "wss://queen.example/worker"),  # saved or from env
    ("wss://queen.example/worker", True, "wss://queen.example/worker"),
])
def test_the_queen_field_never_starts_with_the_developer_default(current, shipped, shown):
    assert queen_prefill(current, shipped_default=shipped) == shown


def test_only_a_failed_test_holds_next():
    assert not next_blocked_by(None)  # untested: may go on
    assert not next_blocked_by(ProbeResult(True, "connected"))
    assert next_blocked_by(ProbeResult(False, "nothing is listening", "refused"))


def test_a_failed_test_says_what_lets_the_owner_on():
    failed = probe_outcome_text(ProbeResult(False, "nothing is listening at q:1", "refused"))
    assert failed.startswith("✗ nothing is listening at q:1")
    assert "change the address or a test passes" in failed
    assert probe_outcome_text(ProbeResult(True, "connected")) == "✓ connected"


def test_the_offline_note_says_why_and_what_to_do():
    assert hub_offline_note(None, bundled=True) == ""
    with_bundled = hub_offline_note("huggingface.co cannot be reached", bundled=True)
    assert with_bundled.startswith("Nothing can be downloaded right now: huggingface.co cannot")
    assert "comes with Apiary needs no download" in with_bundled
    without = hub_offline_note("huggingface.co cannot be reached", bundled=False)
    assert "comes with Apiary" not in without
    assert ".gguf file you already have" in without


def choices(**changes) -> WizardChoices:
    values = dict(ln_url=None, queen_url="wss://q/worker", model=SMOLLM2, local_file=None,
                  start=True)
    values.update(changes)
    return WizardChoices(**values)


def test_an_error_stays_only_while_the_choices_are_those_that_failed():
    failed = choices()
    assert same_attempt(failed, choices())
    assert same_attempt(failed, choices(start=False))  # Finish without starting: the same
    assert not same_attempt(None, choices())
    assert not same_attempt(failed, choices(model=None, local_file=Path("/m.gguf")))
    assert not same_attempt(failed, choices(model=None, local_file=Path("/b.gguf"),
                                            bundled=True))
    assert not same_attempt(failed, choices(queen_url="wss://other/worker"))
    # The hub name the wizard gave the file at Start is not a choice of the owner's.
    own = choices(model=None, local_file=Path("/m.gguf"))
    assert same_attempt(own, choices(model=None, local_file=Path("/m.gguf"),
                                     local_name="org/repo:Q4_1"))


def test_the_summary_names_the_bundled_model_as_no_download():
    text = ready_summary(choices(model=None, local_file=Path("/r/SmolLM2.gguf"), bundled=True))
    assert "Model: the small model that comes with Apiary (SmolLM2.gguf" in text
    assert "no download" in text
    assert "Model: import m.gguf" in ready_summary(choices(model=None,
                                                           local_file=Path("/m.gguf")))


def demand(*models: ModelDemand) -> Demand:
    return Demand(models=list(models))


def row(name: str, sha256: str | None, size_bytes: int | None) -> ModelDemand:
    return ModelDemand(name=name, requests_per_min=0, unmet_per_min=0, queued=0, mean_wait_s=0,
                       holders=1, loading=0, size_bytes=size_bytes, sha256=sha256)


def test_a_local_file_takes_the_hub_name_the_demand_gives_its_sha256():
    listed = demand(row("a/other:Q8_0", OTHER_SHA, 100), row("a/smol:Q4_1", SHA, 100),
                    row("a/unpinned:Q4_1", None, 100))
    assert hub_name_of(listed, SHA, 100) == "a/smol:Q4_1"
    assert hub_name_of(listed, SHA.upper(), 100) == "a/smol:Q4_1"
    assert hub_name_of(listed, "ef" * 32, 100) is None  # another file: its own name
    assert hub_name_of(listed, SHA, 99) is None  # not that size: not that file
    assert hub_name_of(None, SHA, 100) is None  # no demand (an older queen, none yet)


def test_only_files_of_a_pinned_size_are_worth_hashing():
    listed = demand(row("a/big:Q8_0", SHA, 8 << 30), row("a/unsized:Q4_1", OTHER_SHA, None),
                    row("a/unpinned:Q4_1", None, 100))
    assert [d.name for d in pinned_candidates(listed, 100)] == ["a/unsized:Q4_1"]
    assert [d.name for d in pinned_candidates(listed, 8 << 30)] == ["a/big:Q8_0",
                                                                    "a/unsized:Q4_1"]
    assert pinned_candidates(demand(row("a/unpinned:Q4_1", None, 100)), 100) == []
