"""The image role of the engine protocol (issue 38) on its own: the worker walks an image child
through its load and one render at a time, and refuses whatever a hostile child could send
instead (a context's replies, images for no job, two answers to one job, a reply of the wrong
kind) before any of it reaches the job; a context child may not be handed image commands."""

from __future__ import annotations

import pytest

from desktop_worker.errors import EngineError, EngineProtocolError
from desktop_worker.sandbox.images import checked_images
from desktop_worker.sandbox.ipc import ChildLink, EngineLink, State, frame
from shared_schema.engine_ipc import (
    ENGINE_IPC_VERSION,
    Confinement,
    Done,
    Failed,
    Hello,
    ImageLoaded,
    Load,
    Loaded,
    LoadImage,
    Render,
    Rendered,
    SandboxPolicy,
    encode,
)
from shared_schema.images import ImageOrder

POLICY = SandboxPolicy(read_paths=["/usr"], scratch="/tmp/x")
HELLO = Hello(version=ENGINE_IPC_VERSION, pid=42, confinement=Confinement(os="linux"))
ORDER = ImageOrder(model="m", prompt="a hive", width=64, height=64, steps=2, guidance=7.0,
                   sampler="euler_a", seed=9, n=2)
IMAGES = [{"b64_json": "iVBORw0KGgo=", "seed": 9}, {"b64_json": "iVBORw0KGgo=", "seed": 10}]


def wire(message) -> bytes:  # type: ignore[no-untyped-def]
    return frame(encode(message))


def loaded_link() -> EngineLink:
    link = EngineLink("image")
    link.start(POLICY)
    link.receive(wire(HELLO))
    sent = link.load_image(LoadImage(model_path="/m.gguf", n_threads=2))
    assert ChildLink().receive(sent)[0] == LoadImage(model_path="/m.gguf", n_threads=2)
    [loaded] = link.receive(wire(ImageLoaded(family="sdxs")))
    assert loaded.family == "sdxs"
    assert link.state is State.READY
    return link


def test_an_image_child_loads_then_renders_one_order_at_a_time() -> None:
    link = loaded_link()
    job = link.next_job()
    sent = link.render(Render(job=job, order=ORDER.model_dump(mode="json")))
    assert ChildLink().receive(sent)[0].order["seed"] == 9
    with pytest.raises(EngineProtocolError, match="1 jobs at once"):
        link.render(Render(job=link.next_job(), order=ORDER.model_dump(mode="json")))
    assert link.cancel(job) is not None  # a render can be cancelled (between its images)
    [rendered] = link.receive(wire(Rendered(job=job, images=IMAGES, render_s=1.5)))
    assert checked_images(rendered, ORDER)[1].seed == 10
    assert link.in_flight == 0
    second = link.next_job()
    link.render(Render(job=second, order=ORDER.model_dump(mode="json")))
    [failed] = link.receive(wire(Failed(job=second, code="engine_error", message="boom")))
    assert failed.code == "engine_error"
    assert link.state is State.READY


@pytest.mark.parametrize("reply", [
    Rendered(job=7, images=IMAGES),  # for no job in flight
    Done(job=1, prompt_tokens=0, completion_tokens=0, total_tokens=0),  # a context's reply
    Loaded(n_ctx=512),  # a context's load reply, out of turn
])
def test_a_hostile_image_childs_reply_out_of_turn_ends_it(reply) -> None:  # type: ignore[no-untyped-def]
    link = loaded_link()
    link.render(Render(job=link.next_job(), order=ORDER.model_dump(mode="json")))
    with pytest.raises(EngineProtocolError):
        link.receive(wire(reply))
    assert link.state is State.CLOSED


def test_a_context_child_is_handed_no_image_commands_and_may_not_answer_as_one() -> None:
    link = EngineLink("context")
    link.start(POLICY)
    link.receive(wire(HELLO))
    with pytest.raises(EngineProtocolError, match="no diffusion model"):
        link.load_image(LoadImage(model_path="/m.gguf"))
    link.load(Load(name="smol", model_path="/m.gguf", n_ctx=512, n_gpu_layers=0))
    with pytest.raises(EngineProtocolError, match="from a context child"):
        link.receive(wire(ImageLoaded(family="sdxs")))
    image = EngineLink("image")
    image.start(POLICY)
    image.receive(wire(HELLO))
    image.load_image(LoadImage(model_path="/m.gguf"))
    with pytest.raises(EngineProtocolError, match="from a image child"):
        image.receive(wire(Loaded(n_ctx=512)))


@pytest.mark.parametrize("images", [
    IMAGES[:1],  # one short
    [IMAGES[1], IMAGES[0]],  # out of order
    [IMAGES[0], {"b64_json": "", "seed": 10}],  # empty
    [IMAGES[0], {"b64_json": "x", "seed": 10, "path": "/etc/passwd"}],  # a field too many
])
def test_a_childs_images_must_be_one_per_seed_of_the_order(images) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(EngineError):
        checked_images(Rendered(job=1, images=images), ORDER)
