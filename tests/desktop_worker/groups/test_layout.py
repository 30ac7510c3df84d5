"""The head's layout: the queen's layer counts become llama.cpp arguments that put exactly
those counts on each device, checked against llama.cpp's own placement rule in float32."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from desktop_worker.errors import GroupError
from desktop_worker.groups.layout import MAX_DEVICES, device_of_layer, load_layout


@st.composite
def plans(draw: st.DrawFn) -> tuple[int, int, list[int]]:
    devices = draw(st.lists(st.integers(0, 120), min_size=1, max_size=MAX_DEVICES))
    cpu = draw(st.integers(0, 40))
    return cpu + sum(devices), cpu, devices


@given(plans())
def test_every_device_gets_exactly_its_count(plan: tuple[int, int, list[int]]) -> None:
    n_layer, cpu, devices = plan
    if n_layer == 0:
        return
    layout = load_layout(n_layer, cpu, devices)
    placed = [device_of_layer(layout, n_layer, layer) for layer in range(n_layer)]
    assert placed[:cpu] == [None] * cpu
    for index, count in enumerate(devices):
        assert placed.count(index) == count
        start, end = layout.device_ranges[index]
        assert placed[start:end] == [index] * count
    if sum(devices):  # the output layer: on the last device that holds blocks
        assert device_of_layer(layout, n_layer, n_layer) == layout.output_device
        assert devices[layout.output_device] > 0


def test_the_real_smollm2_split() -> None:
    layout = load_layout(30, 10, [10, 10])
    assert layout.n_gpu_layers == 21
    assert layout.tensor_split == (10.0, 11.0)
    assert layout.device_ranges == ((10, 20), (20, 30))


def test_a_ram_only_heads_output_matrix_stays_in_its_ram() -> None:
    """The layers stay where they were; only the output matrix is named for the head's RAM
    (with tied embeddings, llama.cpp's output copy of ``token_embd``), not the norm."""
    import re

    kept = load_layout(30, 10, [10, 10], output_on_cpu=True)
    moved = load_layout(30, 10, [10, 10])
    assert (kept.n_gpu_layers, kept.tensor_split, kept.device_ranges) == (
        moved.n_gpu_layers, moved.tensor_split, moved.device_ranges)
    assert kept.output_device is None
    assert moved.output_device == 1
    assert moved.cpu_tensors == ()
    (pattern,) = kept.cpu_tensors
    for name in ("output.weight", "token_embd.weight"):
        assert re.search(pattern, name)
    for name in ("output_norm.weight", "blk.29.attn_output.weight", "blk.3.ffn_down.weight"):
        assert not re.search(pattern, name)


def test_all_on_the_head() -> None:
    layout = load_layout(30, 30, [0])
    assert layout.n_gpu_layers == 0
    assert device_of_layer(layout, 30, 29) is None


@pytest.mark.parametrize(("n_layer", "cpu", "devices", "message"), [
    (30, 10, [10], "places 20 layers"),
    (30, -1, [31], "negative"),
    (0, 0, [], "no layers"),
    (40, 0, [1] * 17 + [23], "at most 16"),
])
def test_impossible_plans_are_refused(n_layer, cpu, devices, message) -> None:
    with pytest.raises(GroupError, match=message):
        load_layout(n_layer, cpu, devices)
