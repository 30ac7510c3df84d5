"""The engine's pure deciding parts: stop strings and UTF-8 assembly, request reading, seeds,
log probabilities."""

from __future__ import annotations

import math

import numpy as np
import pytest

from desktop_worker.engine.grammar import bounded_integers
from desktop_worker.engine.logprobs import log_softmax, top_indices
from desktop_worker.engine.settings import (
    RANDOM_SEED,
    choice_seed,
    completion_prompts,
    read_settings,
)
from desktop_worker.engine.text import TextStream, held_back
from desktop_worker.errors import UnsupportedRequest


def feed(stream: TextStream[int], pieces: list[bytes]) -> tuple[str, list[tuple[int, str]], bool]:
    out: list[tuple[int, str]] = []
    stopped = False
    for i, piece in enumerate(pieces):
        released = stream.push(piece, i)
        out.extend(released.tokens)
        stopped = released.stopped
        if stopped:
            break
    if not stopped:
        out.extend(stream.finish().tokens)
    return "".join(text for _, text in out), out, stopped


def test_a_stop_string_split_across_tokens_is_never_sent():
    stream: TextStream[int] = TextStream(("END",))
    assert stream.push(b"hello E", 0).tokens == []  # "E" could start "END": held
    released = stream.push(b"ND more", 1)
    assert released.stopped
    assert released.text == "hello "
    assert released.tokens == [(0, "hello ")]  # the token with the stop in it goes, cut


def test_held_text_goes_out_once_it_cannot_be_a_stop():
    stream: TextStream[int] = TextStream(("END",))
    assert stream.push(b"a E", 0).tokens == []
    released = stream.push(b"X", 1)
    assert released.tokens == [(0, "a E"), (1, "X")]
    assert not released.stopped


def test_a_character_split_across_tokens_belongs_to_the_token_that_completes_it():
    euro = "€".encode()
    text, tokens, stopped = feed(TextStream(()), [b"a" + euro[:1], euro[1:2], euro[2:] + b"b"])
    assert text == "a€b"
    assert [t for _, t in tokens] == ["a", "", "€b"]
    assert not stopped


def test_an_unfinished_character_at_the_end_is_dropped():
    text, _, _ = feed(TextStream(()), [b"ok", "€".encode()[:2]])
    assert text == "ok"


def test_the_first_of_several_stops_ends_the_text_and_texts_join_to_the_content():
    text, tokens, stopped = feed(TextStream(("\n\n", "###")), [b"one", b" two#", b"##", b"x"])
    assert stopped
    assert text == "one two"
    assert "".join(t for _, t in tokens) == text


def test_held_back_is_the_longest_stop_prefix_at_the_end():
    assert held_back("abc", ("cde", "bcx")) == 2
    assert held_back("abc", ("zzz",)) == 0
    assert held_back("", ("a",)) == 0


def test_settings_fill_in_openais_defaults():
    settings = read_settings({"messages": []})
    assert (settings.temperature, settings.top_p, settings.n, settings.logprobs) == (
        1.0, 1.0, 1, False)
    assert settings.max_tokens is None
    assert settings.stops == ()
    full = read_settings({"temperature": 0, "max_completion_tokens": 5, "max_tokens": 9,
                          "stop": "x", "logit_bias": {"12": -100}, "n": 3, "logprobs": True,
                          "top_logprobs": 4, "response_format": {"type": "text"}})
    assert full.max_tokens == 5
    assert full.stops == ("x",)
    assert full.logit_bias == {12: -100.0}
    assert full.top_logprobs == 4
    assert full.response_format is None


@pytest.mark.parametrize("bad", [
    {"temperature": 3}, {"top_p": "1"}, {"n": 9}, {"n": 0}, {"stop": ["a"] * 5},
    {"logit_bias": {"x": 1}}, {"logit_bias": {"1": 101}}, {"top_logprobs": 21, "logprobs": True},
    {"logprobs": 3}, {"response_format": {"type": "xml"}}, {"max_tokens": 0},
    {"response_format": {"type": "json_schema", "json_schema": {"schema": []}}},
])
def test_a_bad_value_is_an_invalid_request_naming_it(bad):
    with pytest.raises(UnsupportedRequest):
        read_settings(bad)


def test_a_logit_bias_outside_the_vocabulary_is_refused():
    settings = read_settings({"logit_bias": {"49152": 5}})
    settings.check_vocabulary(49153)
    with pytest.raises(UnsupportedRequest, match="not in this model's vocabulary"):
        settings.check_vocabulary(49152)


def test_each_choice_has_its_own_seed_and_no_seed_is_llamas_random_one():
    assert [choice_seed(7, i) for i in range(3)] == [7, 8, 9]
    assert choice_seed(None, 2) == RANDOM_SEED
    assert choice_seed(-1, 0) == RANDOM_SEED - 1  # never llama.cpp's "random" value
    assert 0 <= choice_seed(2**64 - 1, 5) < 2**32


def test_completion_prompts_are_texts_or_token_lists():
    assert completion_prompts({"prompt": "hi"}) == ["hi"]
    assert completion_prompts({"prompt": [1, 2]}) == [[1, 2]]
    assert completion_prompts({"prompt": ["a", [3]]}) == ["a", [3]]
    for bad in ([], [[]], [True], [1.5], None, [-1]):
        with pytest.raises(UnsupportedRequest):
            completion_prompts({"prompt": bad})


def test_log_softmax_is_a_distribution_and_top_indices_are_sorted():
    logits = np.array([1.0, 3.0, 2.0, 3.0], dtype=np.float32)
    logprobs = log_softmax(logits)
    assert math.isclose(float(np.exp(logprobs).sum()), 1.0, rel_tol=1e-9)
    assert (logprobs <= 0).all()
    assert top_indices(logprobs, 3) == [1, 3, 2]
    assert top_indices(logprobs, 0) == []
    assert top_indices(logprobs, 10) == [1, 3, 2, 0]


def test_small_integer_ranges_become_enums_the_grammar_converter_honours():
    schema = {"type": "object", "properties": {
        "age": {"type": "integer", "minimum": 0, "maximum": 3, "description": "years"},
        "odd": {"type": "integer", "exclusiveMinimum": 1, "exclusiveMaximum": 4.5},
        "open": {"type": "integer", "minimum": 0},
        "huge": {"type": "integer", "minimum": 0, "maximum": 10**6}}}
    props = bounded_integers(schema)["properties"]
    assert props["age"] == {"description": "years", "enum": [0, 1, 2, 3]}
    assert props["odd"] == {"enum": [2, 3, 4]}
    assert props["open"] == schema["properties"]["open"]  # unbounded: left as it is
    assert props["huge"] == schema["properties"]["huge"]  # too many values for an enum
