"""Where a group's head puts each layer: the queen's layer counts turned into llama.cpp's load
arguments (pure).

llama.cpp (the version llama-cpp-python 0.3.36 vendors, ``llama_model::load_tensors``) keeps
the first ``n_layer + 1 - n_gpu_layers`` layers on the CPU and spreads the rest, the output
layer counted as one more, over the model's devices in proportion to ``tensor_split``: layer
offset ``t`` goes to the first device whose cumulative share exceeds ``t / n_gpu_layers``. Its
device order is the RPC servers first, in the order they were added, then the local GPUs
(``llama_prepare_model_devices``: "add RPC servers at the front of the list").

So the head adds its members' servers in the plan's order and asks for
``n_gpu_layers = sum(device layers) + 1`` with each device's count as its weight (the last one
plus one, for the output layer): every device then holds exactly the queen's count of blocks,
and the output layer lands on the last device, which is the head's own last GPU when it has
one, else the last member's last device. With integer weights the cumulative shares and the
offsets are the same float divisions, so no layer falls across a boundary.

A **RAM-only head** (no GPU of its own) would so leave the output matrix on the last member,
and that member would send the head every token's logits (``n_vocab`` floats: 196 KB for
SmolLM2's 49,152, 512 KB for a 128k vocabulary), about 85 times the hidden state it returns
otherwise. With ``output_on_cpu`` the layout names the output tensors for llama.cpp's tensor
buffer overrides (``cpu_tensors``, regular expressions searched in each tensor's name), which
keep them in the head's RAM, where the queen's planner counts them (with the embeddings, on
the head): the last member then returns the hidden state, and the head multiplies it by the
output matrix itself. The layers stay where they were; only those tensors move.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from desktop_worker.errors import GroupError

MAX_DEVICES = 16  # llama_max_devices() of the vendored build (GGML_RPC_MAX_SERVERS too)
# The output layer's matrix: ``output.weight``, or with tied embeddings the copy of
# ``token_embd.weight`` that llama.cpp makes for the output layer (the input one is always on
# the CPU). ``output_norm`` is one row of floats and stays with the last layer.
OUTPUT_TENSORS = r"^(output|token_embd)\.weight$"


@dataclass(frozen=True, slots=True)
class LoadLayout:
    """llama.cpp's arguments for a group's head, and the layer range of each device."""

    n_gpu_layers: int
    tensor_split: tuple[float, ...]
    cpu_layers: tuple[int, int]  # [start, end) on the head's CPU
    device_ranges: tuple[tuple[int, int], ...]  # [start, end) per device, in device order
    output_device: int | None  # index into the devices; None: the head's CPU
    cpu_tensors: tuple[str, ...] = ()  # tensor name patterns kept in the head's RAM


def load_layout(n_layer: int, cpu_layers: int, device_layers: Sequence[int], *,
                output_on_cpu: bool = False) -> LoadLayout:
    """``cpu_layers`` on the head's CPU (the first ones), then ``device_layers[i]`` on device
    ``i`` (members' devices in the plan's order, then the head's own GPUs). ``output_on_cpu``:
    the output matrix stays in the head's RAM (a RAM-only head), not on the last device."""
    if n_layer <= 0:
        raise GroupError("the model has no layers")
    if cpu_layers < 0 or any(count < 0 for count in device_layers):
        raise GroupError("a layer count is negative")
    if cpu_layers + sum(device_layers) != n_layer:
        raise GroupError(f"the plan places {cpu_layers + sum(device_layers)} layers; the model "
                         f"has {n_layer}")
    if len(device_layers) > MAX_DEVICES:
        raise GroupError(f"a group is at most {MAX_DEVICES} devices; the plan has "
                         f"{len(device_layers)}")
    if not device_layers or sum(device_layers) == 0:
        return LoadLayout(0, (), (0, n_layer), tuple((n_layer, n_layer) for _ in device_layers),
                          None)
    weights = [float(count) for count in device_layers]
    last = max(i for i, count in enumerate(device_layers) if count > 0)
    weights[last] += 1.0  # the output layer
    ranges: list[tuple[int, int]] = []
    start = cpu_layers
    for count in device_layers:
        ranges.append((start, start + count))
        start += count
    return LoadLayout(
        n_gpu_layers=sum(device_layers) + 1,
        tensor_split=tuple(weights),
        cpu_layers=(0, cpu_layers),
        device_ranges=tuple(ranges),
        output_device=None if output_on_cpu else last,
        cpu_tensors=(OUTPUT_TENSORS,) if output_on_cpu else (),
    )


def device_of_layer(layout: LoadLayout, n_layer: int, layer: int) -> int | None:
    """The device llama.cpp gives ``layer`` (``n_layer`` is the output layer) under
    ``layout``: its own rule, in float32 as it computes, for checking the layout above."""
    import numpy as np

    i_gpu_start = max(n_layer + 1 - layout.n_gpu_layers, 0)
    act = min(layout.n_gpu_layers, n_layer + 1) if layout.tensor_split else 0
    if layer < i_gpu_start or layer - i_gpu_start >= act:
        return None
    splits = np.cumsum(np.array(layout.tensor_split, dtype=np.float32), dtype=np.float32)
    splits = splits / splits[-1]
    value = np.float32(layer - i_gpu_start) / np.float32(act)
    return int(np.searchsorted(splits, value, side="right"))
