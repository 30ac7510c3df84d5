"""Every way the hub can say no, as the store's own errors."""

from __future__ import annotations

from pathlib import Path

import huggingface_hub.constants
import pytest

from desktop_worker.errors import (
    AmbiguousFilter,
    GatedRepo,
    HubError,
    HubOffline,
    InvalidModelName,
    NoMatchingFile,
    RemoteFileNotFound,
    RepoNotFound,
)
from desktop_worker.store import ModelStore
from desktop_worker.store.hub import HubClient, RemoteFile, resolve_endpoint
from tests.desktop_worker.store.conftest import GATED_REPO, GOOD_TOKEN, REPO, TINY_NAME, Files
from tests.support.fake_hub import FakeHub

GATED_NAME = f"{GATED_REPO}:Q8_0"


def test_repo_not_found(store: ModelStore) -> None:
    with pytest.raises(RepoNotFound, match="nobody/nothing-GGUF"):
        store.pull("nobody/nothing-GGUF:Q4_K_M")


def test_gated_repo_without_a_token(store: ModelStore, hub: FakeHub) -> None:
    with pytest.raises(GatedRepo, match="HF_TOKEN") as caught:
        store.pull(GATED_NAME)
    assert GATED_REPO in str(caught.value)
    assert hub.count("GET", "/resolve/") == 0
    assert store.list() == []


def test_gated_repo_with_a_token_without_access(store_root: Path, hub: FakeHub) -> None:
    store = ModelStore(store_root, endpoint=hub.url, token="hf_not_granted")
    with pytest.raises(GatedRepo):
        store.pull(GATED_NAME)


def test_gated_repo_with_a_token(store_root: Path, hub: FakeHub, files: Files) -> None:
    store = ModelStore(store_root, endpoint=hub.url, token=GOOD_TOKEN)
    model = store.pull(GATED_NAME)
    assert model.path.read_bytes() == files.tiny["f"].read_bytes()
    resolves = [r for r in hub.requests if "/resolve/" in r.path]
    assert resolves
    assert all(r.authorization == f"Bearer {GOOD_TOKEN}" for r in resolves)


def test_gated_repo_with_hf_token_in_the_environment(
    store_root: Path, hub: FakeHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_TOKEN", GOOD_TOKEN)
    store = ModelStore(store_root, endpoint=hub.url)
    assert store.pull(GATED_NAME).size_bytes > 0


def test_file_missing_on_the_hub(store: ModelStore, hub: FakeHub) -> None:
    hub.fail_next("/resolve/", 404, error_code="EntryNotFound", method="HEAD")
    with pytest.raises(RemoteFileNotFound, match=r"SmolLM2-135M-Instruct-Q8_0\.gguf"):
        store.pull(TINY_NAME)


def test_download_of_a_file_that_is_not_there(hub: FakeHub, tmp_path: Path) -> None:
    client = HubClient(endpoint=hub.url)
    with pytest.raises(RemoteFileNotFound, match=r"missing\.gguf"):
        client.download(REPO, RemoteFile("missing.gguf", 10), tmp_path / "missing.gguf")


def test_filter_matching_nothing_lists_the_repo_models(store: ModelStore) -> None:
    with pytest.raises(NoMatchingFile) as caught:
        store.pull(f"{REPO}:Q3_K_L")
    assert "SmolLM2-135M-Instruct-Q4_1.gguf" in caught.value.candidates
    assert "subdir/x-Q2_K-00001-of-00002.gguf (2 parts)" in caught.value.candidates
    assert "README.md" not in caught.value.candidates


def test_ambiguous_filter_lists_the_matches(store: ModelStore, hub: FakeHub) -> None:
    with pytest.raises(AmbiguousFilter) as caught:
        store.pull(f"{REPO}:Q4_K")
    assert caught.value.candidates == [
        "SmolLM2-135M-Instruct-Q4_K_M.gguf",
        "SmolLM2-135M-Instruct-Q4_K_S.gguf",
    ]
    assert hub.count(contains="/resolve/") == 0


def test_invalid_name_makes_no_request(store: ModelStore, hub: FakeHub) -> None:
    with pytest.raises(InvalidModelName):
        store.pull("not a name")
    assert hub.requests == []


def test_offline_mode_for_listing_and_downloading(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = HubClient(endpoint=hub.url)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(HubOffline, match="HF_HUB_OFFLINE"):
        client.list_files(REPO)
    with pytest.raises(HubOffline, match="HF_HUB_OFFLINE"):
        client.download(REPO, RemoteFile("README.md", 10), tmp_path / "README.md")
    assert hub.requests == []


def test_other_hub_failures(store: ModelStore, hub: FakeHub) -> None:
    hub.fail_next("/api/models/", 500)
    with pytest.raises(HubError, match="500"):
        store.pull(TINY_NAME)


def test_endpoint_comes_from_hf_endpoint(
    store_root: Path, hub: FakeHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_ENDPOINT", hub.url + "/")
    assert resolve_endpoint() == hub.url
    assert resolve_endpoint("http://elsewhere:1") == "http://elsewhere:1"
    store = ModelStore(store_root)
    assert store.pull(TINY_NAME).size_bytes > 0
    assert hub.count("GET", f"/api/models/{REPO}") == 1


def test_default_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    assert resolve_endpoint() == "https://huggingface.co"


def test_the_token_goes_to_the_hub_but_not_to_the_cdn(
    store_root: Path, hub: FakeHub, files: Files
) -> None:
    hub.serve_lfs_from_cdn()
    store = ModelStore(store_root, endpoint=hub.url, token=GOOD_TOKEN)
    model = store.pull(GATED_NAME)
    assert model.path.read_bytes() == files.tiny["f"].read_bytes()
    heads = [r for r in hub.requests if r.method == "HEAD" and "/resolve/" in r.path]
    cdn_gets = [r for r in hub.requests if r.method == "GET" and r.path.startswith("/cdn/")]
    assert [r.authorization for r in heads] == [f"Bearer {GOOD_TOKEN}"]
    assert len(cdn_gets) == 1
    assert cdn_gets[0].authorization is None
