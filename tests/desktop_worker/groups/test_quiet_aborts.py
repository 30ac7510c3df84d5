"""A head's or member's child process aborted by llama.cpp (any RPC failure does, by design:
a member leaving mid-answer) says why in one line and prints no backtrace: without
``quiet_aborts`` ggml attaches gdb (when installed), which adds about half a second to every
failover and dumps a stack into the owner's log, or else prints its own frames."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

ABORT = textwrap.dedent("""
    import ctypes, pathlib, sys
    import llama_cpp
    from desktop_worker.groups.rpc import quiet_aborts
    if sys.argv[1] == "quiet":
        quiet_aborts()
    lib = pathlib.Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"
    ctypes.CDLL(str(lib)).ggml_abort(b"ggml-rpc.cpp", 569, b"Remote RPC server crashed")
""")


def aborted(mode: str) -> str:
    done = subprocess.run([sys.executable, "-c", ABORT, mode], capture_output=True, text=True,
                          timeout=60, check=False, env={"PATH": "/usr/bin:/bin"})
    assert done.returncode != 0  # SIGABRT
    return done.stdout + done.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="libggml-base.so is Linux's")
def test_an_aborted_child_says_why_without_a_backtrace() -> None:
    loud, quiet = aborted("loud"), aborted("quiet")
    assert "ggml_print_backtrace" in loud  # what ggml does unless told not to
    assert "Remote RPC server crashed" in quiet
    assert "ggml_print_backtrace" not in quiet
    assert len(quiet.splitlines()) <= 2
