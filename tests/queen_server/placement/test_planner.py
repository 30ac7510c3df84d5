"""The planner on made-up swarms: who fits a model, in what order the queen asks them, the
needs it computes with the worker's own fitting rules, and the operator's repo lists."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from queen_server.placement.planner import (
    ModelNeed,
    choose,
    fit_problem,
    image_need,
    need_of,
    repo_allowed,
    whole_in_vram,
)
from shared_schema import DownloadProgress, ModelDescriptor
from shared_schema.capabilities import IMAGE
from shared_schema.fitting import (
    MB,
    choose_context,
    kv_bytes_per_layer,
    memory_cost_mb,
    plan_load,
    safety_margin_mb,
)
from shared_schema.gguf_shape import GgufShape
from shared_schema.images import IMAGE_COMPUTE_MB, diffusion_memory_mb

SHA = "a" * 64
OTHER_SHA = "b" * 64
NAME = "org/m-GGUF:Q4_K_M"


@dataclass
class FakeWorker:
    """What placement reads of a worker (``PlacementView``), and nothing else."""

    key: str
    model_room_mb: int | None = 100_000
    memory_budget_mb: int | None = 100_000
    vram_free_mb: int | None = None
    swarm_models: bool = False
    takes_fetch: bool = True
    paused: str | None = None
    flagged: bool = False
    closed: bool = False
    models: dict[str, ModelDescriptor] = field(default_factory=dict)
    downloads: dict[str, DownloadProgress] = field(default_factory=dict)
    capabilities: frozenset[str] = frozenset()


def need(size_mb: int = 1000, memory_mb: int = 1500, full_mb: int = 1600) -> ModelNeed:
    return ModelNeed(NAME, SHA, size_mb * MB, memory_mb, full_mb)


def keys(workers: list[FakeWorker]) -> list[str]:
    return [w.key for w in workers]


# --- fit_problem ---------------------------------------------------------------------------


@pytest.mark.parametrize(("changes", "problem"), [
    ({}, None),
    ({"takes_fetch": False}, "takes no fetches"),
    ({"paused": "on battery"}, "paused, flagged or gone"),
    ({"flagged": True}, "paused, flagged or gone"),
    ({"closed": True}, "paused, flagged or gone"),
    ({"model_room_mb": None}, "did not say its room"),
    ({"memory_budget_mb": None}, "did not say its room"),
    ({"model_room_mb": 999}, "999 MB of room for models, the file needs 1,000"),
    ({"model_room_mb": 1000}, None),  # exactly the file's size
    ({"memory_budget_mb": 1499}, "a 1,499 MB memory budget, the model needs 1,500"),
    ({"memory_budget_mb": 1500}, None),
    ({"model_room_mb": 0, "memory_budget_mb": 0}, "0 MB of room"),
])
def test_fit_problem(changes: dict[str, object], problem: str | None) -> None:
    worker = FakeWorker("w", **changes)  # type: ignore[arg-type]
    found = fit_problem(worker, need())
    if problem is None:
        assert found is None
    else:
        assert found is not None
        assert problem in found


def test_room_is_megabytes_and_the_file_is_bytes() -> None:
    # One byte over a whole number of MB needs one MB more of room.
    odd = ModelNeed(NAME, SHA, 1000 * MB + 1, 10, 10)
    assert fit_problem(FakeWorker("w", model_room_mb=1000), odd) is not None
    assert "needs 1,001" in (fit_problem(FakeWorker("w", model_room_mb=1000), odd) or "")
    assert fit_problem(FakeWorker("w", model_room_mb=1001), odd) is None


# --- need_of -------------------------------------------------------------------------------


SHAPE = GgufShape(architecture="llama", block_count=4, context_length=8192,
                  embedding_length=512, head_count=8, head_count_kv=2,
                  layer_bytes=(30 * MB, 30 * MB, 30 * MB, 31 * MB), other_bytes=50 * MB,
                  has_chat_template=True)


def test_need_of_uses_the_workers_own_memory_rule() -> None:
    size = 171 * MB + 12345
    got = need_of(NAME, SHA, size, SHAPE)
    assert got.memory_mb == memory_cost_mb(SHAPE, size)
    context = choose_context(SHAPE)
    assert context == 4096  # the default context, within the 8192 the model was trained for
    kv = kv_bytes_per_layer(SHAPE, context)
    assert kv == 2 * 4096 * 2 * 64 * 2
    assert got.memory_mb == (size + 4 * kv) // MB
    assert got.full_offload_mb == -(-(121 * MB + 4 * kv + 50 * MB) // MB)
    assert (got.name, got.sha256, got.size_bytes) == (NAME, SHA, size)


def test_full_offload_agrees_with_plan_load_at_the_boundary() -> None:
    got = need_of(NAME, SHA, 171 * MB, SHAPE)
    whole = "the whole model fits in VRAM"
    fits = [free for free in range(got.full_offload_mb, got.full_offload_mb + 2000)
            if whole_in_vram(FakeWorker("w", vram_free_mb=free), got)]
    least = fits[0]
    assert least - safety_margin_mb(least) == got.full_offload_mb
    assert plan_load(SHAPE, least).reason == whole
    assert plan_load(SHAPE, least - 1).reason != whole
    assert not whole_in_vram(FakeWorker("w", vram_free_mb=least - 1), got)


def test_need_of_without_a_shape_is_the_file_alone() -> None:
    got = need_of(NAME, SHA, 10 * MB + 1, None)
    assert got.memory_mb == got.full_offload_mb == 11


@pytest.mark.parametrize("free", [None, 0])
def test_no_vram_is_never_whole_in_vram(free: int | None) -> None:
    assert not whole_in_vram(FakeWorker("w", vram_free_mb=free), need(full_mb=1))


# --- choose --------------------------------------------------------------------------------


def test_choose_prefers_opt_in_then_whole_in_vram_then_speed_then_room() -> None:
    n = need(full_mb=1600)  # fits 8 GB of free VRAM (margin 819), not 2 GB (margin 512)
    workers = [
        FakeWorker("roomy", model_room_mb=900_000),
        FakeWorker("slow-gpu", vram_free_mb=8192),
        FakeWorker("fast-gpu", vram_free_mb=8192),
        FakeWorker("small-gpu", vram_free_mb=2000),
        FakeWorker("opted-in-cpu", swarm_models=True),
        FakeWorker("opted-in-gpu", swarm_models=True, vram_free_mb=8192),
        FakeWorker("fast-cpu"),
    ]
    speeds = {"slow-gpu": 0.2, "fast-gpu": 0.01, "fast-cpu": 0.001, "roomy": 0.05,
              "small-gpu": 0.05, "opted-in-cpu": 0.5, "opted-in-gpu": 0.9}
    assert keys(choose(n, workers, speeds, 10)) == [
        "opted-in-gpu", "opted-in-cpu",  # opted in first, even when slow
        "fast-gpu", "slow-gpu",  # then whole in VRAM, fastest first
        "fast-cpu", "roomy", "small-gpu",  # then speed; the tie (0.05) goes to the most room
    ]


def test_a_worker_with_no_speed_record_ranks_at_the_median() -> None:
    workers = [FakeWorker("fast"), FakeWorker("new"), FakeWorker("slow"), FakeWorker("mid")]
    speeds = {"fast": 0.01, "mid": 0.05, "slow": 0.09}
    got = keys(choose(need(), workers, speeds, 4))
    assert got.index("fast") < got.index("new") < got.index("slow")
    # No records at all: the room decides.
    workers = [FakeWorker("a", model_room_mb=5000), FakeWorker("b", model_room_mb=9000)]
    assert keys(choose(need(), workers, {}, 2)) == ["b", "a"]


def test_choose_keeps_the_best_count() -> None:
    workers = [FakeWorker(f"w{i}", model_room_mb=10_000 + i) for i in range(50)]
    assert keys(choose(need(), workers, {}, 3)) == ["w49", "w48", "w47"]
    assert choose(need(), workers, {}, 0) == []


def test_choose_skips_excluded_holding_and_downloading_workers() -> None:
    progress = DownloadProgress(name=NAME, downloaded_bytes=10, total_bytes=1000 * MB)
    workers = [
        FakeWorker("failed-it"),
        FakeWorker("holds-it", models={NAME: ModelDescriptor(name=NAME, sha256=SHA)}),
        FakeWorker("fetching-it", downloads={NAME: progress}),
        FakeWorker("holds-another-file",
                   models={NAME: ModelDescriptor(name=NAME, sha256=OTHER_SHA)}),
        FakeWorker("holds-it-unhashed", models={NAME: ModelDescriptor(name=NAME)}),
        FakeWorker("too-small", model_room_mb=10),
        FakeWorker("paused", paused="gpu in use"),
        FakeWorker("free"),
    ]
    got = keys(choose(need(), workers, {}, 10, exclude={"failed-it"}))
    # Another file under the name (or one of unknown sha256) is not the pinned one: it may
    # fetch the pinned file.
    assert sorted(got) == ["free", "holds-another-file", "holds-it-unhashed"]


def test_a_download_of_another_model_does_not_exclude_a_worker() -> None:
    other = DownloadProgress(name="org/other:Q8_0", downloaded_bytes=1)
    assert keys(choose(need(), [FakeWorker("w", downloads={"org/other:Q8_0": other})], {},
                       1)) == ["w"]


def test_choose_takes_real_workers() -> None:
    from queen_server.swarm.worker import Worker
    from shared_schema.capabilities import FETCH

    worker = Worker(key="k" * 64, public_id="w", session_id="s", capabilities=[FETCH])
    worker.model_room_mb, worker.memory_budget_mb = 5000, 5000
    assert choose(need(), [worker], {}, 1) == [worker]
    legacy = Worker(key="l" * 64, public_id="l", session_id="s", capabilities=[FETCH],
                    legacy=True)
    legacy.model_room_mb, legacy.memory_budget_mb = 5000, 5000
    assert choose(need(), [legacy], {}, 1) == []  # a legacy worker cannot be sent a fetch


# --- repo_allowed --------------------------------------------------------------------------


@pytest.mark.parametrize(("repo", "allow", "deny", "allowed"), [
    ("bartowski/Llama-GGUF", [], [], True),  # no lists: everything
    ("bartowski/Llama-GGUF", ["bartowski/*"], [], True),
    ("BARTOWSKI/llama-gguf", ["bartowski/*"], [], True),  # case does not matter
    ("bartowski/Llama-GGUF", ["Bartowski/*"], [], True),
    ("unsloth/Llama-GGUF", ["bartowski/*"], [], False),
    ("unsloth/Llama-GGUF", ["bartowski/*", "unsloth/*-GGUF"], [], True),
    ("unsloth/Llama", ["unsloth/*-GGUF"], [], False),
    ("evil/Llama-GGUF", [], ["evil/*"], False),
    ("EVIL/x", [], ["evil/*"], False),
    ("evil/Llama-GGUF", ["*"], ["evil/*"], False),  # a deny wins over an allow
    ("evil/Llama-GGUF", ["evil/*"], ["evil/*"], False),
    ("good/Llama-GGUF", ["*"], ["evil/*"], True),
    ("org/model?x", ["org/model[?]x"], [], True),  # shell patterns, not regexes
    ("org/modelAx", ["org/model[?]x"], [], False),
])
def test_repo_allowed(repo: str, allow: list[str], deny: list[str], allowed: bool) -> None:
    why = repo_allowed(repo, allow, deny)
    assert (why is None) == allowed
    if not allowed:
        assert repo in (why or "")
        assert ("deny-list" in (why or "")) == bool(deny and "evil" in repo.lower())


# --- diffusion models (issue 38) -------------------------------------------------------------


def test_an_image_model_needs_its_weights_and_the_largest_image_s_compute() -> None:
    made = image_need(NAME, SHA, 500 * MB)
    assert made.kind == "image"
    assert made.memory_mb == made.full_offload_mb == diffusion_memory_mb(500 * MB)
    assert made.memory_mb == 500 + IMAGE_COMPUTE_MB  # what its sandboxed child is allowed


def test_an_image_model_goes_only_to_workers_that_make_images() -> None:
    made = image_need(NAME, SHA, 500 * MB)
    text = FakeWorker("text", swarm_models=True)
    image = FakeWorker("image", capabilities=frozenset({IMAGE}))
    assert fit_problem(text, made) == "makes no images (its owner has not turned images on)"
    assert fit_problem(image, made) is None
    assert keys(choose(made, [text, image], {}, 2)) == ["image"]
    tight = FakeWorker("tight", capabilities=frozenset({IMAGE}),
                       memory_budget_mb=made.memory_mb - 1)
    assert "memory budget" in (fit_problem(tight, made) or "")
    assert fit_problem(text, need()) is None  # a text model still goes anywhere that fits
