"""What an engine child may touch: ``policy_for`` decides it from the role and the model's files.

Read-only: the Python that runs the child (its standard library and packages, this project's
own packages), the system's libraries (``/usr``, ``/lib*``), the few files in ``/etc`` the
dynamic loader and the C library read, ``/proc`` and ``/sys`` (Landlock keeps other processes'
private files out of reach there), GPU runtimes' usual homes, and the model's files. Read-write
with ioctls: the GPU device files. Everything: one scratch folder of its own, removed when it
ends. Never: the owner's home (the worker's key and settings, the keyring, browser profiles),
the rest of the model store, other temporary files. Pure but for listing which of these paths
exist on this machine.
"""

from __future__ import annotations

import glob
import logging
import os
import site
import sys
import sysconfig
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from desktop_worker.store.gguf_info import split_paths
from shared_schema.engine_ipc import MAX_PATHS, Role, SandboxPolicy

log = logging.getLogger(__name__)

# What the child's Python, numpy, jinja2 and llama.cpp use at run time beyond a model's memory
# (imports, numpy's and OpenMP's buffers, compute buffers): its data limit is the model's cost
# plus this.
RUNTIME_ALLOWANCE_MB = 1536

SYSTEM_READ = (
    "/usr", "/lib", "/lib64", "/lib32", "/libx32",
    "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime",
    "/etc/nsswitch.conf", "/etc/hosts", "/etc/gai.conf", "/etc/host.conf", "/etc/resolv.conf",
    "/etc/vulkan", "/etc/OpenCL", "/etc/glvnd", "/etc/nvidia", "/etc/alternatives",
    "/proc", "/sys", "/opt/cuda", "/opt/rocm", "/opt/intel",
    "/dev/urandom", "/dev/random", "/dev/zero",
)
DEVICE_GLOBS = ("/dev/nvidia*", "/dev/dri", "/dev/kfd", "/dev/dxg")


def python_paths() -> list[str]:
    """The folders the child's Python imports from: the standard library and site-packages of
    this interpreter and its base, the user's site-packages when it is on the path, a frozen
    app's bundle, and the folders of this project's own packages (an editable install maps
    them outside site-packages)."""
    import desktop_worker
    import shared_schema

    found: list[str] = []
    for scheme_vars in ({"base": sys.prefix, "platbase": sys.exec_prefix},
                        {"base": sys.base_prefix, "platbase": sys.base_exec_prefix}):
        paths = sysconfig.get_paths(vars=scheme_vars)
        found += [paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")]
    found += site.getsitepackages() if hasattr(site, "getsitepackages") else []
    if site.ENABLE_USER_SITE and site.getusersitepackages() in sys.path:
        found.append(site.getusersitepackages())
    bundle = getattr(sys, "_MEIPASS", None)
    if bundle:
        found.append(bundle)
    found += [str(Path(desktop_worker.__file__).parent), str(Path(shared_schema.__file__).parent)]
    found += [str(Path(sys.executable).resolve().parent)]
    return found + pythonpath_folders(os.environ.get("PYTHONPATH", ""), Path.home())


def pythonpath_folders(pythonpath: str, home: Path) -> list[str]:
    """The folders of ``PYTHONPATH`` (packages installed with ``pip install --target``, a
    source checkout): the child imports from them after it has confined itself. Never the
    home folder or a folder above it (the worker's key and settings live there): such an
    entry is left out, with a warning."""
    folders: list[str] = []
    home = home.resolve()
    for entry in pythonpath.split(os.pathsep):
        if not entry:
            continue
        path = Path(entry).resolve()
        if not path.is_dir():
            continue
        if path == home or path in home.parents:
            log.warning("PYTHONPATH entry %s holds your home folder: the engine may not read "
                        "it, so it cannot import from it", entry)
            continue
        folders.append(str(path))
    return folders


def split_parts(path: str) -> list[str]:
    """Every file llama.cpp opens for the model at ``path``: itself, and for the first part of
    a split model (``name-00001-of-00003.gguf``) the other parts beside it."""
    return [str(part) for part in split_paths(Path(path))]


def device_paths() -> list[str]:
    return sorted({path for pattern in DEVICE_GLOBS for path in glob.glob(pattern)})


def _unique(paths: Iterable[str]) -> list[str]:
    seen: dict[str, None] = {}
    for path in paths:
        seen.setdefault(path, None)
    return list(seen)


def policy_for(
    role: Role,
    *,
    scratch: str | None = None,
    model_files: Sequence[str] = (),
    memory_mb: int | None = None,
    bind_ports: Sequence[int] = (),
    connect_ports: Sequence[int] = (),
    extra_read: Sequence[str] = (),
    gpus: bool = True,
    adapter_files: Sequence[str] = (),
) -> SandboxPolicy:
    """The policy of one child. ``model_files``: every file of the model it loads (a context
    or a head; a member and a probe read none); ``memory_mb``: the model's cost on this worker
    (``fitting.memory_cost_mb``), to which ``RUNTIME_ALLOWANCE_MB`` is added (None: no limit);
    ``bind_ports``: a member's RPC port; ``connect_ports``: a head's dialers; ``gpus``: whether
    it may open the GPU devices (not when the owner keeps layers off the GPU); ``scratch``:
    its folder (None: ``EngineProcess`` makes one); ``adapter_files``: a fine-tuned model's
    LoRA adapter (issue 37), read-only like the model's files."""
    read = _unique([*python_paths(), *SYSTEM_READ, *model_files, *adapter_files,
                    *extra_read])[:MAX_PATHS]
    devices = device_paths() if gpus else []
    return SandboxPolicy(
        read_paths=read,
        device_paths=devices,
        gpu_driver=bool(devices),
        scratch=scratch,
        bind_ports=list(bind_ports),
        connect_ports=list(connect_ports),
        memory_mb=memory_mb + RUNTIME_ALLOWANCE_MB if memory_mb is not None else None,
    )



# --- the train role (issue 37) ------------------------------------------------------------------

F32_BYTES_PER_PARAMETER = 4
TRAIN_FILE_MARGIN_MB = 256  # the F32 copy's header and alignment, an adapter beside it
MB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class TrainLimits:
    """A train child's limits, from the base's parameter count: llama.cpp trains on an F32
    copy of the base (4 bytes a parameter: 540 MB for SmolLM2-135M, over a context child's
    512 MB file limit), made in the child's scratch folder and loaded whole into memory."""

    f32_mb: int
    max_file_mb: int  # the F32 copy is the largest file it writes
    memory_mb: int  # the F32 weights, and half as much again for activations and gradients
    scratch_mb: int  # the F32 copy, checkpoints and the adapter while the worker takes them

    @classmethod
    def of(cls, parameter_count: int) -> TrainLimits:
        f32_mb = -(-parameter_count * F32_BYTES_PER_PARAMETER // MB)
        return cls(f32_mb=f32_mb, max_file_mb=f32_mb + TRAIN_FILE_MARGIN_MB,
                   memory_mb=f32_mb + f32_mb // 2,
                   scratch_mb=f32_mb + f32_mb // 4 + TRAIN_FILE_MARGIN_MB)


def train_policy(*, model_files: Sequence[str], limits: TrainLimits, scratch: str | None = None,
                 extra_read: Sequence[str] = (), gpus: bool = False) -> SandboxPolicy:
    """A train child's policy: like a context's (reads Python, the system's libraries and the
    base model's files, writes only its scratch folder, no socket at all), the GPU only for a
    run planned there (``gpus``: ``engine.training.plan_train_device``), and its own file and
    memory limits (``TrainLimits``). ``extra_read``: the checkpoint a resumed run starts
    from."""
    policy = policy_for("train", scratch=scratch, model_files=model_files,
                        memory_mb=limits.memory_mb, extra_read=extra_read, gpus=gpus)
    return policy.model_copy(update={"max_file_mb": limits.max_file_mb})
