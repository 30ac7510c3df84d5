"""Rendering in a sandboxed image child (issue 38): the child is confined like a context child
(it reads its model and nothing of the volunteer's, writes only its scratch folder, opens no
socket, and has a memory limit of its model plus stable-diffusion.cpp's buffers); through it the
real stable-diffusion.cpp renders exactly what it renders in a plain process; a child that dies
fails nothing after it (the next job starts a new one); a cancel stops an order before its next
image; and a model file swapped for a bad one after the store checked it never loads."""

from __future__ import annotations

import asyncio
import shutil
import sys
import threading
from pathlib import Path

import pytest

from desktop_worker.errors import GenerationCancelled, ModelLoadError
from desktop_worker.sandbox import landlock
from desktop_worker.sandbox.images import SandboxedImages, image_policy
from desktop_worker.sandbox.policy import RUNTIME_ALLOWANCE_MB, policy_for
from shared_schema.images import IMAGE_COMPUTE_MB, ImageOrder
from tests.desktop_worker.sandbox.test_confinement import DENIED, run_hostile
from tests.desktop_worker.sandbox.test_confinement import targets as targets
from tests.support.diffusion_fixture import (  # noqa: F401  (fixtures)
    diffusion_model,
    other_diffusion_model,
)

pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"),
                                 reason="the engine sandbox is Linux's (seccomp, Landlock)"),
              pytest.mark.timeout(300)]

LANDLOCK = landlock.abi_version()


def order(**changes: object) -> ImageOrder:
    values = {"model": "m", "prompt": "a beehive at dawn", "width": 64, "height": 64,
              "steps": 2, "guidance": 1.0, "sampler": "euler_a", "seed": 5, "n": 2}
    return ImageOrder(**{**values, **changes})


@pytest.fixture
async def engine():
    images = SandboxedImages(n_threads=2)
    yield images
    await images.close()


def test_an_image_child_reaches_nothing_but_its_model_and_scratch(targets, tmp_path,
                                                                  diffusion_model) -> None:  # noqa: F811
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    files, memory_mb = image_policy(diffusion_model.path, None)
    assert files == [str(diffusion_model.path)]  # the model alone, read-only
    assert memory_mb == -(-diffusion_model.size_bytes // 2**20) + IMAGE_COMPUTE_MB
    policy = policy_for("image", scratch=str(scratch), model_files=[targets["model"]],
                        memory_mb=64)
    assert policy.memory_mb == 64 + RUNTIME_ALLOWANCE_MB
    other = Path(targets["model"]).parent / "another-model.gguf"  # the rest of the store
    other.write_bytes(b"GGUF another owner's model")
    for secret in (targets["key"], str(other)):
        report = run_hostile("image", policy, {**targets, "key": secret})
        results, confinement = report["results"], report["confinement"]
        assert confinement["seccomp"], confinement
        assert confinement["no_new_privs"], confinement
        assert results["read_model"] == "ok"
        assert results["write_scratch"] == "ok"
        for reach in ("dial_tcp", "listen", "udp", "dial_unix", "shell", "fork"):
            assert results[reach] in DENIED, reach
        assert results["allocate_past_limit"] == "MemoryError"
        if LANDLOCK >= 1:
            assert results["read_key"] in DENIED
            assert results["write_outside"] in DENIED


async def test_the_child_renders_what_the_engine_renders_in_a_plain_process(
        engine, diffusion_model) -> None:  # noqa: F811
    from desktop_worker.engine.diffusion import DiffusionModel

    rendered = await engine.render(diffusion_model.path, order(), threading.Event())
    assert rendered.family == "sdxs"
    assert [image.seed for image in rendered.images] == [5, 6]
    child = engine._children[diffusion_model.path].process
    assert child.link.hello is not None
    assert child.link.hello.confinement.seccomp
    with DiffusionModel(diffusion_model.path, n_threads=2) as plain:
        assert plain.render(order()) == rendered.images  # byte for byte, both images
    again = await engine.render(diffusion_model.path, order(seed=6, n=1), threading.Event())
    assert again.images[0].b64_json == rendered.images[1].b64_json
    assert engine._children[diffusion_model.path].process is child  # kept loaded


async def test_a_dead_child_is_replaced_by_the_next_job(engine, diffusion_model) -> None:  # noqa: F811
    first = await engine.render(diffusion_model.path, order(n=1), threading.Event())
    child = engine._children[diffusion_model.path].process
    child.kill()
    await asyncio.to_thread(child.wait)
    second = await engine.render(diffusion_model.path, order(n=1), threading.Event())
    assert second.images == first.images
    assert engine._children[diffusion_model.path].process is not child


async def test_a_cancel_stops_the_order_and_the_model_stays_loaded(engine,
                                                                   diffusion_model) -> None:  # noqa: F811
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(GenerationCancelled):
        await engine.render(diffusion_model.path, order(), cancel)
    done = await engine.render(diffusion_model.path, order(n=1), threading.Event())
    assert len(done.images) == 1


async def test_one_model_at_a_time_and_a_swapped_file_never_loads(
        engine, diffusion_model, other_diffusion_model, tmp_path) -> None:  # noqa: F811
    ours = await engine.render(diffusion_model.path, order(n=1), threading.Event())
    theirs = await engine.render(other_diffusion_model.path, order(n=1), threading.Event())
    assert ours.images != theirs.images
    assert engine.loaded() == [other_diffusion_model.path]  # max_models=1: the first ended
    swapped = tmp_path / "swapped.gguf"
    shutil.copyfile(diffusion_model.path, swapped)
    with swapped.open("r+b") as handle:  # truncated after the store's check
        handle.truncate(diffusion_model.size_bytes // 2)
    with pytest.raises(ModelLoadError, match="did not load"):
        await engine.render(swapped, order(n=1), threading.Event())
    assert swapped not in engine.loaded()


class Budget:
    """The owner's memory budget as the image engine sees it (``MemoryBudget``): what is held
    under each key now, and every call in order."""

    def __init__(self) -> None:
        self.held: dict[str, int] = {}
        self.calls: list[tuple[str, str]] = []

    async def reserve(self, key: str, memory_mb: int) -> None:
        self.calls.append(("reserve", key))
        self.held[key] = memory_mb

    def release(self, key: str) -> None:
        self.calls.append(("release", key))
        self.held.pop(key, None)


async def test_a_child_s_memory_is_reserved_from_the_budget_while_it_lives(
        diffusion_model, other_diffusion_model) -> None:  # noqa: F811
    budget = Budget()
    engine = SandboxedImages(n_threads=2, memory=budget)
    try:
        await engine.render(diffusion_model.path, order(n=1), threading.Event())
        ours = f"image:{diffusion_model.path}"
        assert budget.held == {ours: image_policy(diffusion_model.path, None)[1]}
        await engine.render(other_diffusion_model.path, order(n=1), threading.Event())
        theirs = f"image:{other_diffusion_model.path}"
        assert budget.held == {theirs: image_policy(other_diffusion_model.path, None)[1]}
        # the first child ended (and gave its memory back) before the second was reserved
        assert budget.calls == [("reserve", ours), ("release", ours), ("reserve", theirs)]
    finally:
        await engine.close()
    assert budget.held == {}


async def test_an_owner_who_keeps_models_off_the_gpu_keeps_image_children_off_it(
        monkeypatch, diffusion_model) -> None:  # noqa: F811
    """``gpu_layers=0``: the worker makes its image engine with ``gpus=False``, and its child
    is given none of the GPU's device files even where the machine has them; it renders on
    the CPU."""
    from desktop_worker.sandbox import policy

    monkeypatch.setattr(policy, "device_paths", lambda: ["/dev/nvidia0", "/dev/nvidiactl"])
    engine = SandboxedImages(n_threads=2, gpus=False)
    try:
        done = await engine.render(diffusion_model.path, order(n=1), threading.Event())
        assert len(done.images) == 1
        assert engine.last_policy is not None
        assert engine.last_policy.device_paths == []
        assert not engine.last_policy.gpu_driver
    finally:
        await engine.close()
    assert SandboxedImages().gpus  # the default: the GPU where there is one
