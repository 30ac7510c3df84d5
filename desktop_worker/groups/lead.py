"""The head's side of a queen-formed group (issue 19): the queen's layer counts as a
``HeadConfig`` (pure, ``head_layers``), and ``GroupContexts``, the ``ModelPool`` context factory
that gives a model with an active group a ``GroupHead`` and every other model its usual
context.

llama.cpp orders a head's devices RPC servers first, in the order they were added, then its
own GPUs (``groups/layout.py``). So the members' device counts come first, in the order the
queen listed the members, and the head's own counts last. A head without GPU offload has one
entry in ``head_layers``: the first layers, on its CPU.

A head uploads every weight it does not hold to its members when it loads, so a group model
never gets a second head at once: ``max_contexts`` says 1 for it, and the pool keeps to it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from desktop_worker.engine.pool import ContextFactory
from desktop_worker.errors import GroupError, GroupPartFailed, UnsupportedRequest
from desktop_worker.groups.head import GroupHead, HeadConfig
from desktop_worker.groups.layout import load_layout
from desktop_worker.sandbox.context import SandboxedContexts
from shared_schema.fitting import LoadPlan, memory_cost_mb
from shared_schema.groups import GroupLead

log = logging.getLogger(__name__)


def head_layers(lead: GroupLead, n_layer: int, head_gpus: int) -> tuple[int, tuple[int, ...]]:
    """``(cpu_layers, device_layers)`` for ``HeadConfig`` from the queen's plan, or
    ``GroupPartFailed("bad_plan")`` when the plan does not fit this model or this head.

    ``head_gpus``: how many local GPUs the head offloads to (0: a RAM-only head, whose one
    ``head_layers`` entry is its CPU layers)."""
    members = [count for link in lead.members for count in link.device_layers]
    if head_gpus <= 0:
        if len(lead.head_layers) != 1:
            raise GroupPartFailed("bad_plan", f"this head has no GPU offload, so its layers are "
                                  f"one CPU count, not {len(lead.head_layers)}")
        cpu, devices = lead.head_layers[0], tuple(members)
    else:
        if len(lead.head_layers) > head_gpus:
            raise GroupPartFailed("bad_plan", f"the plan gives this head {len(lead.head_layers)} "
                                  f"GPUs; it has {head_gpus}")
        cpu, devices = 0, (*members, *lead.head_layers)
    placed = cpu + sum(devices)
    if placed != n_layer:
        raise GroupPartFailed("bad_plan", f"the plan places {placed} layers; {lead.model} "
                              f"has {n_layer}")
    try:
        load_layout(n_layer, cpu, devices)
    except GroupError as exc:
        raise GroupPartFailed("bad_plan", str(exc)) from exc
    return cpu, devices


def head_config(lead: GroupLead, *, model_path: str, n_layer: int, endpoints: Sequence[str],
                head_gpus: int, n_threads: int | None) -> HeadConfig:
    """The head process's config: the dialers' ``endpoints`` in the message's member order."""
    if len(endpoints) != len(lead.members):
        raise GroupPartFailed("bad_plan", "one endpoint per member is needed")
    cpu, devices = head_layers(lead, n_layer, head_gpus)
    # A head without a GPU keeps the output matrix in its RAM (where the queen's plan counts
    # it): the last member then returns the hidden state, not every token's logits.
    return HeadConfig(name=lead.model, model_path=model_path, n_ctx=lead.n_ctx, n_layer=n_layer,
                      endpoints=tuple(endpoints), cpu_layers=cpu, device_layers=devices,
                      n_threads=n_threads, output_on_cpu=head_gpus <= 0)


@dataclass
class GroupBinding:
    """One model served by a group: its head's config, what runs before each new head
    (``prepare``: checks the links, blocking; raises when one is broken) and who hears of a
    head that could not be made (``failed``: called from the pool's thread)."""

    group: str
    config: HeadConfig
    prepare: Callable[[], None]
    failed: Callable[[BaseException], None]
    heads: list[GroupHead] = field(default_factory=list)
    closed: bool = False  # the group ended: a head made meanwhile is closed, not served


class GroupContexts:
    """``ModelPool``'s context factory: a model with a group gets a ``GroupHead``, every other
    model ``fallback``'s context (an engine child, or ``LocalGroup``'s head under
    --local-group)."""

    def __init__(self, fallback: ContextFactory | None = None) -> None:
        self.fallback: ContextFactory = fallback or SandboxedContexts()
        self._groups: dict[str, GroupBinding] = {}
        self._lock = threading.Lock()  # the pool calls from its threads

    def bind(self, model: str, binding: GroupBinding) -> None:
        with self._lock:
            self._groups[model] = binding

    def close(self, model: str, group: str) -> None:
        """Forget ``model``'s group (only if it is still ``group``'s); a head being made for
        it now is closed rather than served."""
        with self._lock:
            binding = self._groups.get(model)
            if binding is not None and binding.group == group:
                binding.closed = True
                del self._groups[model]

    def binding(self, model: str) -> GroupBinding | None:
        with self._lock:
            return self._groups.get(model)

    def max_contexts(self, model: str) -> int | None:
        """For ``ModelPool(max_contexts=)``: one head at a time for a group model."""
        return 1 if self.binding(model) is not None else None

    @property
    def batched(self) -> bool:
        """A model outside any group batches its jobs when the fallback's contexts do."""
        return bool(getattr(self.fallback, "batched", False))

    def __call__(self, model: Any, plan: LoadPlan, n_threads: int | None,
                 embedding: bool, slots: int = 1) -> Any:
        binding = self.binding(model.name)
        if binding is None:
            if slots > 1:
                return self.fallback(model, plan, n_threads, embedding, slots=slots)
            return self.fallback(model, plan, n_threads, embedding)
        if embedding:
            raise UnsupportedRequest("a model group serves chat and completions, not embeddings")
        info = getattr(model, "info", None)  # the head's memory limit: the model's cost here
        head = GroupHead(binding.config, memory_mb=memory_cost_mb(
            info, model.size_bytes, plan.n_ctx, 1) if info is not None else None)
        try:
            binding.prepare()
            report = head.start()
        except Exception as exc:  # every reason a head was not made goes to the roles
            binding.failed(exc)
            raise
        with self._lock:
            ended = binding.closed
            if not ended:
                binding.heads.append(head)
        if ended:
            head.close()
            raise GroupError(f"group {binding.group} ended while its head was loading")
        for buffer, size in sorted(report.buffers.items()):
            log.info("group %s: %s holds %.1f MiB of %s's weights", binding.group, buffer,
                     size / (1024 * 1024), model.name)
        return head
