"""What the queen knows about a model from its own reading, and the pure rules that get there.

A worker's ``ModelDescriptor`` says how many parameters its model has; anyone can connect a
worker, so that number is a claim and never sets a price. For a hub name
(``hf-user/hf-repo:filter``) the queen lists the repo itself, picks the file with the same rule
as the worker (``shared_schema.model_names``), takes the file's sha256 from the hub's listing,
and reads the GGUF header of that file: the parameter count is the sum of the tensor table's
element counts. Headers are cached by sha256, since many names (and many repos) share a file.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from shared_schema.diffusion_check import DIFFUSION_ARCHITECTURE, diffusion_shape_of_prefix
from shared_schema.errors import (
    GgufTruncated,
    InvalidDiffusionModel,
    InvalidGgufFile,
    ModelNameError,
)
from shared_schema.gguf import GgufHeader, as_int
from shared_schema.gguf_shape import GgufShape, shape_of
from shared_schema.model_names import (
    ModelName,
    RemoteFile,
    ResolvedFile,
    parse_model_name,
    resolve_filter,
)

__all__ = [
    "HeaderFacts",
    "ModelFacts",
    "RemoteFile",
    "RepoFiles",
    "header_facts",
    "hub_name",
    "pick_file",
]


@dataclass(frozen=True, slots=True)
class RepoFiles:
    """A repo's files at one commit, as the hub lists them."""

    repo_id: str
    commit: str
    files: tuple[RemoteFile, ...]

    def file(self, path: str) -> RemoteFile:
        for remote in self.files:
            if remote.path == path:
                return remote
        raise KeyError(path)


@dataclass(frozen=True, slots=True)
class HeaderFacts:
    """What one file's header says (for a split model: its part's tensors only)."""

    parameter_count: int
    architecture: str | None
    context_length: int | None
    split_count: int
    shape: GgufShape  # this part's tensors only, for fitting (merged by ``model_facts``)


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """A hub model as the queen read it: the pinned file(s) and the model's size."""

    name: str
    repo_id: str
    commit: str
    paths: tuple[str, ...]
    sha256s: tuple[str, ...]
    parameter_count: int
    architecture: str | None
    context_length: int | None
    size_bytes: int | None
    shape: GgufShape | None = None  # layers and heads, for placing the model by memory

    @property
    def has_chat_template(self) -> bool:
        return self.shape is not None and self.shape.has_chat_template

    @property
    def sha256(self) -> str:
        """The sha256 of the file a worker loads (the first part of a split model)."""
        return self.sha256s[0]


def hub_name(name: str) -> ModelName | None:
    """The hub repo and filter a model name names; None for a name that is not one (an imported
    file's local name, which the queen cannot read)."""
    try:
        return parse_model_name(name)
    except ModelNameError:
        return None


def pick_file(listing: RepoFiles, name: ModelName) -> tuple[ResolvedFile, tuple[RemoteFile, ...]]:
    """The file(s) the worker loads for ``name``, picked by the worker's own rule; each must
    carry a sha256 (``ModelNameError`` otherwise, or when the filter fits no single model)."""
    resolved = resolve_filter([f.path for f in listing.files], name.filter)
    remotes = tuple(listing.file(path) for path in resolved.paths)
    for remote in remotes:
        if remote.sha256 is None:
            raise _unpinned(listing.repo_id, remote.path)
    return resolved, remotes


def header_facts(header: GgufHeader, file_size: int) -> HeaderFacts:
    meta = header.metadata
    arch = meta.get("general.architecture")
    arch = arch if isinstance(arch, str) and arch else None
    context = as_int(meta.get(f"{arch}.context_length")) if arch else None
    return HeaderFacts(
        parameter_count=header.parameter_count,
        architecture=arch,
        context_length=context,
        split_count=max(as_int(meta.get("split.count")) or 1, 1),
        shape=shape_of([(header, file_size)]),
    )


def diffusion_facts(data: bytes, path: str, file_size: int,
                    not_llm: InvalidGgufFile) -> HeaderFacts:
    """A diffusion model's facts from its header's first bytes (issue 38): its parameters (every
    tensor's), its family as ``architecture`` (``diffusion:sdxs``, say), no layers or context.
    ``GgufTruncated`` to read on; a file that is no diffusion model either is refused with why
    it is no LLM (``not_llm``), and one that cannot render alone (``DiffusionShape.incomplete``:
    a lone denoiser, say) with why."""
    try:
        shape = diffusion_shape_of_prefix(data, path, file_size)
    except GgufTruncated:
        raise
    except InvalidDiffusionModel as exc:
        raise not_llm from exc
    incomplete = shape.incomplete(path)
    if incomplete is not None:  # a worker would download it, then refuse it
        raise InvalidGgufFile(incomplete)
    architecture = DIFFUSION_ARCHITECTURE + shape.family
    return HeaderFacts(
        parameter_count=shape.parameter_count, architecture=architecture, context_length=None,
        split_count=1,
        shape=GgufShape(architecture=architecture, block_count=0, context_length=None,
                        embedding_length=None, head_count=None, head_count_kv=None,
                        layer_bytes=(), other_bytes=file_size, has_chat_template=False))


def model_facts(name: str, listing: RepoFiles, remotes: tuple[RemoteFile, ...],
                headers: list[HeaderFacts]) -> ModelFacts:
    """The model's facts from the headers of all its parts (in order)."""
    first = headers[0]
    return ModelFacts(
        name=name,
        repo_id=listing.repo_id,
        commit=listing.commit,
        paths=tuple(r.path for r in remotes),
        sha256s=tuple(r.sha256 or "" for r in remotes),
        parameter_count=sum(h.parameter_count for h in headers),
        architecture=first.architecture,
        context_length=first.context_length,
        size_bytes=sum(r.size for r in remotes if r.size is not None) or None,
        shape=merge_shapes([h.shape for h in headers]),
    )


def merge_shapes(shapes: list[GgufShape]) -> GgufShape:
    """One model's shape from its parts' (metadata from the first, tensors from all)."""
    first = shapes[0]
    if len(shapes) == 1:
        return first
    blocks = max(s.block_count for s in shapes)
    layers = [sum(s.layer_bytes[i] for s in shapes if i < len(s.layer_bytes))
              for i in range(blocks)]
    return replace(first, block_count=blocks, layer_bytes=tuple(layers),
                   other_bytes=sum(s.other_bytes for s in shapes))


def _unpinned(repo_id: str, path: str) -> ModelNameError:
    return ModelNameError(f"{repo_id} lists {path} with no sha256 (not stored with LFS): the "
                          "queen cannot pin it")
