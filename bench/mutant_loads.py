"""Accepted mutants in the sandboxed engine (issue 34): every mutant of the seeded 10,000-mutant
corpus of the real SmolLM2 header (``tests/support/gguf_mutants.py``) that the model-file checks
accept is written out whole and loaded as the worker loads any model, one confined engine child
each, then asked for four tokens. Prints how each fared (served, refused as a load error, its
child crashed or was stopped) and that the worker's process outlived them all.

    .venv/bin/python bench/mutant_loads.py [--count N]   # default: every accepted mutant
"""

from __future__ import annotations

import argparse
import collections
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from desktop_worker.sandbox.context import SandboxedContexts  # noqa: E402
from tests.desktop_worker.sandbox.test_mutant_models import REAL, try_model  # noqa: E402
from tests.support.gguf_mutants import accepted_mutant_files  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=10_000)
    args = parser.parse_args()
    contexts = SandboxedContexts(load_timeout_s=60)
    outcomes: collections.Counter[str] = collections.Counter()
    kinds: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="apiary-mutants-") as folder:
        for path in accepted_mutant_files(Path(folder), count=args.count):
            outcome = try_model(contexts, path)
            outcomes[outcome] += 1
            kinds[path.stem.split("-", 2)[2]][outcome] += 1
    elapsed = time.perf_counter() - started
    after = try_model(contexts, REAL)
    print(f"machine: {platform.machine()}, python {platform.python_version()}, pid {os.getpid()}")
    print(f"{sum(outcomes.values())} accepted mutants loaded in {elapsed:.0f} s; the real model "
          f"afterwards: {after}")
    print()
    print(f"{'mutation':<22} {'served':>7} {'refused':>8} {'crashed':>8}")
    for kind, counts in sorted(kinds.items()):
        print(f"{kind:<22} {counts['served']:>7} {counts['refused']:>8} {counts['crashed']:>8}")
    print(f"{'all':<22} {outcomes['served']:>7} {outcomes['refused']:>8} {outcomes['crashed']:>8}")
    return 0 if after == "served" else 1


if __name__ == "__main__":
    sys.exit(main())
