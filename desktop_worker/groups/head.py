"""A group's head: an engine child (``sandbox/``, role ``head``) that adds the members' RPC
servers as devices, loads the model with the queen's layer counts per device, and generates
like any context.

It is a child process because llama.cpp aborts the process on any RPC failure (a member that
went away mid-token), and because a head reads a model file and its members' replies, which
are strangers' bytes: the worker survives an abort, sees the child end, and fails the job over
(``GroupLost``). ``GroupHead`` is the worker's handle; its ``stream`` has ``LlamaContext``'s
shape, so a group serves through the same code as one model. ``load_head`` is what the child
runs to load.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from desktop_worker.errors import (
    EngineCrashed,
    EngineError,
    GroupError,
    GroupLost,
    MemberShort,
    UnsupportedRequest,
)
from desktop_worker.sandbox.context import SandboxedContext
from desktop_worker.sandbox.policy import policy_for, split_parts
from desktop_worker.sandbox.process import EngineProcess
from shared_schema.engine_ipc import HeadLoad, HeadLoaded, Load

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 600.0  # uploading a big share of weights over a LAN takes minutes


@dataclass(frozen=True, slots=True)
class HeadConfig:
    """What the head loads: ``endpoints`` are the members' servers as the head reaches them
    (its dialers' 127.0.0.1 ports), in the plan's order; ``device_layers`` the blocks per
    device (the members' devices in that order, then the head's own GPUs); ``cpu_layers`` the
    first blocks, on the head's CPU. ``output_on_cpu``: the output matrix stays in the head's
    RAM (a head without a GPU of its own; ``layout``)."""

    name: str
    model_path: str
    n_ctx: int
    n_layer: int
    endpoints: tuple[str, ...]
    cpu_layers: int
    device_layers: tuple[int, ...]
    n_threads: int | None = None
    output_on_cpu: bool = False


@dataclass(frozen=True, slots=True)
class HeadReport:
    """What the head loaded where, from llama.cpp's own log: bytes of weights per buffer
    (``CPU_Mapped``, ``RPC0[127.0.0.1:port]``, ...) and the layer range per device."""

    buffers: dict[str, int] = field(default_factory=dict)
    device_ranges: tuple[tuple[int, int], ...] = ()
    devices: tuple[str, ...] = ()
    load_s: float = 0.0

    def wire(self) -> HeadLoaded:
        """As the engine protocol carries it from the head's child."""
        return HeadLoaded(buffers={name[:128]: size for name, size in self.buffers.items()},
                          device_ranges=list(self.device_ranges),
                          devices=[name[:128] for name in self.devices], load_s=self.load_s)

    @classmethod
    def from_wire(cls, loaded: HeadLoaded) -> HeadReport:
        return cls(buffers=dict(loaded.buffers), device_ranges=tuple(loaded.device_ranges),
                   devices=tuple(loaded.devices), load_s=loaded.load_s)


class GroupHead:
    """The worker's handle on a head's engine child. Blocking, like ``LlamaContext``: its
    methods run in worker threads, one stream at a time."""

    def __init__(self, config: HeadConfig, *, ready_timeout_s: float = READY_TIMEOUT_S,
                 memory_mb: int | None = None) -> None:
        self.config = config
        self.name = config.name
        self.ready_timeout_s = ready_timeout_s
        self.memory_mb = memory_mb  # the model's cost here: the child's data limit
        self.report: HeadReport | None = None
        self._context: SandboxedContext | None = None
        self.busy = threading.Lock()

    @property
    def pid(self) -> int | None:
        return self._context.pid if self._context else None

    @property
    def alive(self) -> bool:
        """False once the child ended: the pool then drops this context for a new one."""
        return self._context is not None and self._context.alive

    def start(self) -> HeadReport:
        """Start the child and wait until the model is loaded (or it failed)."""
        config = self.config
        ports = [int(endpoint.rpartition(":")[2]) for endpoint in config.endpoints]
        policy = policy_for("head", model_files=split_parts(config.model_path),
                            memory_mb=self.memory_mb, connect_ports=ports)
        process = EngineProcess("head", policy, label=f"group head {config.name}")
        load = Load(name=config.name, model_path=config.model_path, n_ctx=config.n_ctx,
                    n_gpu_layers=-1, n_threads=config.n_threads,
                    head=HeadLoad(endpoints=list(config.endpoints), n_layer=config.n_layer,
                                  cpu_layers=config.cpu_layers,
                                  device_layers=list(config.device_layers),
                                  output_on_cpu=config.output_on_cpu))
        try:
            self._context = SandboxedContext(config.name, process, load,
                                             ready_timeout_s=self.ready_timeout_s)
        except MemberShort:
            raise
        except EngineError as exc:
            raise GroupError(f"the group's head could not load {config.name}: {exc}") from exc
        loaded = self._context.head_report
        self.report = HeadReport.from_wire(loaded) if loaded is not None else HeadReport()
        return self.report

    def stream(self, kind: str, request: dict[str, Any], cancel: threading.Event,
               continuation: str | None = None,
               scope: str | None = None) -> Iterator[dict[str, Any]]:
        """``LlamaContext.stream`` through the head's child; raises ``GroupLost`` when the
        child ends mid-answer."""
        if self._context is None:
            raise GroupError("the group's head is not running")
        try:
            yield from self._context.stream(kind, request, cancel, continuation, scope)
        except EngineCrashed as exc:
            raise GroupLost(f"the group's head process ended ({exc.reason}): a member is gone "
                            f"or the head crashed") from exc

    def usage(self) -> dict[str, int]:
        return self._context.usage() if self._context else {}

    def score(self, *_args: Any, **_kwargs: Any) -> None:
        raise UnsupportedRequest("a model group does not score answers")

    def embed(self, *_args: Any, **_kwargs: Any) -> None:
        raise UnsupportedRequest("a model group does not embed")

    def close(self) -> None:
        if self._context is not None:
            self._context.close()  # its last usage stays readable
