"""Errors raised by the wire-protocol helpers."""

from __future__ import annotations

from collections.abc import Sequence


class SchemaError(Exception):
    """Base class for errors in ``shared_schema``."""


class ProtocolError(SchemaError):
    """A frame could not be decoded into a protocol message.

    ``code`` is a short machine-readable reason (``invalid_json``, ``invalid_message``,
    ``unknown_type``); the message text says what was wrong, for logs and refusals.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class InvalidGgufFile(SchemaError):
    """Bytes that are not a readable GGUF header."""


class GgufTruncated(InvalidGgufFile):
    """The header goes on past the bytes given: read at least ``needed`` bytes and try again."""

    def __init__(self, message: str, needed: int) -> None:
        super().__init__(message)
        self.needed = needed


class InvalidQueenUrl(SchemaError, ValueError):
    """A queen URL that names no origin (``queen_origin``): not ws/wss/http/https, no host, a
    bad port or characters no host name may hold. The message says which, for the owner."""


class ModelNameError(SchemaError):
    """Base class for model names and picking a model file out of a repo's listing."""


class InvalidModelName(ModelNameError):
    """A model name is not of the form ``hf-user/hf-repo:filter`` (or a valid local name)."""


class UnsafeRepoPath(ModelNameError):
    """A hub listing names a file path that is not safe on POSIX and Windows alike."""


class NoMatchingFile(ModelNameError):
    """The filter matched no ``.gguf`` file in the repo."""

    def __init__(self, message: str, candidates: Sequence[str]) -> None:
        super().__init__(message)
        self.candidates = list(candidates)


class AmbiguousFilter(ModelNameError):
    """The filter matched several ``.gguf`` files (or split groups) in the repo."""

    def __init__(self, message: str, candidates: Sequence[str]) -> None:
        super().__init__(message)
        self.candidates = list(candidates)


class IncompleteSplitModel(ModelNameError):
    """The filter matched a split model with parts missing from the repo."""


class InvalidScoreData(SchemaError, ValueError):
    """An auditor's score result that is not a well-formed ``ScoreData`` (``audits.py``): the
    message says which field was wrong."""


class GgufInvalid(InvalidGgufFile):
    """A GGUF header that contradicts itself or its file, or claims more than the limits allow
    (``gguf.GgufLimits``, ``gguf_check``): the message names what is wrong (a key, a tensor)."""


class InvalidDiffusionModel(SchemaError):
    """A file that is not a diffusion model stable-diffusion.cpp may open
    (``shared_schema.diffusion_check``): malformed, truncated, a header that lies about its
    tensors or passes its bounds. The message names the file and what is wrong."""


class NotADiffusionModel(InvalidDiffusionModel):
    """A well-formed GGUF or safetensors file whose tensors are no diffusion model that
    stable-diffusion.cpp detects (an LLM's GGUF, a lone VAE, a LoRA)."""


class UnsupportedDiffusionFamily(InvalidDiffusionModel):
    """A diffusion model of a family stable-diffusion.cpp detects but Apiary does not render
    from a prompt (inpainting, image editing, video, or a family not served yet); ``family``
    is its name as ``diffusion_check`` gives it."""

    def __init__(self, message: str, family: str) -> None:
        super().__init__(message)
        self.family = family
