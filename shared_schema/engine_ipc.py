"""The engine protocol (issue 34): the worker and its sandboxed engine processes.

llama.cpp runs only in child processes of the worker (``desktop_worker/sandbox/``): one per
context, per group head, per group member's RPC server, and one that lists llama.cpp's devices.
The worker's own process, which holds its key, settings and queen connection, never loads
llama.cpp. Between the two, one socket carries length-prefixed frames: four bytes of big-endian
length, then one JSON message tagged by ``type``. Nothing is pickled: a child that a hostile
model file took over can send only these messages, each bounded and checked like any frame
from a stranger (``decode_from_child``).

The sequence (``docs/ARCHITECTURE.md``, "The engine boundary")::

    worker                                         engine child
      | -- start {version, role, policy} ------------> |  confines itself (policy), then
      | <-------------- hello {version, pid, confinement} |
      | -- load {name, model_path, n_ctx, slots, ...} -> |  context and head roles
      | <---------------- loaded {n_ctx, slots, head} -- |  or error {code, message}
      | -- stream {job, kind, request, scope, ...} ---> |  up to ``slots`` jobs at once
      | <--------------------------- chunk {job, data} . |  ... then done {job, usage} or
      | -- cancel {job} -----------------------------> |  error {job}; cancel at any time
      | -- score {job, kind, request, answer} -------> |  <- scored {job, data} or error
      | -- embed {job, inputs} ----------------------> |  <- embedded {job, vectors, tokens}
      | -- serve {endpoint, n_threads, devices, gpus} -> |  member role: llama.cpp's RPC server
      | -- devices {gpus} ---------------------------> |  probe role: <- probed {...}
      | -- train {job, base_path, n_epochs, ...} ----> |  train role (issue 37): <- progress,
      |    <- train_progress, train_checkpoint ...     |  checkpoints, then trained {job} or
      |    <------------------------- trained {job} .. |  error {job}; cancel at any time
      | -- load_image {model_path, taesd_path, ...} --> |  image role (issue 38):
      | <------------------- image_loaded {family} ---- |  stable-diffusion.cpp
      | -- render {job, order} ----------------------> |  <- rendered {job, images} or
      |                                                 |  error {job}; one at a time
      | -- stop --------------------------------------> |  the child exits

Every job carries the worker's number for it (``job``), and every reply names the job it
answers: a context child runs its jobs side by side in one batch (issue 36), so their chunks
interleave. ``ENGINE_IPC_VERSION`` counts changes to these messages: a child of another version
is refused.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import orjson
from pydantic import Field, TypeAdapter, ValidationError

from shared_schema.base import WireModel
from shared_schema.errors import ProtocolError

ENGINE_IPC_VERSION = 5
HEADER_BYTES = 4
# A job's request as the queen sent it (its frames are at most 16 MiB), with room to spare.
MAX_TO_CHILD_BYTES = 32 * 1024 * 1024
# The largest answer a child sends in one frame: an embeddings answer (inputs x dimensions as
# JSON floats). A chunk of generated text is far below it.
MAX_FROM_CHILD_BYTES = 64 * 1024 * 1024
MAX_PATHS = 256
MAX_PORTS = 64
MAX_MESSAGE_CHARS = 4096

Role = Literal["context", "head", "member", "probe", "train", "image"]
Path_ = Annotated[str, Field(min_length=1, max_length=4096)]
Port = Annotated[int, Field(ge=1, le=65535, strict=True)]
Text = Annotated[str, Field(max_length=MAX_MESSAGE_CHARS)]
Count = Annotated[int, Field(ge=0, le=2**53, strict=True)]
JobId = Annotated[int, Field(ge=1, le=2**53, strict=True)]
Slots = Annotated[int, Field(ge=1, le=256, strict=True)]
Scope = Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]


class SandboxPolicy(WireModel):
    """What one engine child may touch, decided by the worker (``sandbox/policy.py``) and
    applied by the child before it reads a single model or peer byte.

    ``read_paths``: folders and files it may read (Python, its libraries, the model's files);
    ``device_paths``: device files it may open read-write with ioctls (GPUs); ``scratch``: the
    one folder it may write; ``bind_ports``/``connect_ports``: TCP ports on which it may
    listen (a member's RPC server) or which it may dial (a head, its dialers on 127.0.0.1);
    any other socket is refused. ``memory_mb``: its data memory on top of what it uses when
    confined (None: no limit); ``max_open_files``, ``max_file_mb``: rlimits. ``gpu_driver``:
    it runs a GPU driver, which may name its own threads (``/proc/self/task``), make Unix
    socket pairs (and, where the role neither dials nor listens, Unix sockets that can reach
    nothing) and shared memory: the NVIDIA driver does all of these in ``cuInit``."""

    read_paths: list[Path_] = Field(default_factory=list, max_length=MAX_PATHS)
    device_paths: list[Path_] = Field(default_factory=list, max_length=MAX_PATHS)
    scratch: Path_ | None = None
    bind_ports: list[Port] = Field(default_factory=list, max_length=MAX_PORTS)
    connect_ports: list[Port] = Field(default_factory=list, max_length=MAX_PORTS)
    memory_mb: Annotated[int, Field(ge=1, le=2**31)] | None = None
    max_open_files: Annotated[int, Field(ge=16, le=65536)] = 256
    max_file_mb: Annotated[int, Field(ge=1, le=2**20)] = 512
    gpu_driver: bool = False


class Confinement(WireModel):
    """What holds around one engine child, as the child found it after confining itself: the
    worker shows it (the Hardware tab, the log) and decides by it whether to join groups.
    ``landlock_abi`` is 0 where the kernel has no Landlock; ``notes`` say in plain words what
    could not be applied and why."""

    os: Annotated[str, Field(max_length=32)]
    no_new_privs: bool = False
    seccomp: bool = False
    landlock_abi: Annotated[int, Field(ge=0, le=1000)] = 0
    filesystem: bool = False  # reads and writes limited to the policy's paths
    network: bool = False  # no socket but what the role needs (and those on its ports only)
    tcp_ports: bool = False  # the kernel can limit TCP to named ports (Landlock ABI 4+)
    signals: bool = False  # no signals to processes outside the sandbox (Landlock ABI 6+)
    memory_limit_mb: Annotated[int, Field(ge=0)] | None = None
    rlimits: bool = False
    capabilities_dropped: bool = False
    notes: list[Text] = Field(default_factory=list, max_length=32)

    @property
    def holds(self) -> bool:
        """The whole sandbox holds: no new privileges, the system call filter, and files,
        network and signals confined."""
        return (self.no_new_privs and self.seccomp and self.filesystem and self.network
                and self.signals and self.rlimits)

    @property
    def holds_for_groups(self) -> bool:
        """It holds for a group's head and members too, whose sockets the kernel must limit
        to their ports: a worker joins model groups only then."""
        return self.holds and self.tcp_ports


# --- the worker to its child -------------------------------------------------------------------


class Start(WireModel):
    type: Literal["start"] = "start"
    version: int
    role: Role
    policy: SandboxPolicy


class HeadLoad(WireModel):
    """A group head's load (issue 19): the members' RPC servers as the head reaches them (its
    dialers' 127.0.0.1 ports), in the plan's order, and the layers per device."""

    endpoints: list[Annotated[str, Field(max_length=64)]] = Field(max_length=16)
    n_layer: Annotated[int, Field(ge=1, le=4096)]
    cpu_layers: Annotated[int, Field(ge=0, le=4096)]
    device_layers: list[Annotated[int, Field(ge=0, le=4096)]] = Field(max_length=32)
    output_on_cpu: bool = False


class LoadAdapter(WireModel):
    """A LoRA adapter applied to the model a ``Load`` names (a fine-tuned model, issue 37)."""

    path: Path_
    scale: Annotated[float, Field(ge=0.0, le=16.0, allow_inf_nan=False)] = 1.0


class Load(WireModel):
    type: Literal["load"] = "load"
    name: Annotated[str, Field(max_length=512)]
    model_path: Path_
    n_ctx: Annotated[int, Field(ge=1, le=2**24)]
    n_gpu_layers: Annotated[int, Field(ge=-1, le=100_000)]
    n_threads: Annotated[int, Field(ge=1, le=4096)] | None = None
    embedding: bool = False
    head: HeadLoad | None = None
    slots: Slots = 1  # sequences decoded in one batch (issue 36); 1 for heads and embeddings
    adapter: LoadAdapter | None = None  # base + this LoRA adapter (issue 37); not for heads


class Stream(WireModel):
    type: Literal["stream"] = "stream"
    job: JobId
    kind: Literal["chat", "completion"]
    request: dict[str, Any]
    continuation: str | None = None
    scope: Scope | None = None  # whose cached prefixes it may reuse (the queen's cache_scope)


class Cancel(WireModel):
    type: Literal["cancel"] = "cancel"
    job: JobId


class ScoreJob(WireModel):
    type: Literal["score"] = "score"
    job: JobId
    kind: Literal["chat", "completions"]
    request: dict[str, Any]
    answer: str


class Embed(WireModel):
    type: Literal["embed"] = "embed"
    job: JobId
    inputs: list[str] | list[list[int]]


class Serve(WireModel):
    type: Literal["serve"] = "serve"
    endpoint: Annotated[str, Field(max_length=64)]
    n_threads: Annotated[int, Field(ge=1, le=4096)]
    devices: Annotated[int, Field(ge=1, le=64)] | None = None
    gpus: bool = True


class ListDevices(WireModel):
    type: Literal["devices"] = "devices"


class Stop(WireModel):
    type: Literal["stop"] = "stop"


class Train(WireModel):
    """A train child's one job (issue 37, ``engine.training.TrainSpec`` less its examples,
    which the worker writes to ``examples.jsonl`` in the child's scratch folder: a training
    file may be larger than a frame)."""

    type: Literal["train"] = "train"
    job: JobId
    base_path: Path_
    n_epochs: Annotated[int, Field(ge=1, le=1000, strict=True)]
    batch_size: Annotated[int, Field(ge=1, le=4096, strict=True)]
    learning_rate: Annotated[float, Field(gt=0, lt=1)]
    seed: Annotated[int, Field(ge=0, le=2**53, strict=True)]
    rank: Annotated[int, Field(ge=1, le=256, strict=True)] = 8
    n_ctx: Annotated[int, Field(ge=256, le=65536, multiple_of=256, strict=True)] = 256
    progress_every_steps: Annotated[int, Field(ge=1, le=2**31, strict=True)] = 25
    checkpoint_every_steps: Annotated[int, Field(ge=1, le=2**31, strict=True)] = 100
    resume_from: Path_ | None = None
    resume_step: Count = 0
    n_threads: Annotated[int, Field(ge=1, le=4096)] | None = None
    # llama.cpp's n_gpu_layers for the run (``engine.training.plan_train_device``): 0 the CPU,
    # -1 every layer on the GPU
    n_gpu_layers: Annotated[int, Field(ge=-1, le=4096, strict=True)] = 0


class LoadImage(WireModel):
    """An image child's model (issue 38): a diffusion model file stable-diffusion.cpp loads
    whole, with a tiny autoencoder (TAESD) for a file that carries no VAE of its own."""

    type: Literal["load_image"] = "load_image"
    model_path: Path_
    taesd_path: Path_ | None = None
    n_threads: Annotated[int, Field(ge=1, le=4096)] | None = None


class Render(WireModel):
    """One image job: ``order`` is the queen's ``shared_schema.images.ImageOrder``, checked
    again by the child."""

    type: Literal["render"] = "render"
    job: JobId
    order: dict[str, Any]


ToChild = Annotated[Start | Load | Stream | Cancel | ScoreJob | Embed | Serve | ListDevices | Stop
                    | Train | LoadImage | Render, Field(discriminator="type")]


# --- the child to the worker -------------------------------------------------------------------


class Hello(WireModel):
    type: Literal["hello"] = "hello"
    version: int
    pid: Annotated[int, Field(ge=1, strict=True)]
    confinement: Confinement


class HeadLoaded(WireModel):
    """What a head loaded where, from llama.cpp's own log (``groups.head.HeadReport``)."""

    buffers: dict[Annotated[str, Field(max_length=128)], Count] = Field(max_length=64)
    device_ranges: list[tuple[Count, Count]] = Field(max_length=64)
    devices: list[Annotated[str, Field(max_length=128)]] = Field(max_length=64)
    load_s: Annotated[float, Field(ge=0)]


class Loaded(WireModel):
    """A model is loaded. ``gpu_devices``: the GPUs llama.cpp found in the child (None: the
    build does not say); empty while the load asked for GPU layers means every layer runs on
    the CPU (the GPU driver did not start there)."""

    type: Literal["loaded"] = "loaded"
    n_ctx: Annotated[int, Field(ge=1, le=2**24, strict=True)]
    slots: Slots = 1
    head: HeadLoaded | None = None
    gpu_devices: list[Annotated[str, Field(max_length=128)]] | None = Field(default=None,
                                                                          max_length=16)


class Chunk(WireModel):
    type: Literal["chunk"] = "chunk"
    job: JobId
    data: dict[str, Any]


class Done(WireModel):
    type: Literal["done"] = "done"
    job: JobId
    prompt_tokens: Count
    completion_tokens: Count
    total_tokens: Count

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "total_tokens": self.total_tokens}


class Scored(WireModel):
    type: Literal["scored"] = "scored"
    job: JobId
    data: dict[str, Any] | None  # None: cancelled


class Embedded(WireModel):
    type: Literal["embedded"] = "embedded"
    job: JobId
    vectors: list[list[float]]
    tokens: Count


class DeviceInfo(WireModel):
    """One ggml device as llama.cpp lists it (``groups.rpc.Device``, less its handle)."""

    name: Annotated[str, Field(max_length=128)]
    description: Annotated[str, Field(max_length=256)]
    type: Annotated[int, Field(ge=0, le=16, strict=True)]
    free_bytes: Count
    total_bytes: Count


class Probed(WireModel):
    type: Literal["probed"] = "probed"
    available: bool
    build: Annotated[str, Field(max_length=256)] | None = None
    reason: Text = ""
    devices: list[DeviceInfo] = Field(default_factory=list, max_length=64)


class TrainStep(WireModel):
    """A train job's progress: the mean loss of the steps since the last one."""

    type: Literal["train_progress"] = "train_progress"
    job: JobId
    step: Count
    total_steps: Count
    epoch: Count
    loss: Annotated[float, Field(ge=0, allow_inf_nan=False)]
    trained_tokens: Count


class TrainCheckpointed(WireModel):
    """The adapter after ``step`` is written in the child's scratch folder, under the name
    the worker expects (``engine.training.checkpoint_name(step)``): the child names no path."""

    type: Literal["train_checkpoint"] = "train_checkpoint"
    job: JobId
    step: Count
    trained_tokens: Count
    loss: Annotated[float, Field(ge=0, allow_inf_nan=False)]


class Trained(WireModel):
    """The run is done: the adapter is ``adapter.gguf`` in the child's scratch folder."""

    type: Literal["trained"] = "trained"
    job: JobId
    steps: Count
    trained_tokens: Count
    loss: Annotated[float, Field(ge=0, allow_inf_nan=False)]


class ImageLoaded(WireModel):
    type: Literal["image_loaded"] = "image_loaded"
    family: Annotated[str, Field(max_length=32)]  # as the child's file check read it


class Rendered(WireModel):
    """An image job's images, encoded as its order said (the worker checks each again before
    it goes to the queen, ``desktop_worker.image_jobs``)."""

    type: Literal["rendered"] = "rendered"
    job: JobId
    images: list[dict[str, Any]] = Field(max_length=8)
    render_s: Annotated[float, Field(ge=0, le=86_400, allow_inf_nan=False)] = 0.0


# Why a command failed: ``unsupported`` (the request cannot be served here: the job's fault),
# ``load_failed`` (llama.cpp could not load the model), ``member_short`` (a head's member could
# not allocate its share; ``endpoint`` names it), ``engine_error`` (anything else in llama.cpp),
# ``invalid_model`` (the file failed its checks before llama.cpp opened it), ``cancelled`` (a
# train job stopped on its cancel), ``training_unsupported`` (this llama.cpp cannot train: the
# self-check failed, a layout moved).
FailureCode = Literal["unsupported", "load_failed", "member_short", "engine_error",
                      "invalid_model", "cancelled", "training_unsupported"]


class Failed(WireModel):
    type: Literal["error"] = "error"
    job: JobId | None = None  # the job it ends; None: the load or the probe
    code: FailureCode
    message: Text
    endpoint: Annotated[str, Field(max_length=64)] | None = None


FromChild = Annotated[Hello | Loaded | Chunk | Done | Scored | Embedded | Probed | Failed
                      | TrainStep | TrainCheckpointed | Trained | ImageLoaded | Rendered,
                      Field(discriminator="type")]

_to_child: TypeAdapter[Any] = TypeAdapter(ToChild)
_from_child: TypeAdapter[Any] = TypeAdapter(FromChild)


def encode(message: WireModel) -> bytes:
    """One message as a frame's payload (the length prefix is the framing's: ``sandbox.ipc``)."""
    return orjson.dumps(message.model_dump(mode="json"))


def _decode(adapter: TypeAdapter[Any], payload: bytes, side: str) -> Any:
    try:
        return adapter.validate_json(payload)
    except ValidationError as exc:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(part) for part in first.get("loc", ())) or "message"
        raise ProtocolError("invalid_message",
                            f"a malformed {side} message ({where}: {first.get('msg', '')})"
                            ) from exc
    except ValueError as exc:
        raise ProtocolError("invalid_json", f"a {side} frame is not JSON: {exc}") from exc


def decode_to_child(payload: bytes) -> Any:
    """A frame's payload from the worker, as its message."""
    return _decode(_to_child, payload, "worker")


def decode_from_child(payload: bytes) -> Any:
    """A frame's payload from an engine child, as its message; ``ProtocolError`` otherwise
    (the worker then ends that child)."""
    return _decode(_from_child, payload, "engine")
