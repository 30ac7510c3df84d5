#!/usr/bin/env python3
"""One entry point for the two quick-start commands.

    python3 dev.py run     set up .venv and start the local swarm
    python3 dev.py test    set up .venv and run the linters and the whole test suite

Setting up means: create ``.venv`` with this interpreter (Python 3.11+), then
``pip install -e .[dev]`` whenever ``pyproject.toml`` changed since the last install.
Extra arguments after ``test`` go to pytest, after ``run`` to ``apiary-queen``.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
STAMP = VENV / ".apiary-installed"


def venv_python() -> Path:
    if os.name == "nt":
        return VENV / "Scripts" / "python.exe"
    return VENV / "bin" / "python"


def setup() -> Path:
    py = venv_python()
    if not py.exists():
        print(f"==> creating {VENV}", flush=True)
        venv.EnvBuilder(with_pip=True, upgrade_deps=True).create(VENV)
    wanted = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    if not STAMP.exists() or STAMP.read_text().strip() != wanted:
        print("==> installing apiary and its dependencies (first time: a few minutes)", flush=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", "-e", f"{ROOT}[dev]"], check=True)
        STAMP.write_text(wanted)
    return py


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in {"run", "test", "setup"}:
        print(__doc__)
        return 2
    command, rest = argv[0], argv[1:]
    py = setup()
    if command == "setup":
        return 0
    if command == "test":
        lint = subprocess.run([str(py), "-m", "ruff", "check", "."], cwd=ROOT)
        if lint.returncode:
            return lint.returncode
        return subprocess.run([str(py), "-m", "pytest", *rest], cwd=ROOT).returncode
    return subprocess.run([str(py), "-m", "queen_server.cli", *rest], cwd=ROOT).returncode


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except KeyboardInterrupt:
        sys.exit(130)
