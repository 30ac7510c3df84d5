from dataclasses import dataclass, field

import pytest

from desktop_worker.engine.pool import Resident, choose_evictions
from shared_schema.fitting import (
    MB,
    choose_context,
    kv_bytes_per_layer,
    plan_load,
    safety_margin_mb,
)


@dataclass(frozen=True)
class Shape:
    block_count: int = 32
    context_length: int | None = 8192
    embedding_length: int | None = 4096
    head_count: int | None = 32
    head_count_kv: int | None = 8
    layer_bytes: list[int] = field(default_factory=lambda: [200 * MB] * 32)
    other_bytes: int = 500 * MB


def test_kv_cache_size_follows_the_grouped_query_heads():
    # 2 (k, v) * 4096 ctx * 8 kv heads * 128 head dim * 2 bytes = 16 MiB per layer
    assert kv_bytes_per_layer(Shape(), 4096) == 16 * MB


def test_context_defaults_to_4096_capped_by_training_and_floored():
    assert choose_context(Shape()) == 4096
    assert choose_context(Shape(context_length=2048)) == 2048
    assert choose_context(Shape(), requested=100_000) == 8192
    assert choose_context(Shape(), requested=64) == 512


def test_no_vram_means_cpu_only():
    plan = plan_load(Shape(), None)
    assert (plan.n_gpu_layers, plan.offloaded_layers) == (0, 0)
    assert "CPU" in plan.reason


def test_everything_fits_on_a_big_card():
    plan = plan_load(Shape(), 24_000)
    assert plan.n_gpu_layers == 33  # more than the block count: output layer too
    assert plan.offloaded_layers == 32
    assert plan.vram_needed_mb == 32 * (200 + 16) + 500


def test_partial_offload_keeps_the_safety_margin():
    free = 4000
    plan = plan_load(Shape(), free)
    budget = free - safety_margin_mb(free)  # 3488 MB
    assert plan.n_gpu_layers == budget // 216  # 16 layers of 216 MB
    assert plan.vram_needed_mb <= budget
    assert "16 of 32 layers" in plan.reason


def test_margin_is_ten_percent_but_at_least_512_mb():
    assert safety_margin_mb(2000) == 512
    assert safety_margin_mb(24_000) == 2400


def test_tiny_card_gets_no_layers():
    assert plan_load(Shape(), 600).n_gpu_layers == 0


def test_owner_override_wins():
    plan = plan_load(Shape(), None, gpu_layers=10)
    assert plan.n_gpu_layers == 10
    assert plan.reason == "set by the owner"
    assert plan_load(Shape(), 24_000, gpu_layers=0).n_gpu_layers == 0


def test_bigger_context_means_fewer_layers():
    small = plan_load(Shape(), 6000, n_ctx=2048)
    large = plan_load(Shape(), 6000, n_ctx=8192)
    assert small.n_gpu_layers > large.n_gpu_layers


@pytest.mark.parametrize(
    ("need", "expected"),
    [(100, []), (600, ["old"]), (1500, ["old", "mid"]), (5000, ["old", "mid"])],
)
def test_evictions_pick_idle_models_least_recently_used_first(need, expected):
    residents = [
        Resident("busy-oldest", 500, last_used=0.0, busy=True),
        Resident("old", 500, last_used=1.0, busy=False),
        Resident("mid", 800, last_used=2.0, busy=False),
    ]
    assert choose_evictions(residents, need, budget_mb=2000) == expected
