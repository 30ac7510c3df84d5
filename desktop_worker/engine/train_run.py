"""A LoRA training run with llama.cpp (issue 37), in the train child (``engine_child``): the
examples tokenized under the base's chat template, the F32 copy, the self-check, then the
planned steps (``engine.training``), with progress, checkpoints and the adapter written in the
run's folder. Never imported by the worker's own process (it loads llama.cpp).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from desktop_worker.engine.training import (
    ADAPTER_NAME,
    ALPHA_PER_RANK,
    Schedule,
    TrainCheckpoint,
    TrainEvent,
    TrainProgress,
    TrainResult,
    TrainSpec,
    Window,
    check_spec,
    plan_windows,
)
from desktop_worker.errors import TrainingCancelled, TrainingError, TrainingUnsupported
from shared_schema.training import checkpoint_name

log = logging.getLogger(__name__)


def tokenize_rows(base_path: Path, rows: Sequence[dict[str, Any]]) -> tuple[list[list[int]], int]:
    """Each row's tokens under the model's chat template (rendered as the worker renders it
    to serve), and the padding token."""
    from llama_cpp import Llama

    from desktop_worker.engine.chat_template import ChatTemplate

    llm = Llama(model_path=str(base_path), vocab_only=True, verbose=False)
    try:
        source = llm.metadata.get("tokenizer.chat_template")
        if not source:
            raise TrainingError("the base model has no chat template to render examples with")
        template = ChatTemplate(source)
        examples = []
        for row in rows:
            text = template.render(row["messages"], add_generation_prompt=False)
            examples.append(llm.tokenize(text.encode(), add_bos=False, special=True))
        pad = int(llm.metadata.get("tokenizer.ggml.padding_token_id",
                                   llm.metadata.get("tokenizer.ggml.eos_token_id", 0)))
    finally:
        llm.close()
    return examples, pad


def lora_shapes(base_path: Path) -> tuple[dict[str, tuple[int, int]], str]:
    """The targeted weights' (inputs, outputs), from the base's checked header, and its
    architecture."""
    from desktop_worker.engine.ggml_opt import TARGETS
    from shared_schema.errors import InvalidGgufFile
    from shared_schema.gguf_check import check_gguf_file

    try:
        with base_path.open("rb") as handle:
            header = check_gguf_file(handle, base_path.name)
    except (OSError, InvalidGgufFile) as exc:
        raise TrainingError(f"the base model cannot be read: {exc}") from exc
    shapes = {}
    for tensor in header.tensors:
        parts = tensor.name.split(".")
        if (len(parts) == 4 and parts[0] == "blk" and parts[2] in TARGETS
                and len(tensor.shape) == 2):
            shapes[tensor.name] = (int(tensor.shape[0]), int(tensor.shape[1]))
    if not shapes:
        raise TrainingUnsupported("the base model has none of the weights a LoRA adapter "
                                  "trains (attention and feed-forward of each layer)")
    return shapes, str(header.metadata.get("general.architecture", "llama"))


class LoraTrainer:
    """One run in ``folder`` (the train child's scratch): F32 copy, self-check, the steps;
    ``emit`` hears progress and checkpoints (the files are in ``folder``)."""

    def __init__(self, spec: TrainSpec, folder: Path, *, threads: int,
                 cancel: threading.Event, emit: Callable[[TrainEvent], None],
                 gpu_layers: int = 0) -> None:
        """``gpu_layers``: llama.cpp's n_gpu_layers for the sessions (0: the CPU); the F32
        copy is made on the CPU either way."""
        self.spec = spec
        self.folder = folder
        self.threads = threads
        self.gpu_layers = gpu_layers
        self.cancel = cancel
        self.emit = emit

    def _check_cancel(self) -> None:
        if self.cancel.is_set():
            raise TrainingCancelled("the training run was cancelled")

    def run(self) -> TrainResult:
        from desktop_worker.engine import ggml_opt

        spec = self.spec
        check_spec(spec)
        examples, pad = tokenize_rows(spec.base_path, spec.examples)
        windows = plan_windows(examples, n_ctx=spec.n_ctx, pad=pad, n_epochs=spec.n_epochs,
                               batch_size=spec.batch_size, seed=spec.seed)
        if spec.resume_step > len(windows):
            raise TrainingError(f"resume_step {spec.resume_step} is past the run's "
                                f"{len(windows)} steps")
        schedule = Schedule.of(windows, spec.progress_every_steps, spec.checkpoint_every_steps)
        shapes, arch = lora_shapes(spec.base_path)
        self._check_cancel()
        api = ggml_opt.GgmlOpt()
        base_f32 = ggml_opt.f32_copy(spec.base_path, self.folder / "base-f32.gguf",
                                     self.threads)
        self._check_cancel()
        check = ggml_opt.self_check(api, base_f32, shapes, list(windows[0].ids), self.folder,
                                    self.threads, seed=spec.seed, gpu_layers=self.gpu_layers)
        if not check.ok:
            raise TrainingUnsupported(
                "this llama.cpp adds up gradients across training steps (each step moved a "
                f"weight {', '.join(f'{r:.2f}' for r in check.ratios)} times as far as the "
                "first): training would diverge, so it does not start")
        self._check_cancel()
        alpha = ALPHA_PER_RANK * spec.rank
        if spec.resume_from is not None:
            adapter = spec.resume_from
        else:
            adapter = self.folder / "adapter-init.gguf"
            ggml_opt.write_lora_gguf(adapter, ggml_opt.initial_lora(shapes, spec.rank,
                                                                    spec.seed), alpha, arch)
        session = ggml_opt.Session(api, base_f32, adapter, shapes, ggml_opt.SessionConfig(
            n_ctx=spec.n_ctx, learning_rate=spec.learning_rate, threads=self.threads,
            gpu_layers=self.gpu_layers))
        try:
            return self._steps(session, windows, schedule, alpha, arch)
        finally:
            session.close()
            base_f32.unlink(missing_ok=True)

    def _steps(self, session: Any, windows: list[Window], schedule: Schedule, alpha: float,
               arch: str) -> TrainResult:
        from desktop_worker.engine import ggml_opt

        spec = self.spec
        trained = sum(w.trained_tokens for w in windows[:spec.resume_step])
        since: list[float] = []
        epoch_losses: list[float] = []
        loss = 0.0
        for step in range(spec.resume_step + 1, len(windows) + 1):
            self._check_cancel()
            window = windows[step - 1]
            if step > spec.resume_step + 1 and windows[step - 2].epoch != window.epoch:
                epoch_losses = []
            loss = session.step(list(window.ids))
            trained += window.trained_tokens
            since.append(loss)
            epoch_losses.append(loss)
            if schedule.progress_due(step):
                self.emit(TrainProgress(step, len(windows), window.epoch,
                                        sum(since) / len(since), trained))
                since = []
            if schedule.checkpoint_due(step):
                path = self.folder / checkpoint_name(step)
                ggml_opt.write_lora_gguf(path, session.lora_arrays(spec.rank), alpha, arch)
                self.emit(TrainCheckpoint(step, path, trained, loss))
        final = self.folder / ADAPTER_NAME
        ggml_opt.write_lora_gguf(final, session.lora_arrays(spec.rank), alpha, arch)
        mean = sum(epoch_losses) / len(epoch_losses) if epoch_losses else loss
        return TrainResult(final, len(windows), trained, mean)
