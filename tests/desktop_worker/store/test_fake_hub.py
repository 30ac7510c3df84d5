"""The fake hub answers what the real huggingface_hub client asks, as TESTING.md describes."""

from __future__ import annotations

import hashlib
import threading
import time
from pathlib import Path

import httpx
import pytest
from huggingface_hub import HfApi, hf_hub_download
from huggingface_hub.errors import GatedRepoError, RemoteEntryNotFoundError, RepositoryNotFoundError

from tests.desktop_worker.store.conftest import GATED_REPO, GOOD_TOKEN, REPO, Files
from tests.support.fake_hub import FakeHub, FakeRepo

TINY = "SmolLM2-135M-Instruct-Q8_0.gguf"


def test_model_info_and_listing_with_the_real_client(hub: FakeHub, files: Files) -> None:
    api = HfApi(endpoint=hub.url)
    info = api.model_info(REPO, files_metadata=True)
    assert info.id == REPO
    assert info.sha is not None
    assert len(info.sha) == 40
    siblings = {s.rfilename: s for s in info.siblings or []}
    assert siblings[TINY].size == files.tiny["a"].stat().st_size
    assert siblings[TINY].lfs is not None
    assert siblings[TINY].lfs.sha256 == hashlib.sha256(files.tiny["a"].read_bytes()).hexdigest()
    assert siblings["README.md"].lfs is None

    listed = api.list_repo_files(REPO)
    assert "subdir/x-Q2_K-00002-of-00002.gguf" in listed
    assert "README.md" in listed
    assert hub.count("GET", f"/api/models/{REPO}/tree/main") == 1


def test_hf_hub_download_and_its_cached_repeat(hub: FakeHub, tmp_path: Path, files: Files) -> None:
    first = hf_hub_download(REPO, TINY, cache_dir=tmp_path, endpoint=hub.url)
    assert Path(first).read_bytes() == files.tiny["a"].read_bytes()
    resolve = f"/{REPO}/resolve/main/{TINY}"
    assert (hub.count("HEAD", resolve), hub.count("GET", resolve)) == (1, 1)

    again = hf_hub_download(REPO, TINY, cache_dir=tmp_path, endpoint=hub.url)
    assert again == first
    assert (hub.count("HEAD", resolve), hub.count("GET", resolve)) == (2, 1)


def test_errors_the_real_client_recognises(hub: FakeHub, tmp_path: Path) -> None:
    with pytest.raises(RepositoryNotFoundError):
        HfApi(endpoint=hub.url).model_info("nobody/nothing")
    with pytest.raises(RemoteEntryNotFoundError):
        hf_hub_download(REPO, "missing.gguf", cache_dir=tmp_path, endpoint=hub.url)
    with pytest.raises(GatedRepoError):
        hf_hub_download(GATED_REPO, "gated-Q8_0.gguf", cache_dir=tmp_path, endpoint=hub.url)
    path = hf_hub_download(
        GATED_REPO, "gated-Q8_0.gguf", cache_dir=tmp_path, endpoint=hub.url, token=GOOD_TOKEN
    )
    assert Path(path).stat().st_size > 0


def test_gated_answers_401_without_and_403_with_a_wrong_token(hub: FakeHub) -> None:
    url = f"{hub.url}/{GATED_REPO}/resolve/main/gated-Q8_0.gguf"
    with httpx.Client(trust_env=False) as client:
        anonymous = client.head(url)
        wrong = client.head(url, headers={"Authorization": "Bearer hf_wrong"})
        right = client.head(url, headers={"Authorization": f"Bearer {GOOD_TOKEN}"})
        listing = client.get(f"{hub.url}/api/models/{GATED_REPO}")
    assert (anonymous.status_code, anonymous.headers["X-Error-Code"]) == (401, "GatedRepo")
    assert (wrong.status_code, wrong.headers["X-Error-Code"]) == (403, "GatedRepo")
    assert right.status_code == 200
    assert listing.status_code == 200


def test_resolve_headers_and_ranges(hub: FakeHub, files: Files) -> None:
    data = files.tiny["a"].read_bytes()
    url = f"{hub.url}/{REPO}/resolve/main/{TINY}"
    with httpx.Client(trust_env=False) as client:
        head = client.head(url)
        part = client.get(url, headers={"Range": "bytes=100-199"})
        tail = client.get(url, headers={"Range": "bytes=100-"})
        suffix = client.get(url, headers={"Range": "bytes=-10"})
        beyond = client.get(url, headers={"Range": f"bytes={len(data)}-"})
    assert head.status_code == 200
    assert int(head.headers["Content-Length"]) == len(data)
    assert head.headers["ETag"] == f'"{hashlib.sha256(data).hexdigest()}"'
    assert len(head.headers["X-Repo-Commit"]) == 40
    assert not any(k.lower().startswith("x-xet") for k in head.headers)
    assert (part.status_code, part.content) == (206, data[100:200])
    assert part.headers["Content-Range"] == f"bytes 100-199/{len(data)}"
    assert tail.content == data[100:]
    assert suffix.content == data[-10:]
    assert beyond.status_code == 416


def test_cut_after_hangs_up_once(hub: FakeHub) -> None:
    url = f"{hub.url}/{REPO}/resolve/main/{TINY}"
    hub.cut_after(TINY, 1000)
    with httpx.Client(trust_env=False) as client:
        with pytest.raises(httpx.RemoteProtocolError):
            client.get(url)
        assert client.get(url).status_code == 200


def test_pause_holds_a_download_until_released(hub: FakeHub, files: Files) -> None:
    url = f"{hub.url}/{REPO}/resolve/main/{TINY}"
    pause = hub.pause_at(TINY, 2048)
    got: list[bytes] = []

    def fetch() -> None:
        with httpx.Client(trust_env=False) as client:
            got.append(client.get(url).content)

    worker = threading.Thread(target=fetch)
    worker.start()
    assert pause.reached.wait(10)
    assert not got
    pause.release.set()
    worker.join(10)
    assert got == [files.tiny["a"].read_bytes()]


def test_throttle_slows_bodies(files: Files) -> None:
    data = bytes(64 * 1024)
    with FakeHub([FakeRepo("a/b", files={"f.gguf": data})]) as hub:
        hub.throttle(256 * 1024)
        started = time.perf_counter()
        with httpx.Client(trust_env=False) as client:
            body = client.get(f"{hub.url}/a/b/resolve/main/f.gguf").content
        assert body == data
        assert time.perf_counter() - started >= 0.2


def test_stop_closes_keep_alive_connections(files: Files) -> None:
    hub = FakeHub([FakeRepo("a/b", files={"f.gguf": b"x" * 10})]).start()
    url = f"{hub.url}/a/b/resolve/main/f.gguf"
    with httpx.Client(trust_env=False) as client:
        assert client.get(url).status_code == 200
        hub.stop()
        with pytest.raises(httpx.TransportError):
            client.get(url)


async def test_usable_from_async_tests() -> None:
    async with (
        FakeHub([FakeRepo("a/b", files={"f.gguf": b"abc"})]) as hub,
        httpx.AsyncClient(trust_env=False) as client,
    ):
        response = await client.get(f"{hub.url}/a/b/resolve/main/f.gguf")
    assert response.content == b"abc"
    assert hub.count("GET") == 1


def test_cdn_redirects_work_with_the_real_client(
    hub: FakeHub, tmp_path: Path, files: Files
) -> None:
    hub.serve_lfs_from_cdn()
    path = hf_hub_download(REPO, TINY, cache_dir=tmp_path, endpoint=hub.url)
    assert Path(path).read_bytes() == files.tiny["a"].read_bytes()
    assert hub.count("GET", "/cdn/") == 1
    assert hub.count("GET", "/resolve/") == 0  # the HEAD told the client where the bytes are
