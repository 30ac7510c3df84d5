"""Every error the worker raises. Third-party errors are translated at the boundary
(``raise ... from exc``) so callers (the CLI, the GUI, the link) handle only these."""

from __future__ import annotations

from collections.abc import Sequence


class WorkerError(Exception):
    """Base class for the worker's errors. ``str(error)`` is a message fit for the owner."""


# --- hardware -----------------------------------------------------------------------------------


class DetectionError(WorkerError):
    """A hardware probe failed in an unexpected way (a missing driver is not an error)."""


# --- model names and the store ------------------------------------------------------------------


class ModelStoreError(WorkerError):
    """Base class for model store errors."""


class InvalidModelName(ModelStoreError):
    """A model name is not of the form ``hf-user/hf-repo:filter``."""


class NoMatchingFile(ModelStoreError):
    """The filter matched no ``.gguf`` file in the repo."""

    def __init__(self, message: str, candidates: Sequence[str]) -> None:
        super().__init__(message)
        self.candidates = list(candidates)


class AmbiguousFilter(ModelStoreError):
    """The filter matched several ``.gguf`` files (or split groups) in the repo."""

    def __init__(self, message: str, candidates: Sequence[str]) -> None:
        super().__init__(message)
        self.candidates = list(candidates)


class RepoNotFound(ModelStoreError):
    pass


class GatedRepo(ModelStoreError):
    """The repo needs accepted terms or a token (``HF_TOKEN``)."""


class RemoteFileNotFound(ModelStoreError):
    pass


class HubOffline(ModelStoreError):
    """The hub cannot be reached (or offline mode is on) and the model is not cached."""


class HubError(ModelStoreError):
    """Any other failure talking to the hub."""


class ChecksumMismatch(HubError):
    """A downloaded file is not the one named: its sha256 differs from the hub's or from the
    one the queen pinned (issue 17). The file was deleted."""


class InsufficientDisk(ModelStoreError):
    """The model would not fit on the disk (or under the quota)."""


class DownloadCancelled(ModelStoreError):
    """The download was cancelled; the partial file is kept so the next pull resumes."""


class ModelNotCached(ModelStoreError):
    """The named model is not in the local store."""


class InvalidModelFile(ModelStoreError):
    """A file is not a readable GGUF model."""


# --- the engine ---------------------------------------------------------------------------------


class EngineError(WorkerError):
    """Loading or running a model failed."""


class ModelLoadError(EngineError):
    pass


class GenerationCancelled(EngineError):
    pass


class UnsupportedRequest(EngineError):
    """The request asks for something this worker cannot do (e.g. embeddings on a chat model)."""


class EngineCrashed(EngineError):
    """An engine child process ended while it worked (a segfault, an abort in llama.cpp, a
    CUDA error, or the worker killed it for breaking its protocol). Only that child ended: the
    job fails with a retryable ``engine_error`` and the next job gets a new child. ``reason``
    says what happened in plain words (the signal, llama.cpp's last words)."""

    def __init__(self, message: str, *, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason or message


class EngineProtocolError(EngineCrashed):
    """An engine child broke the engine protocol (a malformed, oversized or out-of-turn
    message): the worker ends it, as if it had crashed."""


class SandboxError(EngineError):
    """An engine child could not be started or confined as the owner's settings require."""


# --- the link to the queen ----------------------------------------------------------------------


class LinkError(WorkerError):
    pass


class HandshakeRefusedError(LinkError):
    """The queen refused the hello; ``code`` is the queen's reason code."""

    def __init__(self, code: str, reason: str) -> None:
        super().__init__(f"the queen refused this worker ({code}): {reason}")
        self.code = code
        self.reason = reason


# --- the desktop app's platform layer -----------------------------------------------------------


class ConfigError(WorkerError):
    """The settings file could not be written, or a save named a field that is not a setting."""


class AutostartError(WorkerError):
    """"Run at login" could not be turned on or off (a file or registry write failed)."""


# --- the queen's address ------------------------------------------------------------------------


class QueenAddressError(WorkerError):
    """What the owner typed cannot be read as a queen's address; ``str()`` says the expected
    form (``desktop_worker/queen_url.py``)."""


# --- groups: the path between a group's head and its members (issue 19) ---------------------------


class GroupLinkError(WorkerError):
    """The authenticated path between a group's head and one of its members failed."""


class GroupCredentialsError(GroupLinkError):
    """A group's token or names cannot be used (a token under 32 bytes, a name with ``|``)."""


class GroupLinkRefused(GroupLinkError):
    """The member's gate refused the head; ``reason`` is the gate's code (``bad_mac``, …)."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"the member's gate refused this head ({reason})")
        self.reason = reason


class TlsPinMismatch(GroupLinkError):
    """The member's TLS certificate is not the one the queen named: someone else answered."""


class GroupError(EngineError):
    """A model group (issue 19) could not be formed or served: no RPC backend, a member's
    server that would not start, a head that could not load its share."""


class GroupLost(GroupError):
    """A group's head process ended mid-work: a member went away (llama.cpp aborts the RPC
    client's process on any RPC failure) or the head itself crashed. Jobs fail over."""


class GroupPartFailed(GroupError):
    """This worker's part of a queen-formed group cannot start or go on; ``code`` is the
    ``GroupFailed`` code the queen is told (``shared_schema.groups.GROUP_FAILURES``);
    ``member``: a head's word on which member caused it (its public id), if it can tell."""

    def __init__(self, code: str, message: str, *, member: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.member = member


class MemberShort(GroupError):
    """A head's load failed because the RPC server at ``endpoint`` could not allocate the
    layers the plan gave it: that member has less memory than it claimed."""

    def __init__(self, endpoint: str, message: str) -> None:
        super().__init__(message)
        self.endpoint = endpoint


class RpcRefused(GroupLinkError):
    """A member's gate ended a connection over a llama.cpp RPC message it would not pass
    (issue 34): ``command`` names it (``GRAPH_COMPUTE``, ``ALLOC_BUFFER``, ...), ``code`` says
    why in one word (``over_share``, ``out_of_bounds``, ``forbidden_op``, ...), ``by`` who sent
    it: ``"head"`` (the head broke the protocol; the queen is told) or ``"member"`` (this
    worker's own RPC server answered out of turn)."""

    def __init__(self, command: str, code: str, detail: str, *, by: str = "head") -> None:
        super().__init__(f"{command}: {detail} ({code})")
        self.command = command
        self.code = code
        self.detail = detail
        self.by = by


# --- fine-tuned models: a LoRA adapter on its base (issue 37) ------------------------------------


class InvalidAdapter(InvalidModelFile):
    """A LoRA adapter file is not one this worker serves on its base model: not a GGUF LoRA
    adapter, of another architecture, tensors that are not the base's or not its shapes, or
    over the size bound (``engine.adapters``). Refused before llama.cpp opens it."""


# --- training (issue 37) ------------------------------------------------------------------------


class TrainingError(EngineError):
    """A fine-tuning run failed (in the train child, or its sandbox)."""


class TrainingUnsupported(TrainingError):
    """This llama.cpp cannot train here: a training call is missing, a private layout the
    worker relies on moved, or the self-check found gradients piling up across steps."""


class TrainingCancelled(TrainingError):
    """The run was cancelled; it stopped between two steps."""


class TrainJobFailed(WorkerError):
    """A training job (issue 37) cannot go on: its order, a transfer, the disk, its data or
    its run. ``code`` and ``retryable`` are the ``JobError``'s the queen is sent: retryable
    when another attempt (on this worker or another) may succeed, not when the order or its
    data are at fault."""

    def __init__(self, code: str, message: str, *, retryable: bool) -> None:
        super().__init__(message)
        self.code = code
        self.retryable = retryable


class AdapterFailed(WorkerError):
    """A job for a fine-tuned model (issue 37) cannot get its LoRA adapter: the transfer, the
    disk, or an adapter the engine's check refuses. ``code`` and ``retryable`` are the
    ``JobError``'s: retryable for a transfer or the disk, not for an adapter refused."""

    def __init__(self, code: str, message: str, *, retryable: bool) -> None:
        super().__init__(message)
        self.code = code
        self.retryable = retryable
