"""The queen's bounds on an answer's tokens (pure), and the books that apply them."""

from __future__ import annotations

from queen_server.swarm.jobs import Credit
from queen_server.swarm.metering import (
    END_TOKENS,
    PER_INPUT_TOKENS,
    PER_MESSAGE_TOKENS,
    Meter,
    stop_bytes,
    utf8_bytes,
)
from queen_server.swarm.relay import Delivered
from shared_schema import Usage


def usage(prompt: int, completion: int) -> Usage:
    return Usage(prompt_tokens=prompt, completion_tokens=completion,
                 total_tokens=prompt + completion)


def test_bytes_count_multibyte_text_and_lone_surrogates() -> None:
    assert utf8_bytes("hello") == 5
    assert utf8_bytes("héllo") == 6
    assert utf8_bytes("🐝") == 4  # one character, up to four byte-fallback tokens
    assert utf8_bytes("\ud800") == 3  # JSON can carry a lone surrogate; it must not raise


def test_the_longest_stop_string_is_the_end_allowance() -> None:
    assert stop_bytes(None) == 0
    assert stop_bytes("###") == 3
    assert stop_bytes(["a", "ééé", 7]) == 6


def test_a_chat_prompt_is_bounded_by_its_bytes_framing_and_template_allowance() -> None:
    request = {"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "name": "ann", "content": [{"type": "text", "text": "héllo"}]},
    ], "stop": ["\n\n", "END"]}
    meter = Meter.for_chat(request, template_allowance=64)
    framing = len("system") + len("user") + len("ann") + 2 * PER_MESSAGE_TOKENS
    assert meter.prompt_bound == len("Be brief.") + 6 + framing + 64
    assert meter.prompt_estimate == len("Be brief.") + len("héllo") + 2 * PER_MESSAGE_TOKENS
    assert meter.completion_bound(10) == 10 + 3 + END_TOKENS


def test_embeddings_are_bounded_by_bytes_or_by_the_token_ids_given() -> None:
    assert Meter.for_embeddings({"input": "abc"}).prompt_bound == 3 + PER_INPUT_TOKENS
    assert Meter.for_embeddings({"input": ["ab", "c"]}).prompt_bound == 3 + 2 * PER_INPUT_TOKENS
    assert Meter.for_embeddings({"input": [1, 2, 3]}).prompt_bound == 3 + PER_INPUT_TOKENS
    assert Meter.for_embeddings({"input": [[1, 2], [3]]}).prompt_bound == 3 + 2 * PER_INPUT_TOKENS
    assert Meter.for_embeddings({"input": "abc"}).completion_bound(0) == 0


def test_a_claim_is_believed_only_below_the_bound() -> None:
    meter = Meter(prompt_bound=100, prompt_estimate=20, end_allowance=1)
    assert meter.bill(usage(1_000_000, 1_000_000), delivered_bytes=11) == usage(100, 12)
    assert meter.bill(usage(7, 3), delivered_bytes=11) == usage(7, 3)
    assert meter.bill(usage(2**62, 2**62), delivered_bytes=0) == usage(100, 1)


def test_a_lost_workers_checkpoint_claims_are_bounded_by_its_text() -> None:
    """A worker lost mid-answer is credited at most the bytes it delivered, whatever its
    checkpoints claimed; the twin that ends the answer is bounded by its own text."""
    meter = Meter(prompt_bound=50, prompt_estimate=10, end_allowance=1)
    books = Delivered(meter)
    checkpoint = {"choices": [{"index": 0, "delta": {"content": "abc"}}],
                  "usage": {"completion_tokens": 900}}
    books.take(checkpoint)
    books.lost(Credit("liar"))
    assert books.parts[0].completion_tokens == 3
    books.take({"choices": [{"index": 0, "delta": {"content": "de"}}]})
    parts, billed = books.done(Credit("twin"), usage(10_000, 10_000))
    assert [(p.worker_key, p.prompt_tokens, p.completion_tokens) for p in parts] == [
        ("liar", 50, 3), ("twin", 0, 3)]
    assert billed == usage(50, 6)
    assert books.last_worker_usage(usage(10_000, 10_000), parts) == usage(53, 3)


def test_a_whole_answer_is_bounded_by_its_result_text_not_its_checkpoints() -> None:
    books = Delivered(Meter(prompt_bound=50, prompt_estimate=10, end_allowance=1))
    books.take({"choices": [{"index": 0, "delta": {"content": "ab"}}],
                "usage": {"completion_tokens": 2}})
    parts, billed = books.done(Credit("w"), usage(9, 500), final_text="abcdefgh")
    assert billed == usage(9, 9)
    assert parts[0].completion_tokens == 9


def test_a_client_that_left_pays_the_estimated_prompt_but_a_failed_answer_does_not() -> None:
    books = Delivered(Meter(prompt_bound=50, prompt_estimate=13, end_allowance=1))
    books.take({"choices": [{"index": 0, "delta": {"content": "echo:"}}]})
    [left] = books.broken(Credit("w"), client_left=True)
    assert (left.prompt_tokens, left.completion_tokens, left.completed) == (13, 1, False)
    [failed] = books.broken(Credit("w"))
    assert (failed.prompt_tokens, failed.completion_tokens) == (0, 1)
