"""Model names and picking one GGUF model out of a repo, as the worker's store raises them.

The rules live in ``shared_schema.model_names`` (the queen picks the same file to price a model);
this module translates their errors into the worker's own at the boundary, so the store, the CLI
and the GUI keep handling only ``desktop_worker.errors``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import wraps
from typing import ParamSpec, TypeVar

from desktop_worker.errors import (
    AmbiguousFilter,
    HubError,
    InvalidModelFile,
    InvalidModelName,
    NoMatchingFile,
    WorkerError,
)
from shared_schema import errors as shared
from shared_schema import model_names as rules
from shared_schema.model_names import ModelName, ResolvedFile, quant_tag, split_part

__all__ = [
    "ModelName",
    "ResolvedFile",
    "check_repo_path",
    "parse_model_name",
    "quant_tag",
    "resolve_filter",
    "split_part",
    "validate_local_name",
]

P = ParamSpec("P")
R = TypeVar("R")


def _worker_error(exc: shared.ModelNameError) -> WorkerError:
    if isinstance(exc, shared.NoMatchingFile):
        return NoMatchingFile(str(exc), exc.candidates)
    if isinstance(exc, shared.AmbiguousFilter):
        return AmbiguousFilter(str(exc), exc.candidates)
    if isinstance(exc, shared.UnsafeRepoPath):
        return HubError(str(exc))
    if isinstance(exc, shared.IncompleteSplitModel):
        return InvalidModelFile(str(exc))
    return InvalidModelName(str(exc))


def _translated(rule: Callable[P, R]) -> Callable[P, R]:
    @wraps(rule)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return rule(*args, **kwargs)
        except shared.ModelNameError as exc:
            raise _worker_error(exc) from exc

    return call


parse_model_name: Callable[[str], ModelName] = _translated(rules.parse_model_name)
validate_local_name: Callable[[str], str] = _translated(rules.validate_local_name)
check_repo_path: Callable[..., tuple[str, ...]] = _translated(rules.check_repo_path)
resolve_filter: Callable[[Sequence[str], str], ResolvedFile] = _translated(rules.resolve_filter)
