"""Model names (``hf-user/hf-repo:filter``) and picking one GGUF model out of a repo's files.

Everything here is pure: no I/O, no network. The worker picks the file it downloads with it, and
the queen picks the same file to read its header and price the model.

How a filter picks a file (``resolve_filter``)
-----------------------------------------------
The candidates are the repo's ``.gguf`` files (any folder, suffix compared case-insensitively).
A diffusion model's single ``.safetensors`` file (issue 38) is a candidate instead when the filter
ends in ``.safetensors`` or the repo holds no ``.gguf`` file at all (``stabilityai/sdxl-turbo:
sd_xl_turbo_1.0_fp16``); sharded ``-0000k-of-0000n.safetensors`` files never are (a model's
weights in parts are no single-file checkpoint), nor, in a diffusers repo (one with a top-level
``model_index.json``), the parts in its folders (``unet/``, ``vae/``, ...); and a repo of GGUF
files keeps its filters' meaning. Split files named ``<base>-00001-of-00003.gguf`` ... form one
candidate (a *group*). Vision projector files (``mmproj`` in the file name) are candidates only
when the filter itself says ``mmproj``: they are never a chat model on their own.

The filter is compared case-insensitively, in three tiers; the first tier with any match decides:

1. **Exact name**: the filter is the candidate's path or file name, with or without ``.gguf``
   (for a split group: its path or name without the ``-00001-of-0000N.gguf`` suffix, or its
   first part's).
2. **Delimited match**: the filter, cut into words at every character that is not a letter, a
   digit or ``_``, appears as a run of whole words in the candidate's path cut the same way.
   Underscores do not cut: they are part of quantization tags. So ``Q4_K_M`` picks
   ``m-Q4_K_M.gguf`` and not ``m-IQ4_K_M.gguf``; ``Q4_0`` picks ``m.Q4_0.gguf`` and not
   ``m.Q4_0_4_4.gguf``; ``f16`` picks ``m-f16.gguf`` and not ``m-bf16.gguf``;
   ``135M-Instruct`` matches ``SmolLM2-135M-Instruct-Q8_0.gguf``.
3. **Substring**: the filter is a substring of the candidate's path. ``Q4_K`` (no such whole
   word) matches both ``Q4_K_M`` and ``Q4_K_S`` here, which is ambiguous.

One match in the deciding tier is the answer. Several are ``AmbiguousFilter`` listing just those;
none in any tier is ``NoMatchingFile`` listing every candidate.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from shared_schema.errors import (
    AmbiguousFilter,
    IncompleteSplitModel,
    InvalidModelName,
    NoMatchingFile,
    UnsafeRepoPath,
)

__all__ = [
    "ModelName",
    "RemoteFile",
    "ResolvedFile",
    "check_repo_path",
    "parse_model_name",
    "quant_tag",
    "remote_files",
    "resolve_filter",
    "split_part",
    "validate_local_name",
]

# Hugging Face repo ids: letters, digits, "-", "_", "."; no "--" or ".." and at most 96 chars.
_REPO_PART = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9_])?$")
_MAX_REPO_ID = 96
_MAX_FILTER = 200
_MAX_LOCAL_NAME = 200
_LOCAL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/+@-]*$")
_WORD_CUT = re.compile(r"[^a-z0-9_]+")
_SPLIT = re.compile(r"^(?P<base>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)
_GGUF_SUFFIX = ".gguf"
_SAFETENSORS_SUFFIX = ".safetensors"
_SHARD = re.compile(r"-\d{5}-of-\d{5}\.safetensors$", re.IGNORECASE)
_QUANT = re.compile(
    r"^(?:i?q\d(?:_[a-z0-9]+)*|tq\d_\d|f16|f32|bf16|fp16|fp32|mxfp4(?:_moe)?)$", re.IGNORECASE
)


# A file path from the hub is checked by the rules of both POSIX and Windows, whatever the OS the
# worker runs on, so that a name that is harmless here but not on an owner's other machine (or
# a settings folder copied there) is refused the same everywhere.
_MAX_REPO_PATH = 1000
_MAX_PATH_PART = 255
_WINDOWS_FORBIDDEN = frozenset('<>:"|?*\\')
_WINDOWS_RESERVED = frozenset(
    {"CON", "PRN", "AUX", "NUL", "CONIN$", "CONOUT$"}
    | {f"{device}{n}" for device in ("COM", "LPT") for n in (*"0123456789", "\u00b9", "\u00b2",
                                                               "\u00b3")}
)


@dataclass(frozen=True)
class ModelName:
    """A parsed ``hf-user/hf-repo:filter`` name."""

    repo_id: str
    filter: str

    def __str__(self) -> str:
        return f"{self.repo_id}:{self.filter}"


def parse_model_name(text: str) -> ModelName:
    """Parse ``hf-user/hf-repo:filter``; raise ``InvalidModelName`` with the reason otherwise."""
    if not isinstance(text, str):
        raise InvalidModelName(f"a model name must be text, not {type(text).__name__}")
    repo_id, colon, filter_ = text.partition(":")
    if not colon:
        raise InvalidModelName(
            f"{text!r} is not a model name: expected hf-user/hf-repo:filter, "
            "for example HuggingFaceTB/SmolLM2-135M-Instruct-GGUF:Q4_K_M"
        )
    _check_repo_id(text, repo_id)
    _check_filter(text, filter_)
    return ModelName(repo_id=repo_id, filter=filter_)


def _check_repo_id(text: str, repo_id: str) -> None:
    parts = repo_id.split("/")
    if len(parts) != 2 or not all(parts):
        raise InvalidModelName(f"{text!r}: the repo must be hf-user/hf-repo, got {repo_id!r}")
    if len(repo_id) > _MAX_REPO_ID:
        raise InvalidModelName(f"{text!r}: the repo id is longer than {_MAX_REPO_ID} characters")
    for part in parts:
        if not _REPO_PART.match(part) or "--" in part or ".." in part:
            raise InvalidModelName(
                f"{text!r}: {part!r} is not a valid Hugging Face user or repo name "
                "(letters, digits, '-', '_' and '.', no '--' or '..')"
            )


def _check_filter(text: str, filter_: str) -> None:
    if not filter_:
        raise InvalidModelName(f"{text!r}: the filter after ':' is empty")
    if len(filter_) > _MAX_FILTER:
        raise InvalidModelName(f"{text!r}: the filter is longer than {_MAX_FILTER} characters")
    if ":" in filter_ or any(ch.isspace() or not ch.isprintable() for ch in filter_):
        raise InvalidModelName(
            f"{text!r}: the filter may not hold ':', spaces or control characters"
        )
    if not any(ch.isalnum() for ch in filter_):
        raise InvalidModelName(f"{text!r}: the filter must hold at least one letter or digit")


def validate_local_name(name: str) -> str:
    """Check a name for an imported model and return it.

    Any hub-style name is fine, and so is a short free-form one (``my-model``, ``team/tuned:q4``):
    it starts with a letter or digit and holds only letters, digits and ``. _ : / + @ -``.
    """
    if not isinstance(name, str) or not name:
        raise InvalidModelName("a model name may not be empty")
    if len(name) > _MAX_LOCAL_NAME:
        raise InvalidModelName(f"a model name may not be longer than {_MAX_LOCAL_NAME} characters")
    if not _LOCAL_NAME.match(name) or ".." in name:
        raise InvalidModelName(
            f"{name!r} is not a valid model name: start with a letter or digit and use only "
            "letters, digits and . _ : / + @ -"
        )
    return name


def check_repo_path(path: str, repo_id: str = "the repo") -> tuple[str, ...]:
    """The folders and name of a file path from a hub listing (``rfilename``), or
    ``UnsafeRepoPath``
    when the path is not safe to put under the models folder on POSIX and Windows alike.

    Refused: empty or over-long paths; absolute paths; empty, ``.`` or ``..`` parts;
    backslashes, drive letters and the other characters Windows forbids (``< > : " | ? *``);
    control characters; parts ending in a dot or a space (Windows drops those, so two names
    would be one file); and Windows' reserved device names (``CON``, ``NUL``, ``COM1`` ...),
    with or without an extension.
    """
    if not isinstance(path, str) or not path:
        raise UnsafeRepoPath(f"{repo_id} lists a file with an empty name; refusing it")
    if len(path) > _MAX_REPO_PATH:
        raise UnsafeRepoPath(
            f"{repo_id} lists a file path longer than {_MAX_REPO_PATH} characters; refusing it")
    problem = _path_problem(path)
    if problem is not None:
        raise UnsafeRepoPath(
            f"{repo_id} lists the unsafe file path {path!r} ({problem}); refusing it")
    return tuple(path.split("/"))


def _path_problem(path: str) -> str | None:
    if path.startswith("/"):
        return "it is absolute"
    bad = sorted({ch for ch in path if ch in _WINDOWS_FORBIDDEN or ord(ch) < 0x20 or ch == "\x7f"})
    if bad:
        return "it holds " + ", ".join(repr(ch) for ch in bad)
    for part in path.split("/"):
        if part in ("", ".", ".."):
            return f"it has a {part!r} part" if part else "it has an empty part"
        if len(part) > _MAX_PATH_PART:
            return f"a part is longer than {_MAX_PATH_PART} characters"
        if part[-1] in ". ":
            return f"{part!r} ends in a dot or a space"
        if part.split(".", 1)[0].rstrip(" ").upper() in _WINDOWS_RESERVED:
            return f"{part!r} is a reserved device name on Windows"
    return None


def split_part(path: str) -> tuple[str, int, int] | None:
    """``(base, part_no, part_count)`` for ``<base>-0000k-of-0000n.gguf``; None otherwise."""
    match = _SPLIT.match(path)
    if match is None:
        return None
    return match["base"], int(match["no"]), int(match["count"])


def quant_tag(path: str) -> str | None:
    """The quantization tag in a file name (``Q4_K_M``, ``IQ3_XS``, ``F16`` ...), upper-cased.

    The last whole word (see the module docstring) that looks like a tag wins; None if none does.
    """
    for word in reversed(_words(_strip_gguf(_base_of(path)))):
        if _QUANT.match(word):
            return word.upper()
    return None


@dataclass(frozen=True)
class ResolvedFile:
    """One GGUF model in a repo: a single file, or the parts of a split model in order."""

    paths: tuple[str, ...]
    label: str
    quant: str | None

    @property
    def first(self) -> str:
        """The file to load: the only one, or the first part of a split model."""
        return self.paths[0]

    @property
    def is_split(self) -> bool:
        return len(self.paths) > 1


@dataclass(frozen=True)
class _Candidate:
    paths: tuple[str, ...]
    label: str
    base: str  # the path without ".gguf" and without the split suffix
    expected_parts: int  # 1 for a single file

    @property
    def complete(self) -> bool:
        return len(self.paths) == self.expected_parts


def resolve_filter(files: Sequence[str], filter: str) -> ResolvedFile:
    """Pick exactly one GGUF model out of a repo's file paths with ``filter``.

    See the module docstring for the rule. Raises ``NoMatchingFile`` or ``AmbiguousFilter``
    (both carry ``candidates``, labels of the candidates in question), or
    ``IncompleteSplitModel``
    if the match is a split model with parts missing from the repo.
    """
    wanted = filter.strip().lower()
    candidates = [
        c for c in _candidates(files) if "mmproj" in wanted or "mmproj" not in _name(c.base).lower()
    ]
    if wanted.endswith(_SAFETENSORS_SUFFIX) or not candidates:
        candidates = _safetensors_candidates(files)
    labels = [c.label for c in candidates]
    if not candidates:
        raise NoMatchingFile(f"the repo has no .gguf model files, nor a single-file "
                             f".safetensors model (filter {filter!r})", [])
    for tier in (_exact_matches, _delimited_matches, _substring_matches):
        matches = tier(candidates, wanted)
        if len(matches) == 1:
            return _resolved(matches[0])
        if matches:
            found = [c.label for c in matches]
            raise AmbiguousFilter(
                f"filter {filter!r} matches {len(found)} models: {', '.join(found)}. "
                "Use a longer filter, such as the full file name.",
                found,
            )
    raise NoMatchingFile(
        f"filter {filter!r} matches none of the repo's models: {', '.join(labels)}", labels
    )


def _resolved(candidate: _Candidate) -> ResolvedFile:
    if not candidate.complete:
        raise IncompleteSplitModel(
            f"{candidate.label} is a split model with parts missing from the repo "
            f"({len(candidate.paths)} of {candidate.expected_parts} present)"
        )
    return ResolvedFile(
        paths=candidate.paths, label=candidate.label, quant=quant_tag(candidate.paths[0])
    )


def _candidates(files: Iterable[str]) -> list[_Candidate]:
    singles: list[_Candidate] = []
    groups: dict[tuple[str, int], dict[int, str]] = {}
    for path in sorted(set(files)):
        if not path.lower().endswith(_GGUF_SUFFIX):
            continue
        split = split_part(path)
        if split is None:
            singles.append(_Candidate((path,), path, path[: -len(_GGUF_SUFFIX)], 1))
            continue
        base, no, count = split
        if 1 <= no <= count:
            groups.setdefault((base, count), {})[no] = path
    for (base, count), parts in groups.items():
        ordered = tuple(parts[no] for no in sorted(parts))
        label = f"{ordered[0]} ({count} parts)" if count > 1 else ordered[0]
        singles.append(_Candidate(ordered, label, base, count))
    return sorted(singles, key=lambda c: c.label.lower())


def _safetensors_candidates(files: Iterable[str]) -> list[_Candidate]:
    """The repo's single-file ``.safetensors`` models (issue 38: diffusion checkpoints)."""
    paths = set(files)
    diffusers = "model_index.json" in paths  # its folders hold a pipeline's parts

    def single(path: str) -> bool:
        return (path.lower().endswith(_SAFETENSORS_SUFFIX) and not _SHARD.search(path)
                and not (diffusers and "/" in path))

    return sorted((_Candidate((path,), path, path[: -len(_SAFETENSORS_SUFFIX)], 1)
                   for path in paths if single(path)), key=lambda c: c.label.lower())


def _exact_matches(candidates: list[_Candidate], wanted: str) -> list[_Candidate]:
    wanted = _strip_gguf(wanted)
    out = []
    for c in candidates:
        first = _strip_gguf(c.paths[0].lower())
        names = {c.base.lower(), _name(c.base).lower(), first, _name(first)}
        if wanted in names:
            out.append(c)
    return out


def _delimited_matches(candidates: list[_Candidate], wanted: str) -> list[_Candidate]:
    needle = _words(wanted)
    if not needle:
        return []
    return [c for c in candidates if _contains_run(_words(c.base.lower()), needle)]


def _substring_matches(candidates: list[_Candidate], wanted: str) -> list[_Candidate]:
    return [c for c in candidates if wanted in c.paths[0].lower()]


def _contains_run(words: list[str], needle: list[str]) -> bool:
    size = len(needle)
    return any(words[i : i + size] == needle for i in range(len(words) - size + 1))


def _words(text: str) -> list[str]:
    return [w for w in _WORD_CUT.split(text.lower()) if w]


def _strip_gguf(path: str) -> str:
    """``path`` without its model file suffix (``.gguf``, or ``.safetensors``)."""
    for suffix in (_GGUF_SUFFIX, _SAFETENSORS_SUFFIX):
        if path.lower().endswith(suffix):
            return path[: -len(suffix)]
    return path


def _base_of(path: str) -> str:
    split = split_part(path)
    return split[0] if split else path


def _name(path: str) -> str:
    return path.rsplit("/", 1)[-1]


@dataclass(frozen=True)
class RemoteFile:
    """A file in a hub repo. ``sha256`` is known for files stored with LFS (all GGUF files)."""

    path: str
    size: int | None
    sha256: str | None = None


def remote_files(siblings: Iterable[Any]) -> tuple[RemoteFile, ...]:
    """A repo's files from ``huggingface_hub``'s ``model_info(files_metadata=True).siblings``
    (read by attribute, so this module needs no huggingface_hub): both sides' hub edges list
    repos through it."""
    files = []
    for sibling in siblings:
        lfs = sibling.lfs
        size = sibling.size if sibling.size is not None else (lfs.size if lfs else None)
        files.append(RemoteFile(sibling.rfilename, size, lfs.sha256 if lfs else None))
    return tuple(files)
