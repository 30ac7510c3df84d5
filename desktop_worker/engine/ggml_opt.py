"""llama.cpp's training API (``llama_opt_*``) and ggml-opt, bound for training a LoRA adapter
(issue 37; measured against PyTorch in ``bench/train_engines.py``, ``bench/RESULTS.md``).

llama-cpp-python 0.3.36 binds the API only in part, and the API trains model tensors only, so
this module carries four workarounds. Each reaches into llama.cpp's private layouts; each
is checked (tensor names and counts) so that a llama.cpp whose layout moved raises
``TrainingUnsupported`` rather than misbehaves:

1. ``llama_opt_params``: the binding's struct lacks the last field, ``optimizer_type``. The
   struct is passed by value, so llama.cpp would read the optimizer from beyond it: it is
   declared whole here (``LlamaOptParams``).
2. ``ggml_opt_dataset_*``, ``ggml_opt_result_*`` and ``ggml_set_param`` are not bound: they are
   bound here from ``libggml-base`` with their real prototypes, on this module's own ``CDLL``
   handles (llama-cpp-python's bindings are left as they are). The optimizer's parameters come
   from ggml's own ``ggml_opt_get_constant_optimizer_params`` (a ctypes callback cannot return
   a struct by value).
3. LoRA: an adapter's tensors live in the adapter's own ggml context, which the API's
   ``param_filter`` never sees. ``adapter_tensors`` reads that context from
   ``llama_adapter_lora``'s private ``ctxs`` (after ``model`` and a libstdc++
   ``unordered_map``) and ``ggml_set_param`` marks each tensor trainable; the filter keeps every
   model tensor frozen.
4. Gradients pile up: ``llama_opt_epoch`` builds its graphs anew each step, and ggml-opt then
   accumulates every step's gradients into accumulators it zeroes only when they are first
   allocated, so step k would apply the sum of all k gradients. ``Session`` zeroes them after
   each step from the epoch callback (found through ``ggml_opt_context``'s private
   ``ctx_static``). ``self_check`` proves on this build that it works: plain SGD on one
   window three times must move a LoRA tensor about as far on each step (as shipped, step k
   moves it k times as far). Training refuses to start when it fails.

Also: llama.cpp sizes its graph for a forward pass; with ``n_ubatch`` below ``n_ctx`` the
backward pass of the LoRA graph overflows it (an abort), so a session trains with
``n_batch == n_ubatch == n_ctx``, one window of ``n_ctx`` tokens a step.

Everything here runs in the sandboxed train child (``engine_child.serve_train``), never in the
worker's own process.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from desktop_worker.errors import TrainingUnsupported

log = logging.getLogger(__name__)

GGML_TYPE_I32 = 26
LLAMA_FTYPE_ALL_F32 = 0
OPTIMIZER_ADAMW, OPTIMIZER_SGD = 0, 1
ADAPTER_CTXS_OFFSET = 64  # llama_adapter_lora: llama_model* (8) + std::unordered_map (56)
OPT_CTX_STATIC_OFFSET = 24  # ggml_opt_context: backend_sched, allocated_graph(_copy), ctx_static
TARGETS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
# self_check: each SGD step on the same window must move the tensor this close to the first
# step's move (as shipped, step 2 moves it about twice and step 3 three times as far).
SELF_CHECK_STEPS = 3
SELF_CHECK_TOLERANCE = 0.25
SELF_CHECK_LR = 1e-4


class OptimizerParams(ctypes.Structure):
    """``struct ggml_opt_optimizer_params`` (ggml-opt.h)."""

    class AdamW(ctypes.Structure):
        _fields_ = [("alpha", ctypes.c_float), ("beta1", ctypes.c_float),
                    ("beta2", ctypes.c_float), ("eps", ctypes.c_float), ("wd", ctypes.c_float)]

    class Sgd(ctypes.Structure):
        _fields_ = [("alpha", ctypes.c_float), ("wd", ctypes.c_float)]

    _fields_ = [("adamw", AdamW), ("sgd", Sgd)]


PARAM_FILTER = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_void_p)
EPOCH_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_bool, ctypes.c_void_p, ctypes.c_void_p,
                                  ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64)


class LlamaOptParams(ctypes.Structure):
    """``struct llama_opt_params`` (llama.h) whole (workaround 1)."""

    _fields_ = [("n_ctx_train", ctypes.c_uint32), ("param_filter", PARAM_FILTER),
                ("param_filter_ud", ctypes.c_void_p), ("get_opt_pars", ctypes.c_void_p),
                ("get_opt_pars_ud", ctypes.c_void_p), ("optimizer_type", ctypes.c_int)]


class GgmlOpt:
    """llama.cpp's and ggml's training calls with their real prototypes (workaround 2)."""

    def __init__(self) -> None:
        import llama_cpp

        lib = Path(llama_cpp.__file__).parent / "lib"
        try:
            self.ggml = ctypes.CDLL(str(lib / "libggml-base.so"))
            self.llama = ctypes.CDLL(str(lib / "libllama.so"))
        except OSError as exc:
            raise TrainingUnsupported(f"llama.cpp's libraries cannot be opened: {exc}") from exc
        p, i64, size = ctypes.c_void_p, ctypes.c_int64, ctypes.c_size_t
        binds: list[tuple[ctypes.CDLL, str, Any, tuple[Any, ...]]] = [
            (self.ggml, "ggml_get_first_tensor", p, (p,)),
            (self.ggml, "ggml_get_next_tensor", p, (p, p)),
            (self.ggml, "ggml_get_name", ctypes.c_char_p, (p,)),
            (self.ggml, "ggml_set_param", None, (p,)),
            (self.ggml, "ggml_nbytes", size, (p,)),
            (self.ggml, "ggml_get_data", p, (p,)),
            (self.ggml, "ggml_backend_tensor_get", None, (p, p, size, size)),
            (self.ggml, "ggml_backend_tensor_memset", None, (p, ctypes.c_uint8, size, size)),
            (self.ggml, "ggml_is_scalar", ctypes.c_bool, (p,)),
            (self.ggml, "ggml_opt_dataset_init", p,
             (ctypes.c_int, ctypes.c_int, i64, i64, i64, i64)),
            (self.ggml, "ggml_opt_dataset_free", None, (p,)),
            (self.ggml, "ggml_opt_dataset_data", p, (p,)),
            (self.ggml, "ggml_opt_dataset_labels", p, (p,)),
            (self.ggml, "ggml_opt_result_init", p, ()),
            (self.ggml, "ggml_opt_result_free", None, (p,)),
            (self.ggml, "ggml_opt_result_reset", None, (p,)),
            (self.ggml, "ggml_opt_result_loss", None,
             (p, ctypes.POINTER(ctypes.c_double), ctypes.POINTER(ctypes.c_double))),
            (self.llama, "llama_opt_init", None, (p, p, LlamaOptParams)),
            (self.llama, "llama_opt_epoch", None, (p, p, p, p, i64, p, p)),
        ]
        try:
            for library, name, restype, argtypes in binds:
                fn = getattr(library, name)
                fn.restype = restype
                fn.argtypes = list(argtypes)
            self.constant_pars = ctypes.cast(self.ggml.ggml_opt_get_constant_optimizer_params,
                                             ctypes.c_void_p).value
        except AttributeError as exc:
            raise TrainingUnsupported(f"this llama.cpp lacks a training call: {exc}") from exc

    def context_tensors(self, ctx: int) -> dict[str, int]:
        out: dict[str, int] = {}
        tensor = self.ggml.ggml_get_first_tensor(ctx)
        while tensor:
            out[self.ggml.ggml_get_name(tensor).decode()] = tensor
            tensor = self.ggml.ggml_get_next_tensor(ctx, tensor)
        return out

    def adapter_tensors(self, adapter: int, expected: set[str]) -> dict[str, int]:
        """The tensors of a loaded ``llama_adapter_lora``, from its private ``ctxs``
        (workaround 3); exactly ``expected``, or ``TrainingUnsupported``."""
        begin, end = (ctypes.c_void_p * 2).from_address(adapter + ADAPTER_CTXS_OFFSET)
        count = ((end or 0) - (begin or 0)) // ctypes.sizeof(ctypes.c_void_p)
        if not begin or not 1 <= count <= 8:
            raise TrainingUnsupported("llama_adapter_lora's layout is not the one this worker "
                                      "knows: update the worker")
        tensors: dict[str, int] = {}
        for k in range(count):
            ctx = ctypes.c_void_p.from_address(begin + ctypes.sizeof(ctypes.c_void_p) * k)
            tensors |= self.context_tensors(ctx.value or 0)
        if set(tensors) != expected:
            raise TrainingUnsupported("the loaded adapter's tensors are not the ones written: "
                                      "llama.cpp's layout changed")
        return tensors

    def gradient_accumulators(self, opt: int) -> list[int]:
        """The gradient accumulators of a ``ggml_opt_context``, from its private
        ``ctx_static`` (workaround 4; beside them: AdamW's m and v, named, and the loss's
        scalar seed)."""
        static = ctypes.c_void_p.from_address(opt + OPT_CTX_STATIC_OFFSET).value
        tensors = self.context_tensors(static) if static else {}
        moments = [n for n in tensors if n.startswith("AdamW m for ")]
        accumulators = [t for n, t in tensors.items()
                        if not n.startswith("AdamW ") and not self.ggml.ggml_is_scalar(t)]
        if not accumulators or (moments and len(accumulators) != len(moments)):
            raise TrainingUnsupported("ggml_opt_context's layout is not the one this worker "
                                      "knows: update the worker")
        return accumulators

    def zero(self, tensors: list[int]) -> None:
        for tensor in tensors:
            self.ggml.ggml_backend_tensor_memset(tensor, 0, 0, self.ggml.ggml_nbytes(tensor))

    def read(self, tensor: int) -> Any:
        import numpy as np

        buf = np.empty(self.ggml.ggml_nbytes(tensor) // 4, np.float32)
        self.ggml.ggml_backend_tensor_get(tensor, buf.ctypes.data, 0, buf.nbytes)
        return buf

    def loss(self, result: int) -> float:
        mean, uncertainty = ctypes.c_double(), ctypes.c_double()
        self.ggml.ggml_opt_result_loss(result, ctypes.byref(mean), ctypes.byref(uncertainty))
        return float(mean.value)


def f32_copy(source: Path, dest: Path, threads: int) -> Path:
    """The model dequantized to F32 by llama.cpp (the API trains F32 tensors only)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize, params.nthread = LLAMA_FTYPE_ALL_F32, True, threads
    if llama_cpp.llama_model_quantize(str(source).encode(), str(dest).encode(), params) != 0:
        raise TrainingUnsupported(f"llama.cpp could not make an F32 copy of {source.name}")
    return dest


def lora_names(shapes: dict[str, tuple[int, int]]) -> set[str]:
    return {f"{name}.{side}" for name in shapes for side in ("lora_a", "lora_b")}


def initial_lora(shapes: dict[str, tuple[int, int]], rank: int, seed: int) -> dict[str, Any]:
    """A as PEFT starts it (uniform, bound 1/sqrt(inputs)), B zero: it starts as a no-op."""
    import numpy as np

    rng = np.random.default_rng(seed)
    tensors = {}
    for name, (n_in, n_out) in sorted(shapes.items()):
        bound = 1 / math.sqrt(n_in)
        tensors[f"{name}.lora_a"] = rng.uniform(-bound, bound, (rank, n_in)).astype(np.float32)
        tensors[f"{name}.lora_b"] = np.zeros((n_out, rank), np.float32)
    return tensors


def write_lora_gguf(path: Path, tensors: dict[str, Any], alpha: float,
                    architecture: str = "llama") -> int:
    """A GGUF LoRA as llama.cpp's ``llama_adapter_lora_init`` reads it (written beside and
    renamed, so a reader never sees half a file); returns its size."""
    import gguf

    partial = path.with_name(path.name + ".partial")
    writer = gguf.GGUFWriter(str(partial), architecture)
    writer.add_type("adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", alpha)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.replace(path)
    return path.stat().st_size


@dataclass(frozen=True, slots=True)
class SessionConfig:
    n_ctx: int
    learning_rate: float
    threads: int
    optimizer: int = OPTIMIZER_ADAMW
    gpu_layers: int = 0  # llama.cpp's n_gpu_layers (-1: every layer on the GPU)


class Session:
    """One training session of llama.cpp: the F32 base with a LoRA adapter loaded, its tensors
    the only parameters, and an optimizer; ``step`` trains one window."""

    def __init__(self, api: GgmlOpt, base_f32: Path, adapter: Path,
                 shapes: dict[str, tuple[int, int]], config: SessionConfig) -> None:
        from llama_cpp import Llama

        self.api = api
        self.shapes = shapes
        self.n_ctx = config.n_ctx
        try:
            self.llm = Llama(model_path=str(base_f32), lora_path=str(adapter), use_mmap=False,
                             n_ctx=config.n_ctx, n_batch=config.n_ctx, n_ubatch=config.n_ctx,
                             type_k=0, type_v=0, flash_attn=False,
                             n_gpu_layers=config.gpu_layers,
                             n_threads=config.threads, n_threads_batch=config.threads,
                             verbose=False)
        except (ValueError, RuntimeError) as exc:
            raise TrainingUnsupported(f"llama.cpp could not load the model to train: {exc}"
                                      ) from exc
        self.ctx = self.llm._ctx.ctx
        handle = ctypes.cast(self.llm._lora_adapter, ctypes.c_void_p).value or 0
        self.lora = api.adapter_tensors(handle, lora_names(shapes))
        for tensor in self.lora.values():
            api.ggml.ggml_set_param(tensor)
        lr = config.learning_rate
        self.pars = OptimizerParams(OptimizerParams.AdamW(lr, 0.9, 0.999, 1e-8, 0.0),
                                    OptimizerParams.Sgd(lr, 0.0))
        self.keep_frozen = PARAM_FILTER(lambda tensor, user_data: False)
        params = LlamaOptParams(0, self.keep_frozen, None, api.constant_pars,
                                ctypes.cast(ctypes.pointer(self.pars), ctypes.c_void_p),
                                config.optimizer)
        api.llama.llama_opt_init(self.ctx, self.llm._model.model, params)
        self.result = api.ggml.ggml_opt_result_init()
        self.accumulators: list[int] | None = None
        self.reset_gradients = True  # False: as llama.cpp ships (self_check's counter-test)
        self._failed: list[BaseException] = []
        self._callback = EPOCH_CALLBACK(self._after_step)

    def _after_step(self, train: bool, opt: int, dataset: int, result: int, ibatch: int,
                    ibatch_max: int, t_start_us: int) -> None:
        try:  # an exception here would only be printed by ctypes: keep it for step()
            if self.accumulators is None:
                self.accumulators = self.api.gradient_accumulators(opt)
            if self.reset_gradients:
                self.api.zero(self.accumulators)
        except BaseException as exc:
            self._failed.append(exc)

    def step(self, window: list[int]) -> float:
        """One optimizer step on ``window`` (``n_ctx + 1`` tokens: inputs [:-1], targets
        [1:]); the loss (mean cross-entropy over its ``n_ctx`` positions)."""
        import numpy as np

        api = self.api
        if len(window) != self.n_ctx + 1:
            raise ValueError(f"a window has {self.n_ctx + 1} tokens, not {len(window)}")
        data = api.ggml.ggml_opt_dataset_init(GGML_TYPE_I32, GGML_TYPE_I32, self.n_ctx,
                                              self.n_ctx, 1, 1)
        try:
            tokens = np.asarray(window, dtype=np.int32)
            for getter, part in ((api.ggml.ggml_opt_dataset_data, tokens[:-1]),
                                 (api.ggml.ggml_opt_dataset_labels, tokens[1:])):
                ptr = ctypes.cast(api.ggml.ggml_get_data(getter(data)),
                                  ctypes.POINTER(ctypes.c_int32))
                np.ctypeslib.as_array(ptr, (self.n_ctx,))[:] = part
            api.llama.llama_opt_epoch(self.ctx, data, self.result, None, 1,
                                      ctypes.cast(self._callback, ctypes.c_void_p), None)
            if self._failed:
                raise self._failed[0]
            if self.accumulators is None:
                raise TrainingUnsupported("llama_opt_epoch ran no step: the gradients could "
                                          "not be reset")
            loss = api.loss(self.result)
        finally:
            api.ggml.ggml_opt_result_reset(self.result)
            api.ggml.ggml_opt_dataset_free(data)
        return loss

    def lora_arrays(self, rank: int) -> dict[str, Any]:
        tensors: dict[str, Any] = {}
        for name, (n_in, n_out) in sorted(self.shapes.items()):
            tensors[f"{name}.lora_a"] = self.api.read(self.lora[f"{name}.lora_a"]).reshape(
                rank, n_in)
            tensors[f"{name}.lora_b"] = self.api.read(self.lora[f"{name}.lora_b"]).reshape(
                n_out, rank)
        return tensors

    def close(self) -> None:
        if self.result:
            self.api.ggml.ggml_opt_result_free(self.result)
            self.result = None
        self.llm.close()


@dataclass(frozen=True, slots=True)
class SelfCheck:
    """Each SGD step's move of a LoRA tensor relative to the first step's."""

    ratios: tuple[float, ...]

    @property
    def ok(self) -> bool:
        return bool(self.ratios) and all(abs(r - 1.0) <= SELF_CHECK_TOLERANCE
                                         for r in self.ratios)


def step_ratios(snapshots: list[Any]) -> tuple[float, ...]:
    """How far each step moved a tensor, relative to the first step (pure)."""
    import numpy as np

    moves = [float(np.linalg.norm(b - a)) for a, b in itertools.pairwise(snapshots)]
    if not moves or moves[0] <= 0:
        return ()
    return tuple(m / moves[0] for m in moves)


def self_check(api: GgmlOpt, base_f32: Path, shapes: dict[str, tuple[int, int]],
               window: list[int], folder: Path, threads: int, *, seed: int = 0,
               reset_gradients: bool = True, gpu_layers: int = 0) -> SelfCheck:
    """Plain SGD on ``window`` ``SELF_CHECK_STEPS`` times with a rank-1 LoRA on one tensor of
    the last layer (the backward pass stops there: cheap): if the accumulators were not
    zeroed, step k would move it k times as far as the first step.
    ``reset_gradients=False`` runs it as llama.cpp ships (the check must then fail)."""
    import numpy as np

    last = max(shapes, key=lambda name: (int(name.split(".")[1]), name.endswith("ffn_down")))
    probe = {last: shapes[last]}
    tensors = initial_lora(probe, 1, seed)
    # B starts at zero; a small nonzero B makes A's gradient nonzero too
    tensors[f"{last}.lora_b"] = np.full_like(tensors[f"{last}.lora_b"], 1e-3)
    adapter = folder / "self-check-lora.gguf"
    write_lora_gguf(adapter, tensors, 1.0)
    session = Session(api, base_f32, adapter, probe,
                      SessionConfig(n_ctx=len(window) - 1, learning_rate=SELF_CHECK_LR,
                                    threads=threads, optimizer=OPTIMIZER_SGD,
                                    gpu_layers=gpu_layers))
    session.reset_gradients = reset_gradients
    try:
        watched = session.lora[f"{last}.lora_b"]
        snapshots = [api.read(watched)]
        for _ in range(SELF_CHECK_STEPS):
            session.step(window)
            snapshots.append(api.read(watched))
    finally:
        session.close()
        adapter.unlink(missing_ok=True)
    check = SelfCheck(step_ratios(snapshots))
    log.info("training self-check: step moves relative to the first %s",
             [round(r, 3) for r in check.ratios])
    return check
