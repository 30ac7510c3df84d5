"""llama.cpp's build and devices, asked of a confined engine child (role ``probe``), so the
worker's own process never loads llama.cpp to tell the queen what it could give a model group.

``SandboxedRpc`` is the worker's ``groups.rpc.RpcSupport``: ``probe()`` (the RPC backend and
the build) and ``devices()`` (each device's free memory now, for the hello and every status).
One child answers them all while the worker runs; a child that ended is started again at the
next question. Blocking: call it from a thread.

The probe child is confined like every engine child, and what holds around it
(``confinement``) decides whether this worker may join model groups at all: a group's member
serves its devices to another worker's head, which only the whole sandbox makes safe, so where
it does not hold (another OS, an older kernel) ``probe`` answers unavailable, saying why, and
the worker offers no ``rpc`` (the Settings tab shows the reason).
"""

from __future__ import annotations

import logging
import threading

from desktop_worker.errors import EngineCrashed, GroupError, SandboxError
from desktop_worker.groups.rpc import Device, DeviceType, RpcProbe
from desktop_worker.sandbox.policy import policy_for
from desktop_worker.sandbox.process import EngineProcess
from shared_schema.engine_ipc import Confinement, Failed, Probed

log = logging.getLogger(__name__)

ANSWER_TIMEOUT_S = 60.0  # a GPU driver's first answer can take seconds


class SandboxedRpc:
    def __init__(self, *, answer_timeout_s: float = ANSWER_TIMEOUT_S,
                 require_sandbox: bool = True) -> None:
        """``require_sandbox``: groups only where the whole sandbox holds (the default)."""
        self.answer_timeout_s = answer_timeout_s
        self.require_sandbox = require_sandbox
        self.confinement: Confinement | None = None  # what held around the last probe child
        self._process: EngineProcess | None = None
        self._lock = threading.Lock()

    def _ask(self) -> Probed:
        with self._lock:
            for attempt in (1, 2):  # a child that ended since the last question: once more
                process = self._process
                try:
                    if process is None or not process.alive:
                        if process is not None:
                            process.close()
                        process = self._process = EngineProcess(
                            "probe", policy_for("probe"), label="engine probe")
                        self.confinement = process.start().confinement
                    process.send(process.link.devices())
                    reply = process.wait_for(self.answer_timeout_s)
                except (EngineCrashed, SandboxError) as exc:
                    if process is not None:
                        process.close()
                    self._process = None
                    if attempt == 2:
                        raise GroupError(f"llama.cpp's devices could not be listed: {exc}"
                                         ) from exc
                    continue
                if reply is None:
                    process.close()
                    self._process = None
                    raise GroupError(f"llama.cpp did not list its devices within "
                                     f"{self.answer_timeout_s:.0f} s")
                if isinstance(reply, Failed):
                    raise GroupError(f"llama.cpp's devices could not be listed: {reply.message}")
                return reply
        raise GroupError("llama.cpp's devices could not be listed")

    def probe(self) -> RpcProbe:
        try:
            reply = self._ask()
        except GroupError as exc:
            return RpcProbe(False, None, str(exc))
        confinement = self.confinement
        if (reply.available and self.require_sandbox
                and (confinement is None or not confinement.holds_for_groups)):
            return RpcProbe(False, reply.build, unsafe_for_groups(confinement))
        return RpcProbe(reply.available, reply.build, reply.reason)

    def devices(self) -> list[Device]:
        reply = self._ask()
        if not reply.available:
            raise GroupError(reply.reason or "llama.cpp has no RPC backend")
        try:
            return [Device(handle=0, name=d.name, description=d.description,
                           type=DeviceType(d.type), free_bytes=d.free_bytes,
                           total_bytes=d.total_bytes) for d in reply.devices]
        except ValueError as exc:  # a device type this ggml adds
            raise GroupError(f"llama.cpp lists a device of an unknown type: {exc}") from exc

    def close(self) -> None:
        with self._lock:
            process, self._process = self._process, None
        if process is not None:
            process.close()


def unsafe_for_groups(confinement: Confinement | None) -> str:
    """Why this machine joins no model groups, in the owner's words."""
    what = "; ".join(confinement.notes) if confinement is not None and confinement.notes else (
        "the engine's sandbox could not be checked")
    return ("model groups are off on this machine: another worker's group would drive its "
            f"llama.cpp, and the engine's sandbox does not fully hold here ({what})")
