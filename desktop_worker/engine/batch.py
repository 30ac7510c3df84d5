"""Continuous batching (issue 36): one llama.cpp context serving many sequences, one
``llama_decode`` per step for all of them.

``BatchEngine`` holds the jobs of one loaded model. ``submit`` turns a job into its choices
(``generation.Choice``: prompt by prompt, ``n`` each), which wait for a free slot (a llama.cpp
sequence id, ``engine.slots``). Each ``step`` decodes the next token of every running choice
in one batch, then the prompts still being read, in order of arrival, up to ``chunk_tokens``,
each chunk in a decode of its own (so a long prompt joins in chunks and never stalls the
running streams by more than one chunk per step; with nothing running, a prompt reads up to
the whole batch at once). After each decode, every choice whose logits came out samples its
token (its own sampler chain, grammar,
seed and stop strings) and its chunks go out as events. A choice that ends, and every choice
of a cancelled job, leaves its slot at once; the slot keeps the cells it computed for the next
prompt of the same scope that starts the same way (``slots.plan_reuse``), until the cache
needs the room. A job's failure (a grammar llama.cpp rejects, a sampler error) ends that job
alone; the others go on.

Blocking and single-threaded: the engine child's main thread drives it (``engine_child``), and
``LlamaContext.stream`` drives it for one job in this process (the engine's own tests).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import llama_cpp

from desktop_worker.engine.generation import Choice, Counts, Pieces, Prompt, job_choices
from desktop_worker.engine.settings import GenerationSettings
from desktop_worker.engine.slots import Slot, evictable, plan_reuse
from desktop_worker.errors import EngineError, UnsupportedRequest

log = logging.getLogger(__name__)

CHUNK_TOKENS = 256  # prompt tokens read per step while other sequences are generating

EventKind = Literal["chunk", "done", "failed"]


@dataclass(frozen=True, slots=True)
class Event:
    """What a step produced for one job: a chunk, its end (``data``: its usage) or its
    failure (``error``)."""

    kind: EventKind
    job: int
    data: dict[str, Any] | None = None
    error: Exception | None = None


@dataclass(eq=False, slots=True)
class _Sequence:
    job: _Job
    choice: Choice
    tokens: list[int]  # the prompt
    leader: _Sequence | None = None  # the job's first choice of the same prompt
    slot: Slot | None = None
    next_token: int | None = None  # sampled, to be evaluated next step

    @property
    def evaluated(self) -> int:
        return len(self.slot.tokens) if self.slot is not None else 0


@dataclass(eq=False, slots=True)
class _Job:
    id: int
    scope: str
    prompt_tokens: int = 0
    sequences: list[_Sequence] = field(default_factory=list)


@dataclass(slots=True)
class _Entry:
    """One sequence's tokens in a batch; ``output``: the batch index of its logits, if any."""

    sequence: _Sequence
    tokens: list[int]
    position: int
    output: int | None


class BatchEngine:
    """The running jobs of one model on one context of ``len(slots)`` sequences."""

    def __init__(self, ctx: Any, *, vocab: llama_cpp.llama_vocab_p, n_vocab: int,
                 n_ctx_seq: int, slots: int, n_batch: int, pieces: Pieces,
                 chunk_tokens: int = CHUNK_TOKENS) -> None:
        """``ctx``: llama-cpp-python's context wrapper (its ``ctx`` and ``memory``), of at
        least ``slots`` sequences; ``n_ctx_seq``: the context one sequence may fill."""
        self._ctx = ctx
        self._vocab = vocab
        self._n_vocab = n_vocab
        self.n_ctx_seq = n_ctx_seq
        self.n_batch = n_batch
        self.chunk_tokens = max(1, min(chunk_tokens, n_batch - slots))
        self._pieces = pieces
        self.slots = [Slot(seq_id) for seq_id in range(slots)]
        self._jobs: dict[int, _Job] = {}
        self._waiting: list[_Sequence] = []
        self._running: list[_Sequence] = []
        self._batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
        self._submitted = 0
        self.decoded_tokens = 0  # counters for the app's and the benchmarks' figures
        self.generated_tokens = 0

    # --- jobs -----------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        return bool(self._jobs)

    @property
    def running(self) -> int:
        return len(self._running)

    def submit(self, job: int, prompts: Sequence[Prompt], settings: GenerationSettings,
               grammar: str | None, scope: str | None = None) -> None:
        """Queue a job's choices; ``UnsupportedRequest`` (and nothing queued) when it cannot
        be served here. ``scope``: whose cached prefixes it may reuse (None: only its own)."""
        if job in self._jobs:
            raise EngineError(f"job {job} is already running")
        choices = job_choices(prompts, settings, grammar, vocab=self._vocab,
                              n_vocab=self._n_vocab, n_ctx=self.n_ctx_seq,
                              pieces=self._pieces)
        self._submitted += 1  # a job with no scope shares its prompt with its own choices only
        record = _Job(job, scope if scope is not None else f"job {self._submitted}")
        record.prompt_tokens = sum(len(prompt.tokens) for prompt in prompts)
        leaders: dict[int, _Sequence] = {}
        for choice in choices:
            prompt_index = choice.index // settings.n
            sequence = _Sequence(record, choice, choice.prompt.tokens,
                                 leader=leaders.get(prompt_index))
            leaders.setdefault(prompt_index, sequence)
            record.sequences.append(sequence)
        self._jobs[job] = record
        self._waiting.extend(record.sequences)

    def cancel(self, job: int) -> list[Event]:
        """End a job now (its done event, with what it counted so far); nothing if it ended."""
        record = self._jobs.get(job)
        if record is None:
            return []
        self._drop(record)
        return [Event("done", job, _usage(record))]

    def abort(self, error: Exception) -> list[Event]:
        """Every job fails with ``error`` (a step that raised: nothing in the cache is trusted)."""
        events = [self._fail(record, error) for record in list(self._jobs.values())]
        for slot in self.slots:
            self._clear(slot)
        return events

    def forget(self) -> None:
        """Every cached prefix is gone (the context's cache was cleared by another user of it:
        a score on a context the engine shares)."""
        for slot in self.slots:
            if not slot.busy:
                slot.tokens = []

    def close(self) -> None:
        for record in list(self._jobs.values()):
            self._drop(record)
        if self._batch is not None:
            llama_cpp.llama_batch_free(self._batch)
            self._batch = None

    def _drop(self, record: _Job) -> None:
        """A job leaves: its choices' slots are free again (keeping what they computed)."""
        self._jobs.pop(record.id, None)
        for sequence in record.sequences:
            if sequence in self._waiting:
                self._waiting.remove(sequence)
            self._release(sequence)

    def _fail(self, record: _Job, error: Exception) -> Event:
        self._drop(record)
        for sequence in record.sequences:  # what a failed step wrote is not trusted again
            if sequence.slot is not None:
                self._clear(sequence.slot)
        return Event("failed", record.id, error=error)

    # --- one step -------------------------------------------------------------------------

    def step(self) -> list[Event]:
        """Admit waiting choices, decode, sample: the events it produced. The running choices'
        next tokens go in one decode; each prompt chunk read in this step in one of its own
        (as it would alone: llama.cpp would otherwise cut a mixed batch into pieces of equal
        length per sequence, and a prompt read in other pieces gives other rounding)."""
        self._admit()
        events: list[Event] = []
        for group in self._plan():
            events.extend(self._run(group))
        return events

    def _run(self, entries: list[_Entry]) -> list[Event]:
        """Decode one group of entries (making room in the cache if it is full) and sample
        the choices whose logits came out, before the next decode replaces them."""
        events: list[Event] = []
        entries = [entry for entry in entries if entry.sequence.job.id in self._jobs]
        while entries and (code := self._decode(entries)) != 0:
            if code == 1 and (victim := evictable(self.slots)) is not None:
                self._clear(victim)  # the cache is full: the oldest free prefix goes
                continue
            # Nothing left to evict (1): the newest job in the group fails and the rest try
            # again; any other code: llama.cpp failed the batch, and its jobs fail.
            if code == 1:
                newest = entries[-1].sequence.job
                events.append(self._fail(newest, UnsupportedRequest(
                    "this worker's context cache is full; try again shortly")))
                entries = self._renumber([e for e in entries if e.sequence.job is not newest])
                continue
            failed = {entry.sequence.job.id: entry.sequence.job for entry in entries}
            for record in failed.values():
                events.append(self._fail(record, EngineError(
                    f"llama.cpp failed to decode a batch (code {code})")))
            return events
        self.decoded_tokens += sum(len(entry.tokens) for entry in entries)
        for entry in entries:
            sequence = entry.sequence
            assert sequence.slot is not None
            sequence.slot.tokens.extend(entry.tokens)
            sequence.next_token = None
            if entry.output is None or sequence.job.id not in self._jobs:
                continue
            events.extend(self._advance(sequence, entry.output))
        return events

    def _advance(self, sequence: _Sequence, output: int) -> list[Event]:
        record = sequence.job
        try:
            chunks, token = sequence.choice.advance(self._ctx.ctx, output)
        except Exception as exc:  # the job's own failure (a sampler, a grammar)
            error = exc if isinstance(exc, UnsupportedRequest | EngineError) else EngineError(
                f"generation failed: {exc}")
            return [self._fail(record, error)]
        events = [Event("chunk", record.id, chunk) for chunk in chunks]
        if token is not None:
            self.generated_tokens += 1
            sequence.next_token = token
            return events
        self._release(sequence)
        if all(s.choice.finished for s in record.sequences):
            self._drop(record)
            events.append(Event("done", record.id, _usage(record)))
        return events

    def _release(self, sequence: _Sequence) -> None:
        """A choice leaves its slot (only while it holds it: once it left, the slot may be
        another choice's)."""
        sequence.choice.close()
        if sequence in self._running:
            self._running.remove(sequence)
            assert sequence.slot is not None
            sequence.slot.busy = False
            sequence.slot.last_used = time.monotonic()

    # --- admission and the batch ----------------------------------------------------------

    def _admit(self) -> None:
        for sequence in list(self._waiting):
            leader = sequence.leader
            if (leader is not None and leader in self._running
                    and leader.evaluated < len(sequence.tokens) - 1):
                continue  # its prompt is being read by the first choice: copy it once read
            if leader is not None and leader.slot is None:
                continue
            reuse = plan_reuse(self.slots, sequence.tokens, sequence.job.scope)
            if reuse is None:
                return
            target = reuse.target
            memory = self._ctx.memory
            if reuse.source is target:
                llama_cpp.llama_memory_seq_rm(memory, target.seq_id, reuse.common, -1)
                del target.tokens[reuse.common:]
            else:
                llama_cpp.llama_memory_seq_rm(memory, target.seq_id, -1, -1)
                target.tokens = []
                if reuse.source is not None:
                    # Each sequence has its own cache: llama.cpp copies a whole one (before the
                    # next decode), and the copy is trimmed to the shared prefix.
                    llama_cpp.llama_memory_seq_cp(memory, reuse.source.seq_id, target.seq_id,
                                                  -1, -1)
                    llama_cpp.llama_memory_seq_rm(memory, target.seq_id, reuse.common, -1)
                    target.tokens = list(reuse.source.tokens[:reuse.common])
            target.busy = True
            target.scope = sequence.job.scope
            sequence.slot = target
            self._waiting.remove(sequence)
            self._running.append(sequence)

    def _plan(self) -> list[list[_Entry]]:
        """This step's decodes: the running choices' tokens together, then each prompt chunk
        on its own, up to ``chunk_tokens`` in all while choices are generating (a whole batch
        when none are)."""
        groups: list[list[_Entry]] = []
        # In order of sequence id: llama.cpp decodes a batch of several sequences' caches in
        # one piece only while their ids run consecutively (its "sequential" split).
        decoding = [_Entry(s, [s.next_token], s.evaluated, None)  # type: ignore[list-item]
                    for s in sorted(self._running, key=_seq_id) if s.next_token is not None]
        if decoding:
            groups.append(decoding)
        budget = min(self.chunk_tokens, self.n_batch) if decoding else self.n_batch
        for sequence in self._running:
            if budget <= 0:
                break
            if sequence.next_token is not None:
                continue
            pending = sequence.tokens[sequence.evaluated:]
            if not pending:
                continue
            take = pending[:budget]
            groups.append([_Entry(sequence, take, sequence.evaluated, None)])
            budget -= len(take)
        return [self._renumber(group) for group in groups]

    @staticmethod
    def _renumber(entries: list[_Entry]) -> list[_Entry]:
        """Each entry's output: the batch index of its last token, when that token ends its
        prompt (or is a generated one): its logits are sampled."""
        index = 0
        for entry in entries:
            index += len(entry.tokens)
            done = entry.position + len(entry.tokens) >= len(entry.sequence.tokens)
            entry.output = index - 1 if done else None
        return entries

    def _decode(self, entries: Sequence[_Entry]) -> int:
        batch = self._batch
        i = 0
        for entry in entries:
            seq_id = entry.sequence.slot.seq_id  # type: ignore[union-attr]
            last = len(entry.tokens) - 1
            for offset, token in enumerate(entry.tokens):
                batch.token[i] = token
                batch.pos[i] = entry.position + offset
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = seq_id
                batch.logits[i] = entry.output is not None and offset == last
                i += 1
        batch.n_tokens = i
        return int(llama_cpp.llama_decode(self._ctx.ctx, batch))

    def _clear(self, slot: Slot) -> None:
        llama_cpp.llama_memory_seq_rm(self._ctx.memory, slot.seq_id, -1, -1)
        slot.tokens = []


def _seq_id(sequence: _Sequence) -> int:
    return sequence.slot.seq_id if sequence.slot is not None else -1


def _usage(record: _Job) -> dict[str, int]:
    """A job's true counts: each prompt once, every choice's sampled tokens (the end of
    generation token not counted)."""
    return Counts(record.prompt_tokens,
                  sum(s.choice.completion_tokens for s in record.sequences)).usage()
