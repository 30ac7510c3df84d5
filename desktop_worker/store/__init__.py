"""The worker's model store: names, GGUF facts, the hub edge and the local store.

``ModelStore`` is the entry point; see ``names`` for how a ``user/repo:filter`` name picks a file.
"""

from desktop_worker.store.gguf_info import GgufInfo, read_gguf_info
from desktop_worker.store.hub import HubClient, RemoteFile, RepoListing
from desktop_worker.store.names import (
    ModelName,
    ResolvedFile,
    parse_model_name,
    resolve_filter,
    validate_local_name,
)
from desktop_worker.store.progress import ProgressCallback, PullProgress
from desktop_worker.store.store import LocalModel, ModelStore, PullPlan, store_for

__all__ = [
    "GgufInfo",
    "HubClient",
    "LocalModel",
    "ModelName",
    "ModelStore",
    "ProgressCallback",
    "PullPlan",
    "PullProgress",
    "RemoteFile",
    "RepoListing",
    "ResolvedFile",
    "parse_model_name",
    "read_gguf_info",
    "resolve_filter",
    "store_for",
    "validate_local_name",
]
