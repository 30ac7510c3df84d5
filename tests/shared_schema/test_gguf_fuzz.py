"""The mutant corpus (``tests/support/gguf_mutants.py``): 10,000 seeded mutants of the real
SmolLM2 header, each read as a file by the real checks (``gguf_check.check_gguf_file``). Each is
refused with ``GgufInvalid`` or accepted, never anything else; every known-bad one (a tensor out
of the file, overflowing dimensions, an unknown type, a misaligned or overlapping offset, a
duplicate tensor, a truncated file, a vocabulary array cut short) is refused. What the checks
accept is loaded by the sandboxed engine's own tests (``accepted_mutant_files``)."""

from __future__ import annotations

import logging
import time
from collections import Counter

import pytest

from shared_schema.errors import GgufInvalid
from shared_schema.gguf_check import check_gguf_file
from tests.support.gguf_mutants import (
    CORPUS_SIZE,
    OPERATORS,
    MutantChecker,
    MutantFile,
    corpus,
    load_base,
    mutant,
)

log = logging.getLogger(__name__)

MUST_REFUSE = {"truncate", "duplicate_tensor", "unknown_type", "offset_out_of_file",
               "offset_misaligned", "offset_overlap", "dims_overflow", "dims_zero_or_many",
               "vocabulary_short"}


@pytest.mark.timeout(240)
def test_every_mutant_is_refused_or_accepted_and_the_known_bad_are_refused() -> None:
    base = load_base()
    outcomes: Counter[tuple[str, str]] = Counter()
    must_refuse_seen: Counter[str] = Counter()
    wrongly_accepted: list[str] = []
    other_errors: list[str] = []
    started = time.perf_counter()
    with MutantChecker(base) as checker:
        for candidate in corpus(base, CORPUS_SIZE):
            try:
                checker.check(candidate)
            except GgufInvalid:
                outcomes[(candidate.kind, "refused")] += 1
            except Exception as exc:  # the finding: anything but GgufInvalid
                other_errors.append(f"#{candidate.index} {candidate.kind}: {exc!r}")
                continue
            else:
                outcomes[(candidate.kind, "accepted")] += 1
                if candidate.must_refuse:
                    wrongly_accepted.append(f"#{candidate.index} {candidate.kind}")
            if candidate.must_refuse:
                must_refuse_seen[candidate.kind] += 1
    elapsed = time.perf_counter() - started

    assert other_errors == []
    assert wrongly_accepted == []
    assert sum(outcomes.values()) == CORPUS_SIZE
    kinds = {kind for kind, _ in outcomes}
    assert kinds == set(OPERATORS)  # every operator made mutants
    for kind in MUST_REFUSE:
        assert must_refuse_seen[kind] >= 50, kind
        assert outcomes[(kind, "accepted")] == 0, kind
    # Not a corpus that only tests the magic number: the walk reached far into the header.
    assert outcomes[("metadata_value", "accepted")] > 300
    assert outcomes[("swap_tensors", "accepted")] > 300  # a reordered table is still sound
    assert outcomes[("bit_flips", "refused")] > 500
    log.info("%d mutants in %.1f s (%.2f ms each, %d vocabularies compared instead of walked); "
             "accepted: %d", CORPUS_SIZE, elapsed, 1000 * elapsed / CORPUS_SIZE,
             checker.memo.hits,
             sum(n for (_, outcome), n in outcomes.items() if outcome == "accepted"))
    assert elapsed < 120, f"the corpus took {elapsed:.0f} s"


def test_the_corpus_is_the_same_every_time() -> None:
    base = load_base()
    for index in (0, 1, 4242, CORPUS_SIZE - 1):
        assert mutant(base, index) == mutant(base, index)
    assert [mutant(base, i).header for i in range(20)] != \
        [mutant(base, i, seed=35).header for i in range(20)]


def test_the_memo_changes_no_answer() -> None:
    """The corpus shares one memo of walked vocabularies; without it every answer is the same
    (300 mutants, each checked both ways)."""
    base = load_base()
    with MutantChecker(base) as checker:
        for candidate in corpus(base, 300):
            answers = []
            for memo in (checker.memo, None):
                handle = MutantFile(candidate, checker.data, base.data_start)
                try:
                    header = check_gguf_file(handle, "m", memo=memo)
                    answers.append(("accepted", len(header.tensors), header.data_start))
                except GgufInvalid as exc:
                    answers.append(("refused", str(exc), 0))
            assert answers[0] == answers[1], candidate.index
