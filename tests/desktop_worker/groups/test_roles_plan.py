"""The pure part of a head's lead (issue 19): the queen's layer counts as the head's config
(members' devices first in the message's order, then the head's own GPUs; a RAM-only head's
one count on its CPU), every plan that cannot work refused as ``bad_plan``, and the pool's
context factory: a group's model gets heads and no embeddings, every other model the usual
context."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from desktop_worker.errors import GroupPartFailed, UnsupportedRequest
from desktop_worker.groups.lead import GroupBinding, GroupContexts, head_config, head_layers
from shared_schema import GroupLead, GroupLink
from shared_schema.fitting import LoadPlan

PLAN = LoadPlan(n_ctx=512, n_gpu_layers=0, offloaded_layers=0, vram_needed_mb=0, reason="")


def lead(head: list[int], *members: list[int]) -> GroupLead:
    links = [GroupLink(worker_id=f"m{i}", host="192.168.1.2", port=40000 + i,
                       fingerprint="ab" * 32, token="cd" * 32, device_layers=layers)
             for i, layers in enumerate(members)]
    return GroupLead(group="0" * 16, head="h", model="big", n_ctx=4096, head_layers=head,
                     members=links)


def test_a_ram_only_head_keeps_its_count_on_its_cpu() -> None:
    assert head_layers(lead([10], [20, 5], [5]), 40, 0) == (10, (20, 5, 5))


def test_a_head_with_gpus_puts_its_layers_after_the_members() -> None:
    assert head_layers(lead([6, 4], [20], [10]), 40, 2) == (0, (20, 10, 6, 4))
    assert head_layers(lead([10], [30]), 40, 1) == (0, (30, 10))


@pytest.mark.parametrize(("message", "n_layer", "gpus", "why"), [
    (lead([10], [20]), 40, 0, "places 30 layers"),  # too few
    (lead([10], [40]), 40, 0, "places 50 layers"),  # too many
    (lead([5, 5], [30]), 40, 0, "no GPU offload"),  # GPU counts on a RAM-only head
    (lead([5, 5, 5], [25]), 40, 2, "3 GPUs; it has 2"),
    (lead([0], *[[1] * 16] * 2), 32, 0, "at most 16 devices"),  # llama.cpp's device limit
])
def test_plans_that_cannot_work_are_bad_plans(message, n_layer, gpus, why) -> None:
    with pytest.raises(GroupPartFailed, match=why) as caught:
        head_layers(message, n_layer, gpus)
    assert caught.value.code == "bad_plan"


def test_the_config_follows_the_member_order_and_the_message() -> None:
    config = head_config(lead([10], [20], [10]), model_path="/m.gguf", n_layer=40,
                         endpoints=["127.0.0.1:1", "127.0.0.1:2"], head_gpus=0, n_threads=3)
    assert config.endpoints == ("127.0.0.1:1", "127.0.0.1:2")
    assert (config.cpu_layers, config.device_layers) == (10, (20, 10))
    assert (config.n_ctx, config.n_layer, config.name, config.n_threads) == (4096, 40, "big", 3)
    assert config.output_on_cpu  # a RAM-only head keeps the output matrix itself
    with_gpu = head_config(lead([10], [30]), model_path="/m.gguf", n_layer=40,
                           endpoints=["127.0.0.1:1"], head_gpus=1, n_threads=3)
    assert not with_gpu.output_on_cpu  # its last device is its own GPU
    with pytest.raises(GroupPartFailed):
        head_config(lead([10], [30]), model_path="/m.gguf", n_layer=40, endpoints=[],
                    head_gpus=0, n_threads=1)


@dataclass(frozen=True)
class Model:
    name: str
    path: str = "/m.gguf"


def test_the_factory_serves_other_models_as_before_and_groups_no_embeddings() -> None:
    made: list[tuple[str, bool]] = []

    def fallback(model: Any, plan: LoadPlan, n_threads: int | None, embedding: bool) -> str:
        made.append((model.name, embedding))
        return "plain"

    contexts = GroupContexts(fallback)
    config = head_config(lead([10], [30]), model_path="/m.gguf", n_layer=40,
                         endpoints=["127.0.0.1:1"], head_gpus=0, n_threads=1)
    failures: list[BaseException] = []

    def broken() -> None:
        raise GroupPartFailed("lost", "a member is gone")

    contexts.bind("big", GroupBinding("0" * 16, config, prepare=broken, failed=failures.append))
    assert contexts(Model("small"), PLAN, 1, True) == "plain"
    assert made == [("small", True)]
    assert (contexts.max_contexts("big"), contexts.max_contexts("small")) == (1, None)
    with pytest.raises(UnsupportedRequest, match="embeddings"):
        contexts(Model("big"), PLAN, 1, True)
    with pytest.raises(GroupPartFailed):  # a head that cannot be made is told to the roles
        contexts(Model("big"), PLAN, 1, False)
    assert [str(f) for f in failures] == ["a member is gone"]
    contexts.close("big", "f" * 16)  # another group's close leaves this one
    assert contexts.binding("big") is not None
    contexts.close("big", "0" * 16)
    assert contexts.binding("big") is None
    assert contexts(Model("big"), PLAN, 1, False) == "plain"


@dataclass(frozen=True)
class Dialer:
    endpoint: str


def test_the_member_short_of_memory_is_found_by_its_dialers_endpoint() -> None:
    """A head's load that failed on a member's allocation (a ``MemberShort`` somewhere in the
    causes, as the pool wraps it) names that member's public id; any other failure none."""
    from desktop_worker.errors import GroupError, MemberShort
    from desktop_worker.groups.roles import _short_member

    message = lead([2], [3], [3])
    dialers = [Dialer("127.0.0.1:5001"), Dialer("127.0.0.1:5002")]
    wrapped = GroupError("the pool could not load big")
    wrapped.__cause__ = MemberShort("127.0.0.1:5002", "could not allocate")
    assert _short_member(wrapped, dialers, message) == "m1"  # type: ignore[arg-type]
    assert _short_member(MemberShort("127.0.0.1:9", "x"), dialers,  # type: ignore[arg-type]
                         message) is None  # not one of this head's dialers
    assert _short_member(GroupError("other"), dialers, message) is None  # type: ignore[arg-type]
