"""One loaded model in llama.cpp: blocking generation (chat and text completions) through its
batch engine, scores and embeddings, with true usage.

Generation runs in ``engine.batch.BatchEngine``: on the model's own context when it serves one
sequence at a time, or on a batched context of ``slots`` sequences beside it (issue 36); the
model's own context then stays for scores (audits). ``submit`` and ``step`` are what the
engine child drives for many jobs at once; ``stream`` runs one job to its end in this process.
Everything here blocks and runs in one thread, never on the event loop.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import llama_cpp
from llama_cpp import Llama
from llama_cpp import _internals as internals
from llama_cpp.llama_chat_format import format_llama2

from desktop_worker.engine.adapters import check_adapter_file
from desktop_worker.engine.batch import BatchEngine, Event
from desktop_worker.engine.chat_template import ChatTemplate
from desktop_worker.engine.constraints import ScoreConstraints
from desktop_worker.engine.generation import Pieces, Prompt
from desktop_worker.engine.grammar import grammar_text
from desktop_worker.engine.scoring import (
    Sampling,
    Score,
    ScoreRequest,
    check_fits,
    end_tokens,
    teacher_forced,
)
from desktop_worker.engine.settings import (
    chat_messages,
    check_token_ids,
    completion_prompts,
    read_settings,
)
from desktop_worker.errors import ModelLoadError, UnsupportedRequest
from desktop_worker.store.gguf_info import check_model_file
from shared_schema.fitting import LoadPlan

log = logging.getLogger(__name__)


def chat_prompt(llama: Llama, messages: list[dict[str, str]], continuation: str | None) -> str:
    """The prompt text of a conversation, ending with the assistant's turn opened, in the
    model's own Jinja2 chat template, rendered in the sandbox of ``engine.chat_template``
    (llama.cpp's Llama-2 format for a model without one, as llama-cpp-python falls back to)."""
    template = llama.metadata.get("tokenizer.chat_template")
    if not template:
        if continuation:
            raise UnsupportedRequest("this model has no chat template in its metadata, so it "
                                     "cannot continue another worker's answer")
        return format_llama2(messages=messages).prompt  # type: ignore[arg-type]
    eos_id, bos_id = llama.token_eos(), llama.token_bos()
    vocab = llama._model
    return ChatTemplate(
        template,
        eos_token=vocab.token_get_text(eos_id) if eos_id != -1 else "",
        bos_token=vocab.token_get_text(bos_id) if bos_id != -1 else "",
    ).render(messages)


class LlamaContext:
    """A model loaded into one llama.cpp context."""

    def __init__(
        self,
        name: str,
        path: Path,
        plan: LoadPlan,
        *,
        n_threads: int | None = None,
        embedding: bool = False,
        tensor_split: tuple[float, ...] | None = None,
        slots: int = 1,
        adapter: Path | None = None,
        adapter_scale: float = 1.0,
    ) -> None:
        """``adapter``: a GGUF LoRA adapter applied to every context of this model at
        ``adapter_scale`` (a fine-tuned model, issue 37), checked by the caller
        (``engine.adapters``); the base's weights stay memory-mapped."""
        self.name = name
        self.plan = plan
        self.embedding = embedding
        self.slots = 1 if embedding else max(1, slots)
        kwargs: dict[str, Any] = {
            "model_path": str(path),
            "n_ctx": plan.n_ctx,
            "n_gpu_layers": plan.n_gpu_layers,
            "n_threads": n_threads,
            "n_threads_batch": n_threads,
            "verbose": False,
        }
        if tensor_split:  # a group's head: the queen's layers per device (groups.layout)
            kwargs["tensor_split"] = list(tensor_split)
        if embedding:
            kwargs.update(embedding=True, pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN)
        try:
            self.llama = Llama(**kwargs)
        except (ValueError, RuntimeError, OSError) as exc:
            raise ModelLoadError(f"llama.cpp could not load {name}: {exc}") from exc
        self._adapter: Any = None
        self.adapter_scale = adapter_scale
        if adapter is not None:
            try:
                self._attach(adapter)
            except ModelLoadError:
                self.llama.close()
                raise
        self.busy = threading.Lock()  # in this process, one job at a time (``stream``)
        self._pieces = Pieces(self.llama._model.vocab)
        self._usage: dict[str, int] = {}
        self._end_tokens: list[int] | None = None
        self._jobs = itertools.count(1)
        self._batch_ctx: Any = None
        self.engine: BatchEngine | None = None
        if not embedding:
            self.engine = self._batch_engine(n_threads)

    def _batch_engine(self, n_threads: int | None) -> BatchEngine:
        """The batch engine: on the model's own context for one sequence, on a new context of
        ``slots`` sequences for more. Each sequence has a cache of its own (llama.cpp's
        non-unified cache): its attention reads its own cells only, in the order it wrote
        them, so a greedy answer is the same token for token whatever runs beside it."""
        llama = self.llama
        ctx = llama._ctx
        n_batch = llama.n_batch
        if self.slots > 1:
            params = llama_cpp.llama_context_default_params()
            for name, _ in params._fields_:
                setattr(params, name, getattr(llama.context_params, name))
            params.n_ctx = self.plan.n_ctx * self.slots
            params.n_seq_max = self.slots
            params.kv_unified = False
            # llama.cpp's "auto" flash attention (on where the devices have it: a CPU does),
            # as llama-server's: its attention over several caches is about a fifth faster.
            # The model's own context keeps llama-cpp-python's default (off), so one job at a
            # time answers exactly as before, and as a group's head does.
            params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO
            n_batch = max(llama.n_batch, 256 + self.slots)
            params.n_batch = n_batch
            params.n_ubatch = min(n_batch, 512)
            try:
                ctx = self._batch_ctx = internals.LlamaContext(
                    model=llama._model, params=params, verbose=False)
            except ValueError as exc:
                raise ModelLoadError(f"llama.cpp could not make a context of {self.slots} "
                                     f"sequences for {self.name}: {exc}") from exc
            if self._adapter is not None:
                self._apply_adapter(ctx.ctx)
        return BatchEngine(ctx, vocab=llama._model.vocab, n_vocab=llama.n_vocab(),
                           n_ctx_seq=llama.n_ctx(), slots=self.slots, n_batch=n_batch,
                           pieces=self._pieces)

    def _attach(self, path: Path) -> None:
        """Load the LoRA adapter at ``path`` onto the model and apply it to the model's own
        context. llama-cpp-python's ``lora_path`` does the same for that one context, but also
        turns memory-mapping off (a leftover from merging adapters into weights); llama.cpp
        applies an adapter per context, so the batched context gets it too (``_batch_engine``)."""
        handle = llama_cpp.llama_adapter_lora_init(self.llama._model.model,
                                                   str(path).encode("utf-8"))
        if not handle:  # llama.cpp logs why (a shape, a name) and returns NULL
            raise ModelLoadError(f"llama.cpp refused the LoRA adapter {Path(path).name} of "
                                 f"{self.name} (not an adapter of this base model)")
        self._adapter = handle
        self.llama._stack.callback(llama_cpp.llama_adapter_lora_free, handle)  # before the model
        self._apply_adapter(self.llama._ctx.ctx)

    def _apply_adapter(self, ctx: Any) -> None:
        adapters = (llama_cpp.llama_adapter_lora_p_ctypes * 1)(self._adapter)
        scales = (ctypes.c_float * 1)(self.adapter_scale)
        if llama_cpp.llama_set_adapters_lora(ctx, adapters, 1, scales):
            raise ModelLoadError(f"llama.cpp could not apply the LoRA adapter of {self.name}")

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        if self._batch_ctx is not None:
            self._batch_ctx.close()
        self.llama.close()

    def submit(self, job: int, kind: str, request: dict[str, Any],
               continuation: str | None = None, scope: str | None = None) -> None:
        """Queue a job in the batch engine (``step`` runs it). ``kind``: "chat" (messages, the
        chat template) or "completion" (raw prompts). With ``continuation`` (assistant text
        another worker already delivered), the model goes on from the end of that text (a
        grammar must accept it first); the chunks carry only the new text, and the
        continuation counts as prompt. ``scope``: whose cached prefixes it may reuse."""
        if self.engine is None:
            raise UnsupportedRequest("this context was loaded for embeddings")
        settings = read_settings(request)
        grammar = grammar_text(settings.response_format)
        if kind == "chat":
            prompts = [self._chat_prompt(request, continuation)]
        else:
            prompts = [Prompt(self._completion_tokens(prompt))
                       for prompt in completion_prompts(request)]
        self.engine.submit(job, prompts, settings, grammar, scope)

    def step(self) -> list[Event]:
        """One step of every running job (``BatchEngine.step``)."""
        assert self.engine is not None
        try:
            return self.engine.step()
        except ValueError as exc:  # llama.cpp's own checks
            raise UnsupportedRequest(str(exc)) from exc

    def stream(
        self,
        kind: str,
        request: dict[str, Any],
        cancel: threading.Event,
        continuation: str | None = None,
        scope: str | None = None,
    ) -> Iterator[dict[str, Any]]:
        """One job to its end in this process (``submit``, then steps): chat.completion.chunk
        dicts as tokens are produced; stops within a token of ``cancel``. After the generator
        ends, ``usage()`` gives the true token counts."""
        job = next(self._jobs)
        self._usage = {}
        self.submit(job, kind, request, continuation, scope)
        assert self.engine is not None
        try:
            while True:
                events = self.engine.cancel(job) if cancel.is_set() else self.step()
                for event in events:
                    if event.kind == "chunk":
                        assert event.data is not None
                        yield event.data
                    elif event.kind == "done":
                        self._usage = event.data or {}
                        return
                    else:
                        assert event.error is not None
                        raise event.error
        finally:
            self.engine.cancel(job)  # a consumer that stopped early: the job leaves

    def score(self, job: ScoreRequest, cancel: threading.Event) -> Score | None:
        """The scores of ``job.answer`` as the continuation of the prompt generation would
        build for ``job.request`` (see ``engine.scoring``), with the sampled scores when the
        request's temperature (as this worker's own generation reads it) is above 0; ``None``
        if cancelled."""
        llama = self.llama
        settings = read_settings(job.request)
        settings.check_vocabulary(llama.n_vocab())
        if job.kind == "chat":  # a prefix: the assistant's text so far, as a continuation
            built = self._chat_prompt(job.request, job.prefix or None)
            prompt, delivered = built.tokens, built.delivered
        else:
            prompts = completion_prompts(job.request)
            if len(prompts) != 1:
                raise UnsupportedRequest(f"a score job scores one prompt's answer; this request "
                                         f"has {len(prompts)} prompts")
            delivered = (llama.tokenize(job.prefix.encode("utf-8"), add_bos=False,
                                        special=False) if job.prefix else [])
            prompt = self._completion_tokens(prompts[0]) + delivered
        answer = llama.tokenize(job.answer.encode("utf-8"), add_bos=False, special=False)
        check_fits(len(prompt), len(answer), llama.n_ctx())
        if self._end_tokens is None:
            self._end_tokens = end_tokens(llama)
        sampling = (Sampling(settings.temperature, settings.top_p)
                    if settings.temperature > 0 else None)
        constraints = ScoreConstraints(settings, llama._model.vocab, llama.n_vocab(),
                                       grammar_text(settings.response_format))
        try:
            constraints.continue_from(delivered)
            return teacher_forced(llama, prompt, answer, constraints, cancel,
                                  self._end_tokens, sampling)
        finally:
            constraints.close()
            if self.engine is not None and self._batch_ctx is None:
                self.engine.forget()  # the shared context's cache was cleared

    def _chat_prompt(self, request: dict[str, Any], continuation: str | None) -> Prompt:
        llama = self.llama
        text = chat_prompt(llama, chat_messages(request), continuation)
        tokens = llama.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        delivered = (llama.tokenize(continuation.encode("utf-8"), add_bos=False, special=False)
                     if continuation else [])
        return Prompt(tokens + delivered, delivered)

    def _completion_tokens(self, prompt: str | list[int]) -> list[int]:
        """A raw prompt's tokens: text with BOS (when the model adds one) as llama.cpp's own
        completion reads it; token ids as they are."""
        llama = self.llama
        if isinstance(prompt, list):
            return check_token_ids(prompt, llama.n_vocab(), "the prompt")
        tokens = llama.tokenize(prompt.encode("utf-8"), add_bos=True, special=True)
        if not tokens and llama.token_bos() != -1:
            tokens = [llama.token_bos()]
        if not tokens:
            raise UnsupportedRequest("the prompt is empty")
        return tokens

    def usage(self) -> dict[str, int]:
        return self._usage

    def embed(self, inputs: list[str] | list[list[int]]) -> tuple[list[list[float]], int]:
        """One mean-pooled vector per input (texts, or token-id lists), and the number of
        tokens read."""
        if not self.embedding:
            raise UnsupportedRequest("this context was not loaded for embeddings")
        try:
            if inputs and all(isinstance(item, list) for item in inputs):
                return self._embed_tokens(inputs)  # type: ignore[arg-type]
            vectors, tokens = self.llama.embed(inputs, return_count=True)  # type: ignore[arg-type]
        except (ValueError, RuntimeError) as exc:
            raise UnsupportedRequest(f"embedding failed: {exc}") from exc
        return [list(map(float, vector)) for vector in vectors], int(tokens)

    def _embed_tokens(self, inputs: list[list[int]]) -> tuple[list[list[float]], int]:
        """``Llama.embed`` for token ids (it only takes text): the same batching, one sequence
        per input, mean-pooled by the context."""
        llama = self.llama
        n_batch, n_embd, n_vocab = llama.n_batch, llama.n_embd(), llama.n_vocab()
        n_seq_max = llama.context_params.n_seq_max
        for tokens in inputs:
            if not tokens:
                raise UnsupportedRequest("an embeddings input is empty")
            check_token_ids(tokens, n_vocab, "an embeddings input")
            if len(tokens) > n_batch:
                raise UnsupportedRequest(f"an embeddings input is {len(tokens)} tokens; this "
                                         f"worker embeds at most {n_batch} at once")
        vectors: list[list[float]] = []

        def decode(count: int) -> None:
            llama._ctx.kv_cache_clear()
            llama._ctx.decode(llama._batch)
            llama._batch.reset()
            for seq in range(count):
                pointer = llama_cpp.llama_get_embeddings_seq(llama._ctx.ctx, seq)
                vectors.append([float(x) for x in pointer[:n_embd]])

        llama._batch.reset()
        seqs = used = 0
        try:
            for tokens in inputs:
                if used + len(tokens) > n_batch or seqs >= n_seq_max:
                    decode(seqs)
                    seqs = used = 0
                llama._batch.add_sequence(tokens, seqs, True)
                seqs += 1
                used += len(tokens)
            decode(seqs)
        finally:
            llama._ctx.kv_cache_clear()
            llama.reset()
        return vectors, sum(len(tokens) for tokens in inputs)


def check_before_load(path: str, adapter: str | None = None) -> None:
    """Refuse a model file whose header or tensor table is not sound (``InvalidModelFile``,
    from ``store.gguf_info.check_model_file``: every part of it), and an ``adapter`` that is
    not a LoRA adapter of it (``InvalidAdapter``, ``engine.adapters``), before llama.cpp opens
    them (issues 34, 37). It runs in the engine child, inside the sandbox, like the load
    itself: the files may have changed since the worker read them."""
    check_model_file(Path(path))
    if adapter is not None:
        check_adapter_file(Path(adapter), Path(path))


def llama_context(model: Any, plan: LoadPlan, n_threads: int | None,
                  embedding: bool, slots: int = 1) -> LlamaContext:
    """A context in this process: what an engine child makes, and what the benchmarks and
    the engine's own tests compare against. The worker's pool makes its contexts in engine
    children (``sandbox.context.SandboxedContexts``)."""
    adapter = getattr(model, "adapter", None)  # a fine-tuned model (``pool.AdaptedModel``)
    return LlamaContext(model.name, model.path, plan, n_threads=n_threads, embedding=embedding,
                        slots=slots, adapter=adapter.path if adapter else None,
                        adapter_scale=adapter.scale if adapter else 1.0)
