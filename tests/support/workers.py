"""Scripted workers for tests and benchmarks: real websockets clients speaking the real protocol.

``ScriptedWorker`` does the v1 handshake with its own Ed25519 key and answers each job through
``answer`` (override it, or pick a ``behaviour``). ``LegacyWorker`` speaks the original untyped
messages. Both record what they received, so tests can assert on cancels and job frames.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import orjson
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from desktop_worker.jobs import checkpoint_chunk
from desktop_worker.link.coalesce import DEFAULT_MAX_TOKENS, Coalescer
from shared_schema import (
    CAPABILITY_CONTINUE,
    PROTOCOL_VERSION,
    SUBPROTOCOL,
    Cancel,
    Challenge,
    Chunk,
    Hello,
    Job,
    JobError,
    ModelDescriptor,
    Ping,
    Pong,
    Refused,
    Result,
    Usage,
    Welcome,
    decode,
    encode,
    hello_signing_payload,
    queen_origin,
)

ECHO_MODEL = "test-org/echo-GGUF:Q4_K_M"
ECHO_SHA256 = "5e" * 32  # the model file every continuing scripted worker holds
# The origin a hello is signed for when a test does not say (only a test's fake gate accepts it).
TEST_ORIGIN = "http://queen.test"


def new_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


def pubkey_hex(key: Ed25519PrivateKey) -> str:
    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()


def signed_hello(
    key: Ed25519PrivateKey,
    nonce: str,
    *,
    models: list[ModelDescriptor],
    max_jobs: int = 1,
    ln_url: str | None = None,
    capabilities: list[str] | None = None,
    sign_nonce: str | None = None,
    origin: str = TEST_ORIGIN,
) -> Hello:
    """A hello signed by ``key`` for the queen of ``origin`` (``queen_origin`` of the URL
    dialled: a real queen refuses any other)."""
    pubkey = pubkey_hex(key)
    signature = key.sign(hello_signing_payload(sign_nonce or nonce, pubkey, ln_url,
                                               origin)).hex()
    return Hello(
        protocol=PROTOCOL_VERSION,
        worker_version="scripted-1",
        pubkey=pubkey,
        signature=signature,
        ln_url=ln_url,
        cpu_count=2,
        disk_space=50,
        vram=0,
        models=models,
        capabilities=capabilities or ["chat", "embeddings", "stream"],
        max_jobs=max_jobs,
    )


def last_user_text(request: dict[str, Any]) -> str:
    for message in reversed(request.get("messages") or []):
        if message.get("role") == "user" and isinstance(message.get("content"), str):
            return message["content"]
    return ""


def echo_words(request: dict[str, Any]) -> list[str]:
    """The scripted answer: 'echo:' and the user's words, one token per word."""
    words = ["echo:", *last_user_text(request).split()]
    return [word if i == 0 else " " + word for i, word in enumerate(words)]


def words_done(words: list[str], continuation: str | None) -> int | None:
    """How many of the scripted answer's ``words`` a continuation already holds (0 for none),
    or None when the continuation is not a start of the answer."""
    if not continuation:
        return 0
    return next((k for k in range(len(words) + 1) if "".join(words[:k]) == continuation), None)


def fake_embedding(text: str) -> list[float]:
    return [float(len(text)), 1.0, 0.5, -0.25]


class ScriptedWorker:
    """A protocol-v1 worker whose answers are scripted.

    behaviour: ``echo`` (default), ``die`` (drop the connection when a job arrives), ``hang``
    (never answer; record the cancel), ``error`` (a retryable error), ``fatal`` (a non-retryable
    error), ``gated`` (stream the first chunk, or for a plain answer nothing, then wait for
    ``release`` before the rest), ``die_mid`` (stream ``die_after`` chunks, wait for
    ``release``, then drop the connection; a plain answer sends them as one checkpoint),
    ``fail_mid`` (as ``die_mid``, but then a retryable error, as a model group's head that lost
    a member sends; the worker stays).

    ``continues=True`` makes it a twin for failover: it holds the model file ``sha256``
    (default ``ECHO_SHA256``), has the ``continue`` capability, and answers a job with a
    ``continuation`` with only the rest of the echo (an error if the text is not a prefix of it).

    A stream goes through the real worker's ``Coalescer``: its tokens are made at once, faster
    than any frame goes out, so after the first (role) chunk they go out joined, up to
    ``join_tokens`` a frame (``Chunk.tokens``), when the queen's welcome allows it
    (``join_tokens=1``: one frame per token, as an older worker sends). A pause of a
    ``gated`` or ``die_mid`` worker first sends everything made so far.
    """

    def __init__(
        self,
        ws_url: str,
        *,
        models: list[str] | None = None,
        loaded: bool = True,
        max_jobs: int = 1,
        behaviour: str = "echo",
        key: Ed25519PrivateKey | None = None,
        ln_url: str | None = None,
        answer_pongs: bool = True,
        tokens_per_answer: int | None = None,
        continues: bool = False,
        sha256: str | None = None,
        die_after: int = 2,
        claims: Usage | None = None,
        origin: str | None = None,
        capabilities: list[str] | None = None,
        join_tokens: int = DEFAULT_MAX_TOKENS,
        source_host: str | None = None,
    ) -> None:
        self.ws_url = ws_url
        self.join_tokens = join_tokens
        # The loopback address it dials from (127.0.N.x: another /24 for the queen).
        self.source_host = source_host
        # Streamed text: its chunk frames and the tokens they carried (tokens per frame).
        self.frames_sent = 0
        self.tokens_sent = 0
        self.extra_capabilities = capabilities or []  # e.g. "grammar", as a newer worker's
        # What its hello is signed for: the origin of the URL it dials, unless a test says.
        self.origin = origin or queen_origin(ws_url)
        self.claims = claims  # a lying worker: the usage it reports, whatever it did
        self.key = key or new_key()
        self.pubkey = pubkey_hex(self.key)
        self.models = [
            ModelDescriptor(name=name, size_bytes=1000, parameter_count=135_000_000, loaded=loaded,
                            sha256=sha256 or (ECHO_SHA256 if continues else None))
            for name in (models if models is not None else [ECHO_MODEL])
        ]
        self.continues = continues
        self.die_after = die_after
        self.max_jobs = max_jobs
        self.behaviour = behaviour
        self.ln_url = ln_url
        self.answer_pongs = answer_pongs
        self.tokens_per_answer = tokens_per_answer
        self.jobs: list[Job] = []
        self.cancels: list[Cancel] = []
        self.cancelled = asyncio.Event()
        self.answer_cancels = True  # a worker that ignores cancels sets this False
        self.errors: list[JobError] = []  # error frames the queen sent back
        self.told = asyncio.Event()
        self.job_arrived = asyncio.Event()
        self.release = asyncio.Event()
        self.closed = asyncio.Event()
        self.welcome: Welcome | None = None
        self.close_code: int | None = None
        self._ws: ClientConnection | None = None
        self._reader: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> ScriptedWorker:
        source = {"local_addr": (self.source_host, 0)} if self.source_host else {}
        self._ws = await connect(self.ws_url, compression=None, proxy=None, ping_interval=None,
                                 max_size=None, subprotocols=[SUBPROTOCOL], **source)
        challenge = decode(await self._ws.recv())
        assert isinstance(challenge, Challenge), challenge
        await self._ws.send(encode(self.hello(challenge.nonce)))
        reply = decode(await self._ws.recv())
        if isinstance(reply, Refused):
            raise RuntimeError(f"refused: {reply.code}: {reply.reason}")
        assert isinstance(reply, Welcome), reply
        self.welcome = reply
        self._reader = asyncio.create_task(self._read())
        return self

    def hello(self, nonce: str) -> Hello:
        """The signed hello this worker sends (subclasses add hardware facts)."""
        capabilities = ["chat", "embeddings", "stream", *self.extra_capabilities]
        if self.continues:
            capabilities.append(CAPABILITY_CONTINUE)
        return signed_hello(self.key, nonce, models=self.models, max_jobs=self.max_jobs,
                            ln_url=self.ln_url, capabilities=capabilities, origin=self.origin)

    async def stop(self) -> None:
        if self._ws is not None:
            await self._ws.close()
        if self._reader is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        for task in list(self._tasks):
            task.cancel()

    async def send_raw(self, frame: str | bytes) -> None:
        assert self._ws is not None
        await self._ws.send(frame)

    async def _read(self) -> None:
        assert self._ws is not None
        try:
            async for frame in self._ws:
                message = decode(frame)
                if isinstance(message, Job):
                    self.jobs.append(message)
                    self.job_arrived.set()
                    task = asyncio.create_task(self._run(message))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
                elif isinstance(message, Cancel):
                    self.cancels.append(message)
                    self.cancelled.set()
                    if self.answer_cancels:
                        await self._send(JobError(id=message.id, code="cancelled",
                                                  message="cancelled by the queen"))
                elif isinstance(message, JobError):  # the queen's answer to a bad frame
                    self.errors.append(message)
                    self.told.set()
                elif isinstance(message, Ping) and self.answer_pongs:
                    await self._send(Pong(ts=message.ts))
        except ConnectionClosed:
            pass
        finally:
            self.close_code = self._ws.close_code
            self.closed.set()

    async def _send(self, message: Any) -> None:
        assert self._ws is not None
        with contextlib.suppress(ConnectionClosed):
            await self._ws.send(encode(message))

    async def _run(self, job: Job) -> None:
        behaviour = self.behaviour
        if behaviour == "die":
            assert self._ws is not None
            await self._ws.close()
            return
        if behaviour == "hang":
            return
        if behaviour in {"error", "fatal"}:
            await self._send(JobError(id=job.id, code="engine_failed", message="scripted failure",
                                      retryable=behaviour == "error"))
            return
        if job.openai_url == "/v1/embeddings":
            await self._send(self._embed(job))
            return
        words = echo_words(job.openai_req)
        if self.tokens_per_answer is not None:
            words = [" tok"] * self.tokens_per_answer
        prompt = 7
        if job.continuation is not None:
            done = words_done(words, job.continuation)
            if done is None:
                await self._send(JobError(id=job.id, code="bad_continuation", retryable=False,
                                          message=f"{job.continuation!r} is not my answer's start"))
                return
            words, prompt = words[done:], prompt + done
        n = int(job.openai_req.get("n") or 1)  # plain answers only: n choices, each the echo
        usage = self.claims or Usage(prompt_tokens=prompt, completion_tokens=n * len(words),
                                     total_tokens=prompt + n * len(words))
        if not job.openai_req.get("stream"):
            if behaviour == "gated":
                await self.release.wait()
            if behaviour == "die_mid":  # a checkpoint of the text so far, as a real worker's
                await self._send(Chunk(id=job.id, seq=0, data=checkpoint_chunk(
                    words[:self.die_after])))
                await self.release.wait()
                assert self._ws is not None
                self._ws.transport.abort()
                return
            data = {"choices": [{"index": i, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": "".join(words)}}
                                for i in range(n)]}
            await self._send(Result(id=job.id, data=data, usage=usage))
            return
        outbox = Coalescer(self.chunk_tokens())
        sent = 0

        async def flush() -> None:
            nonlocal sent
            while (frame := outbox.next_frame()) is not None:
                data, tokens = frame
                await self._send(Chunk(id=job.id, seq=sent, data=data, tokens=tokens))
                sent += 1
                if data["choices"][0]["delta"].get("content"):
                    self.frames_sent += 1
                    self.tokens_sent += tokens

        for seq, word in enumerate(words):
            delta: dict[str, Any] = {"content": word}
            if seq == 0:
                delta["role"] = "assistant"
            outbox.add({"choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
            if seq == 0 and behaviour == "gated":
                await flush()
                await self.release.wait()
            if seq + 1 == self.die_after and behaviour in {"die_mid", "fail_mid"}:
                await flush()
                await self.release.wait()
                if behaviour == "fail_mid":
                    await self._send(JobError(id=job.id, code="engine_error", retryable=True,
                                              message="the group's head process ended"))
                    return
                assert self._ws is not None
                self._ws.transport.abort()  # gone, as a sleeping laptop is: no close frame
                return
        outbox.add({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
        await flush()
        await self._send(Result(id=job.id, usage=usage))

    def chunk_tokens(self) -> int:
        """The most tokens one chunk frame joins: ``join_tokens``, within what the queen's
        welcome allows (none from a queen that does not say)."""
        allowed = self.welcome.chunk_tokens if self.welcome is not None else None
        return max(1, min(self.join_tokens, allowed or 1))

    def _embed(self, job: Job) -> Result:
        inputs = job.openai_req["input"]
        texts = [inputs] if isinstance(inputs, str) else [str(item) for item in inputs]
        data = {"object": "list", "data": [
            {"object": "embedding", "index": i, "embedding": fake_embedding(text)}
            for i, text in enumerate(texts)]}
        tokens = sum(len(text.split()) for text in texts)
        return Result(id=job.id, data=data, usage=Usage(prompt_tokens=tokens, total_tokens=tokens))


class LegacyWorker:
    """A worker from before protocol v1: a bare registration, bare requests, bare answers.

    ``REGISTRATION`` is the seed wiki's message (the fixture); ``WORKERBEE_REGISTRATION`` is what
    the real GPUtopia workerbee sends (``ConnectMessage.model_dump_json()``, every field in its
    order): ``vram`` is psutil's available RAM in bytes, ``disk_space`` MB, GPU memory NVML's
    float MiB, and the newer fields of its later versions.
    """

    REGISTRATION: dict[str, Any] = {
        "ln_url": "http://example.com", "cpu_count": 8, "disk_space": 500, "vram": 2048,
        "nv_gpu_count": 1, "nv_driver_version": "465.19.01",
        "nv_gpus": [{"name": "NVIDIA Tesla K80", "memory": 11441}],
    }
    WORKERBEE_VRAM_BYTES = 27_917_287_424  # 26 GiB of free RAM: 26,624 MB
    WORKERBEE_REGISTRATION: dict[str, Any] = {
        "worker_version": "0.2.4",
        "capabilities": ["llama-infer", "llama-fine-tune"],
        "pubkey": "A1R0l8yq9dZ0bX3y0kq2cJ7vT9nC4m5W2pQ8sH6eL1fG",
        "slug": "",
        "sig": "MEUCIQDx3c1Qn0yq8b2rj9Xc6m0bPz4X7o1vQw2k5sL8eT3hYwIgV9m2cT6n1rQ5kX8w3pZ0yB7"
               "uJ4fH2dS6aG1eL9oMn0=",
        "ln_url": "worker-bob@getalby.com",
        "ln_address": "worker-bob@getalby.com",
        "auth_key": "",
        "cpu_count": 16,
        "disk_space": 412_873,
        "vram": WORKERBEE_VRAM_BYTES,
        "nv_gpu_count": 1,
        "nv_driver_version": "535.129.03",
        "nv_gpus": [{"name": "NVIDIA GeForce RTX 3090",
                     "uuid": "GPU-5c2d8f4e-1b7a-3c9e-8d6f-0a2b4c6e8f10",
                     "memory": 24576.0, "clock": 210, "clock_unit": "MHz"}],
        "cl_driver_version": None,
        "cl_gpus": [],
        "web_gpus": [],
        "models": ["TheBloke/Mistral-7B-Instruct-v0.1-GGUF:Q4_K_M"],
    }
    ANSWER = {
        "choices": [{"message": {"role": "assistant",
                                 "content": "The Los Angeles Dodgers won the World Series "
                                            "in 2020."},
                     "finish_reason": "stop", "index": 0}],
        "usage": {"prompt_tokens": 56, "completion_tokens": 31, "total_tokens": 87},
    }

    def __init__(
        self,
        ws_url: str,
        answer: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
        *,
        registration: dict[str, Any] | None = None,
    ) -> None:
        self.ws_url = ws_url
        self.answer = answer or (lambda _request: self.ANSWER)
        self.registration = self.REGISTRATION if registration is None else registration
        self.requests: list[dict[str, Any]] = []
        self._ws: ClientConnection | None = None
        self._reader: asyncio.Task[None] | None = None

    async def start(self) -> LegacyWorker:
        self._ws = await connect(self.ws_url, compression=None, proxy=None)
        await self._ws.send(orjson.dumps(self.registration).decode())
        self._reader = asyncio.create_task(self._read())
        return self

    async def _read(self) -> None:
        assert self._ws is not None
        with contextlib.suppress(ConnectionClosed):
            async for frame in self._ws:
                request = orjson.loads(frame)
                self.requests.append(request)
                await self._ws.send(orjson.dumps(self.answer(request)).decode())

    async def stop(self) -> None:
        if self._ws is not None:
            await self._ws.close()
        if self._reader is not None:
            await self._reader
