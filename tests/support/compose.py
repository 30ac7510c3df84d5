"""Which compose this machine has: the docker compose plugin, else Debian's docker-compose
1.29 (both read deploy/compose.yaml); the tests that need one skip, saying why, without."""

from __future__ import annotations

import shutil
import subprocess

import pytest


def compose_command(*, daemon: bool = False) -> list[str]:
    """The compose command to run; ``daemon``: a Docker daemon must answer too."""
    if shutil.which("docker") is None:
        pytest.skip("no docker client (the docker compose plugin is not installed)")
    if daemon and subprocess.run(["docker", "info"], capture_output=True,
                                 check=False).returncode != 0:
        pytest.skip("no Docker daemon answers (dockerd)")
    if subprocess.run(["docker", "compose", "version"], capture_output=True,
                      check=False).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    pytest.skip("the docker compose plugin is not installed (nor docker-compose)")
