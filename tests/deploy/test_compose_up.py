"""The hosted queen's compose stack, up for real (issue 40): deploy/compose.yaml with
compose.offline.yaml (every image built from a Debian base made with debootstrap: Docker Hub is
out of reach here), three queen replicas, PostgreSQL, Redis and Caddy serving TLS from its
internal CA. Two real headless workers connect over wss:// through Caddy, the openai SDK is
served through Caddy (trusting that CA), the replica serving a stream is killed mid-stream and
the stream goes on, and `apiary-queen ledger check` is clean.

It builds images (several minutes the first time), so it runs only when asked:

    APIARY_TEST_COMPOSE=1 python3 dev.py test tests/deploy/test_compose_up.py

It needs root (debootstrap, for the base image), a running Docker daemon, docker-compose
(Debian's 1.29 or the compose plugin) and ports 80 and 443 free on this machine."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from tests.support.cheats import SMOLLM2
from tests.support.compose import compose_command
from tests.support.processes import Proc, base_env

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
BASE_IMAGE = "apiary/debian:bookworm"
REPLICAS = ("queen-1", "queen-2", "queen-3")
RUN_COMMAND = "APIARY_TEST_COMPOSE=1 python3 dev.py test tests/deploy/test_compose_up.py"

pytestmark = [
    pytest.mark.timeout(1800),
    pytest.mark.skipif(os.environ.get("APIARY_TEST_COMPOSE") != "1",
                       reason=f"the compose stack is built and run only when asked: "
                              f"`{RUN_COMMAND}`"),
]


def port_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed one's TIME_WAIT
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


@dataclass
class Stack:
    compose: list[str]
    env_file: Path
    tmp: Path
    ca: Path = field(default=Path())
    key: str = ""
    killed: set[str] = field(default_factory=set)

    def run(self, *args: str, timeout_s: float = 120,
            check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [*self.compose, "--env-file", str(self.env_file), "-f", "compose.yaml", "-f",
             "compose.offline.yaml", *args],
            cwd=DEPLOY, capture_output=True, text=True, timeout=timeout_s, check=False)
        if check and result.returncode != 0:
            raise AssertionError(f"compose {' '.join(args)} failed ({result.returncode}):\n"
                                 f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
        return result

    def queen_cli(self, replica: str, *args: str) -> subprocess.CompletedProcess[str]:
        return self.run("exec", "-T", replica, "apiary-queen", *args, check=False)

    def replica_health(self, replica: str) -> dict:
        """/health of one replica, asked inside its container (they publish no port)."""
        code = ("import json, urllib.request; print(json.dumps(json.load(urllib.request."
                "urlopen('http://127.0.0.1:8000/health', timeout=5))))")
        result = self.run("exec", "-T", replica, "python", "-c", code, check=False)
        if result.returncode != 0:
            return {}
        return json.loads(result.stdout)


def wait_for(check: Callable[[], object], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if check():
                return
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    compose = compose_command(daemon=True)
    for port in (80, 443):
        if not port_free(port):
            pytest.skip(f"port {port} is taken here: Caddy publishes 80 and 443")
    tmp = tmp_path_factory.mktemp("compose")
    if subprocess.run(["docker", "image", "inspect", BASE_IMAGE], capture_output=True,
                      check=False).returncode != 0:
        subprocess.run(["bash", str(DEPLOY / "offline" / "debian-base.sh"), BASE_IMAGE],
                       check=True, timeout=900)
    # The builds here cannot verify the package index's TLS (a sandbox's own CA): the queen's
    # image installs from a wheelhouse made on this machine, as compose.offline.yaml allows.
    subprocess.run(["bash", str(DEPLOY / "offline" / "wheels.sh"), sys.executable],
                   check=True, timeout=900)
    project = f"apiarytest{secrets.token_hex(3)}"
    env_file = tmp / ".env"
    env_file.write_text("\n".join([
        f"COMPOSE_PROJECT_NAME={project}", "APIARY_DOMAIN=localhost",
        "ACME_EMAIL=ops@example.com", f"POSTGRES_PASSWORD={secrets.token_hex(16)}",
        f"REDIS_PASSWORD={secrets.token_hex(16)}",
        f"APIARY_CLUSTER_SECRET={secrets.token_hex(32)}",
        f"APIARY_ADMIN_TOKEN={secrets.token_hex(16)}", "APIARY_LIGHTNING_BACKEND=none",
        f"APIARY_BASE_IMAGE={BASE_IMAGE}", ""]))
    stack = Stack(compose, env_file, tmp)
    try:
        stack.run("up", "-d", "--build", timeout_s=1500)
        # Caddy's internal CA (it serves "localhost" from it), once it has made it.
        ca = tmp / "caddy-root.crt"
        root = "/data/caddy/pki/authorities/local/root.crt"
        wait_for(lambda: stack.run("exec", "-T", "caddy", "cat", root,
                                   check=False).stdout.startswith("-----BEGIN"),
                 120, "Caddy's internal CA")
        ca.write_text(stack.run("exec", "-T", "caddy", "cat", root).stdout)
        stack.ca = ca
        verify = ssl.create_default_context(cafile=str(ca))
        with httpx.Client(verify=verify, trust_env=False, timeout=10) as http:
            wait_for(lambda: http.get("https://localhost/health").status_code == 200, 180,
                     "the queens through Caddy")
        made = stack.queen_cli("queen-1", "keys", "create", "--name", "compose-test",
                               "--credit-sats", "100000")
        assert made.returncode == 0, made.stdout + made.stderr
        found = re.search(r"\b(sk-[A-Za-z0-9_\-]+)", made.stdout)
        assert found, made.stdout
        stack.key = found.group(1)
        yield stack
    finally:
        logs = stack.run("logs", "--no-color", "--tail", "200", check=False, timeout_s=120)
        (tmp / "compose.log").write_text(logs.stdout + logs.stderr)
        stack.run("down", "-v", "--remove-orphans", check=False, timeout_s=300)


def worker(stack: Stack, name: str) -> Proc:
    folder = stack.tmp / name
    folder.mkdir()
    env = base_env(folder)
    env.update({"APIARY_KEY_PATH": str(folder / "key.pem"), "SSL_CERT_FILE": str(stack.ca),
                "APIARY_CONFIG_DIR": str(folder / "config")})
    return Proc([sys.executable, "-m", "desktop_worker.cli", "--headless", "--queen",
                 "wss://localhost/worker", "--model", str(SMOLLM2), "--models-dir",
                 str(folder / "models"), "--threads", "1", "--max-jobs", "1"],
                folder / "worker.log", env)


def test_workers_over_wss_and_a_stream_through_caddy_outlive_a_killed_replica(
        stack: Stack) -> None:
    ca = ssl.create_default_context(cafile=str(stack.ca))
    workers = [worker(stack, "w1").start()]
    client = OpenAI(base_url="https://localhost/v1", api_key=stack.key, max_retries=0,
                    http_client=httpx.Client(verify=ca, trust_env=False,
                                             timeout=300))
    try:
        with httpx.Client(verify=ca, trust_env=False, timeout=10) as http:
            def swarm_workers() -> int:
                swarm = http.get("https://localhost/health").json().get("swarm", {})
                return int(swarm.get("workers", 0))

            # One after the other: Caddy (least_conn) puts the second on another replica, and
            # the client's stream then goes to the third.
            wait_for(lambda: swarm_workers() == 1, 180, "a worker, over wss:// via Caddy")
            workers.append(worker(stack, "w2").start())
            wait_for(lambda: swarm_workers() == 2, 180, "the second worker")
        on = {replica: stack.replica_health(replica).get("workers", 0) for replica in REPLICAS}
        assert sorted(on.values()) == [0, 1, 1], on
        chunks: list[str] = []
        ended: list[str | None] = []
        failed: list[BaseException] = []

        def stream() -> None:
            try:
                answer = client.chat.completions.create(
                    model=SMOLLM2.stem, stream=True, temperature=0, max_tokens=300,
                    messages=[{"role": "user", "content": "Tell a long story about bees."}])
                for chunk in answer:
                    if chunk.choices and chunk.choices[0].delta.content:
                        chunks.append(chunk.choices[0].delta.content)
                    if chunk.choices and chunk.choices[0].finish_reason:
                        ended.append(chunk.choices[0].finish_reason)
            except BaseException as exc:  # reported by the test below
                failed.append(exc)

        reader = threading.Thread(target=stream)
        reader.start()
        wait_for(lambda: len(chunks) >= 3 or failed, 120, "the stream's first tokens")
        assert not failed, failed
        serving = [r for r in REPLICAS if stack.replica_health(r).get("jobs_running", 0) > 0]
        assert len(serving) == 1, serving
        before = len(chunks)
        stack.run("kill", "-s", "SIGKILL", serving[0])  # no goodbye: the socket just dies
        stack.killed.add(serving[0])
        reader.join(240)
        assert not reader.is_alive(), "the stream never ended"
        assert not failed, failed
        assert ended, "the stream ended with no finish reason"
        assert ended[-1] in ("length", "stop"), ended
        assert len(chunks) > before, "nothing came after the replica was killed"
        survivor = next(r for r in REPLICAS if r not in stack.killed)
        check = stack.queen_cli(survivor, "ledger", "check")
        assert check.returncode == 0, check.stdout + check.stderr
    finally:
        client.close()
        for proc in workers:
            proc.stop()
