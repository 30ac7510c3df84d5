"""The check a LoRA adapter passes before llama.cpp may apply it to a base model (issue 37).

A fine-tuned model is a base GGUF plus a GGUF LoRA adapter, and the adapter is untrusted input:
another worker trained it and the queen handed it on. Its header and tensor table are first
checked like any model file's (``shared_schema.gguf_check``: known types, offsets aligned and
inside the file, nothing overlapping: a truncated file fails here), then as an adapter of this
base, the way llama.cpp's ``llama_adapter_lora_init`` reads one:

- ``general.type`` is ``adapter``, ``adapter.type`` is ``lora``, ``general.architecture`` is
  the base's; ``adapter.lora.alpha``, if there, a finite float32; no activated-LoRA keys;
- every tensor is ``<base tensor>.lora_a`` or ``.lora_b``, both halves of each pair there, of
  an F32, F16, BF16 or Q8_0 type, two-dimensional, on a two-dimensional tensor of the base;
- shapes (ggml order, ``ne0`` first): for a weight of (inputs, outputs), A is (inputs, rank)
  and B is (rank, outputs), with 1 <= rank <= ``MAX_RANK`` and no more than either side
  (``token_embd.weight``, which llama.cpp reads flipped: A (rank, outputs), B (rank, inputs));
- the file at most ``max_bytes`` and no larger than its base.

``check_adapter_header`` is the pure part; ``check_adapter_file`` reads both headers (never
tensor data, a few milliseconds) and raises ``InvalidAdapter`` naming what is wrong. The worker
runs it when a fine-tuned name is registered and before it starts a child, and the engine child
again right before the load (the file may have changed since).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from desktop_worker.errors import InvalidAdapter, InvalidModelFile
from desktop_worker.store.gguf_info import _read_header, _read_parts, split_paths
from shared_schema.gguf import GgufHeader, GgufTensor
from shared_schema.gguf_check import GGML_TYPES

__all__ = ["ADAPTER_TYPES", "MAX_ADAPTER_BYTES", "MAX_RANK", "AdapterInfo",
           "check_adapter_file", "check_adapter_header"]

MAX_ADAPTER_BYTES = 4 << 30  # far above any LoRA of a model a volunteer serves
MAX_RANK = 1024
ADAPTER_TYPES = frozenset({0, 1, 8, 30})  # F32, F16, Q8_0, BF16
_HALVES = (".lora_a", ".lora_b")
_TOKEN_EMBD = "token_embd.weight"
_ALORA_PREFIX = "adapter.alora."
_FLOAT32 = 6


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    """A checked adapter: its file, size, the base weights it changes and their ranks."""

    path: Path
    size_bytes: int
    alpha: float | None
    ranks: dict[str, int]  # base tensor name -> rank

    @property
    def targets(self) -> list[str]:
        return sorted(self.ranks)


def check_adapter_header(adapter: GgufHeader, base: dict[str, GgufTensor], *,
                         base_architecture: str, name: str) -> tuple[float | None,
                                                                      dict[str, int]]:
    """Check a (gguf_check'ed) adapter header against the base's tensors (by name); returns
    its alpha and each target's rank. ``InvalidAdapter`` names the first thing wrong."""
    meta, types = adapter.metadata, adapter.value_types
    if meta.get("general.type") != "adapter":
        raise InvalidAdapter(f"{name}: general.type is {meta.get('general.type')!r}, not "
                             f"'adapter': this is not a LoRA adapter (a whole model?)")
    if meta.get("adapter.type") != "lora":
        raise InvalidAdapter(f"{name}: adapter.type is {meta.get('adapter.type')!r}, not "
                             f"'lora'")
    arch = meta.get("general.architecture")
    if arch != base_architecture:
        raise InvalidAdapter(f"{name}: the adapter is for architecture {arch!r}, the base "
                             f"model is {base_architecture!r}")
    alpha = meta.get("adapter.lora.alpha")
    if alpha is not None and (types.get("adapter.lora.alpha") != _FLOAT32
                              or not math.isfinite(alpha)):
        raise InvalidAdapter(f"{name}: adapter.lora.alpha is not a finite float32")
    alora = sorted(key for key in meta if key.startswith(_ALORA_PREFIX))
    if alora:
        raise InvalidAdapter(f"{name}: activated LoRA ({alora[0]}) is not served")
    if not adapter.tensors:
        raise InvalidAdapter(f"{name}: the adapter holds no tensors")
    pairs: dict[str, dict[str, GgufTensor]] = {}
    for tensor in adapter.tensors:
        half = next((h for h in _HALVES if tensor.name.endswith(h)), None)
        if half is None:
            raise InvalidAdapter(f"{name}: tensor {tensor.name!r} is not a LoRA A or B half "
                                 f"(<weight>.lora_a, <weight>.lora_b)")
        if tensor.ggml_type not in ADAPTER_TYPES:
            kind = GGML_TYPES.get(tensor.ggml_type)
            raise InvalidAdapter(f"{name}: tensor {tensor.name!r} is of type "
                                 f"{kind.name if kind else tensor.ggml_type}; an adapter's "
                                 f"are F32, F16, BF16 or Q8_0")
        if len(tensor.shape) != 2:
            raise InvalidAdapter(f"{name}: tensor {tensor.name!r} has {len(tensor.shape)} "
                                 f"dimensions, not 2")
        pairs.setdefault(tensor.name.removesuffix(half), {})[half] = tensor
    ranks = {target: _rank(target, halves, base.get(target), name)
             for target, halves in pairs.items()}
    return (float(alpha) if alpha is not None else None), ranks


def _rank(target: str, halves: dict[str, GgufTensor], weight: GgufTensor | None,
          name: str) -> int:
    if len(halves) != 2:
        missing = next(h for h in _HALVES if h not in halves)
        raise InvalidAdapter(f"{name}: {target}{missing} is missing (each weight needs both "
                             f"halves)")
    if weight is None:
        raise InvalidAdapter(f"{name}: {target!r} is not a tensor of the base model (an "
                             f"adapter of another model?)")
    if len(weight.shape) != 2:
        raise InvalidAdapter(f"{name}: the base's {target!r} is not a matrix")
    a, b = halves[".lora_a"].shape, halves[".lora_b"].shape
    n_in, n_out = weight.shape
    if target.endswith(_TOKEN_EMBD):  # llama.cpp reads it flipped (llm_build_inp_embd)
        rank, fits = a[0], a[0] == b[0] and a[1] == n_out and b[1] == n_in
    else:
        rank, fits = a[1], a[0] == n_in and b[1] == n_out and a[1] == b[0]
    if not fits:
        raise InvalidAdapter(f"{name}: {target}: A is {list(a)} and B is {list(b)}, which do "
                             f"not fit the base's {list(weight.shape)} (an adapter of another "
                             f"model?)")
    if not 1 <= rank <= min(MAX_RANK, n_in, n_out):
        raise InvalidAdapter(f"{name}: {target}: rank {rank} is outside 1 to "
                             f"{min(MAX_RANK, n_in, n_out)}")
    return rank


def check_adapter_file(adapter: Path, base: Path, *,
                       max_bytes: int = MAX_ADAPTER_BYTES) -> AdapterInfo:
    """Check the adapter file at ``adapter`` for the base model at ``base`` (its first part):
    ``InvalidAdapter`` if it is not one llama.cpp may apply to that base. Headers only. The
    returned ``path`` is absolute."""
    label = Path(adapter).name
    try:
        adapter = Path(adapter).resolve()  # absolute: the child reads it from its own folder
        size = adapter.stat().st_size
    except OSError as exc:
        raise InvalidAdapter(f"{adapter}: cannot read the adapter ({exc})") from exc
    base_parts = split_paths(Path(base))
    try:
        base_size = sum(part.stat().st_size for part in base_parts)
    except OSError as exc:
        raise InvalidModelFile(f"cannot read the base model {base} ({exc})") from exc
    bound = min(max_bytes, base_size)
    if size > bound:
        raise InvalidAdapter(f"{label}: {size:,} bytes, over the {bound:,} an adapter of this "
                             f"base may have")
    try:
        header = _read_header(adapter)
    except InvalidModelFile as exc:
        raise InvalidAdapter(str(exc)) from exc
    parts = _read_parts(Path(base), every_part=True)  # the base's faults: InvalidModelFile
    tensors = {tensor.name: tensor for part in parts for tensor in part.tensors}
    architecture = str(parts[0].metadata["general.architecture"])
    alpha, ranks = check_adapter_header(header, tensors, base_architecture=architecture,
                                        name=label)
    return AdapterInfo(adapter, size, alpha, ranks)

