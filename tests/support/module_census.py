"""Which modules a real ``apiary-queen`` or ``apiary-worker`` process loaded, by the time it exited.

``with_census(proc, dump)`` runs the same ``python -m MODULE ...`` command line through a small
wrapper that writes ``sorted(sys.modules)`` to ``dump`` as the interpreter exits.
``loaded_packages(dump)`` reads it back as top-level package names. The split installs rest on
this: a queen installed with ``apiary[queen]`` has no Qt or llama.cpp to import, so it must
never try.

Both programs stop gracefully on SIGTERM. uvicorn then raises the signal again once it has shut
down, which would end the process before ``atexit`` runs; the wrapper's own SIGTERM handler (the
one uvicorn restores and re-raises to) turns it into ``SystemExit(143)`` instead.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.support.processes import Proc

# Runs ``python -m MODULE ARGS...`` as ``python -c WRAPPER DUMP MODULE ARGS...``, unchanged but
# for the module list written at exit.
WRAPPER = """
import atexit, json, runpy, signal, sys
dump, module = sys.argv[1], sys.argv[2]
sys.argv = [module, *sys.argv[3:]]

def write_census():
    with open(dump, "w", encoding="utf-8") as handle:
        json.dump(sorted(sys.modules), handle)

def exit_on_signal(signum, frame):
    sys.exit(128 + signum)

atexit.register(write_census)
signal.signal(signal.SIGTERM, exit_on_signal)
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""

#: What ``Proc.stop`` returns for a process that stopped on SIGTERM through the wrapper.
STOPPED_BY_SIGTERM = 128 + 15


def with_census(proc: Proc, dump: Path) -> Proc:
    """``proc`` (not yet started, a ``python -m MODULE ...`` command) that also writes its
    module census to ``dump`` when it exits."""
    executable, flag, module, *args = proc.args
    assert (executable, flag) == (sys.executable, "-m"), proc.args
    return Proc([sys.executable, "-c", WRAPPER, str(dump), module, *args], proc.log_path,
                proc.env)


def loaded_packages(dump: Path) -> set[str]:
    """The top-level packages in a census (``PySide6`` for ``PySide6.QtCore``)."""
    modules = json.loads(dump.read_text(encoding="utf-8"))
    return {name.partition(".")[0] for name in modules}
