"""The model store against the fake hub, through the real huggingface_hub client."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import huggingface_hub.constants
import pytest

from desktop_worker.errors import (
    DownloadCancelled,
    HubError,
    HubOffline,
    InsufficientDisk,
    InvalidModelFile,
    InvalidModelName,
    ModelNotCached,
)
from desktop_worker.store import ModelStore, PullProgress
from desktop_worker.store.gguf_info import read_gguf_info
from desktop_worker.store.hub import HubClient, sha256_file
from shared_schema.hardware import ModelDescriptor
from tests.desktop_worker.store.conftest import (
    BIG_FILE,
    BIG_NAME,
    NOT_GGUF,
    REAL_FILE,
    REAL_NAME,
    REPO,
    TINY_NAME,
    FakeClock,
    Files,
    dead_endpoint,
    fast_store,
)
from tests.support.fake_disk import FakeDisk
from tests.support.fake_hub import FakeHub

WAIT_S = 20


def partials(store: ModelStore) -> list[Path]:
    return sorted(store.hub_dir.rglob("*.incomplete"))


# --- pulling -----------------------------------------------------------------------------------


def test_pull_downloads_checks_and_records_the_real_model(
    store: ModelStore, hub: FakeHub, files: Files
) -> None:
    reports: list[PullProgress] = []
    model = store.pull(REAL_NAME, progress=reports.append)

    size = files.real.stat().st_size
    assert model.name == REAL_NAME
    assert model.source == "hub"
    assert model.sha256 == files.real_sha256
    assert model.size_bytes == size
    assert model.path.stat().st_size == size
    assert model.paths == (model.path,)
    assert model.path.is_relative_to(store.root)
    assert model.path.name == REAL_FILE
    assert model.info.architecture == "llama"
    assert model.info.parameter_count == 134_515_008
    assert model.info.block_count == 30
    assert REPO in (model.origin or "")
    assert partials(store) == []

    # progress: bytes never go back, every report knows the total, the last one is complete
    downloaded = [r.downloaded_bytes for r in reports]
    assert len(reports) >= 5
    assert downloaded == sorted(downloaded)
    assert downloaded[0] == 0
    assert all(r.total_bytes == size for r in reports)
    assert downloaded[-1] == size
    assert reports[-1].done
    assert not any(r.done for r in reports[:-1])
    assert reports[-1].eta_s == 0.0
    assert any(r.bytes_per_s and r.bytes_per_s > 0 for r in reports)
    assert all(r.eta_s is None or r.eta_s >= 0 for r in reports)
    assert reports[-1].to_wire().downloaded_bytes == size

    # the file came over plain HTTP: a listing, one HEAD and one GET
    resolve = f"/resolve/{model.origin.split('@')[1].split(':')[0]}/{REAL_FILE}"  # type: ignore[union-attr]
    assert hub.count("GET", f"/api/models/{REPO}") == 1
    assert hub.count("HEAD", resolve) == 1
    assert hub.count("GET", resolve) == 1

    # the index survives a restart, and the model then works with no hub at all
    hub.stop()
    again = ModelStore(store.root, endpoint=dead_endpoint())
    assert [m.name for m in again.list()] == [REAL_NAME]
    reloaded = again.get(REAL_NAME)
    assert reloaded.sha256 == files.real_sha256
    assert reloaded.info == model.info
    assert again.pull(REAL_NAME).path == model.path


def test_cached_models_need_no_network(
    store: ModelStore, hub: FakeHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = store.pull(TINY_NAME)
    asked = len(hub.requests)

    again = store.pull(TINY_NAME)
    assert again.sha256 == first.sha256
    assert len(hub.requests) == asked  # no request at all for a cached model

    hub.stop()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert store.pull(TINY_NAME).path == first.path
    assert store.get(TINY_NAME).sha256 == first.sha256
    offline = ModelStore(store.root, endpoint=dead_endpoint())
    assert offline.pull(TINY_NAME).sha256 == first.sha256

    with pytest.raises(HubOffline, match="HF_HUB_OFFLINE"):
        store.pull(BIG_NAME)


def test_uncached_model_with_the_hub_unreachable(store_root: Path) -> None:
    store = ModelStore(store_root, endpoint=dead_endpoint())
    with pytest.raises(HubOffline, match="cannot reach"):
        store.pull(TINY_NAME)
    assert store.list() == []


def test_get_touches_last_used_and_raises_for_unknown_names(store_root: Path, hub: FakeHub) -> None:
    clock = FakeClock()
    store = ModelStore(store_root, endpoint=hub.url, clock=clock)
    pulled = store.pull(TINY_NAME)
    got = store.get(TINY_NAME)
    assert got.last_used > pulled.last_used
    assert got.added == pulled.added
    with pytest.raises(ModelNotCached):
        store.get(f"{REPO}:Q4_K_M")
    assert TINY_NAME in store
    assert f"{REPO}:Q4_K_M" not in store


def test_pull_a_split_model(store: ModelStore, files: Files) -> None:
    model = store.pull(f"{REPO}:Q2_K")
    assert [p.name for p in model.paths] == [
        "x-Q2_K-00001-of-00002.gguf",
        "x-Q2_K-00002-of-00002.gguf",
    ]
    assert model.path == model.paths[0]
    assert all(p.parent.name == "subdir" for p in model.paths)
    assert model.size_bytes == sum(p.stat().st_size for p in files.split)
    assert model.info.parts == 2
    assert model.info.parameter_count == read_gguf_info(files.split[0]).parameter_count
    assert model.sha256 == sha256_file(files.split[0])


def test_a_file_that_is_not_gguf_is_refused_and_deleted(store: ModelStore) -> None:
    with pytest.raises(InvalidModelFile, match="not a usable model file"):
        store.pull(f"{REPO}:Q3_K_M")
    assert not (store.hub_dir / REPO / NOT_GGUF).exists()
    assert store.list() == []


def test_a_corrupt_transfer_is_caught_by_the_sha256(store: ModelStore, hub: FakeHub) -> None:
    hub.corrupt_next(BIG_FILE)
    with pytest.raises(HubError, match="corrupt"):
        store.pull(BIG_NAME)
    assert partials(store) == []
    assert store.pull(BIG_NAME).sha256 == hub.file_sha256(REPO, BIG_FILE)


def test_concurrent_pulls_of_one_model_download_it_once(store: ModelStore, hub: FakeHub) -> None:
    with ThreadPoolExecutor(max_workers=3) as pool:
        results = list(pool.map(lambda _i: store.pull(BIG_NAME), range(3)))
    assert len({m.sha256 for m in results}) == 1
    assert hub.count("GET", BIG_FILE) == 1


# --- resume and cancel ---------------------------------------------------------------------------


def test_a_broken_download_resumes_with_a_range_request(store: ModelStore, hub: FakeHub) -> None:
    cut = 1_000_000
    hub.cut_after(BIG_FILE, cut)
    reports: list[PullProgress] = []
    model = store.pull(BIG_NAME, progress=reports.append)

    gets = [r for r in hub.requests if r.method == "GET" and r.path.endswith(BIG_FILE)]
    assert [r.range for r in gets] == [None, f"bytes={cut}-"]
    assert model.sha256 == hub.file_sha256(REPO, BIG_FILE)
    downloaded = [r.downloaded_bytes for r in reports]
    assert downloaded == sorted(downloaded)
    assert downloaded[-1] == model.size_bytes


def test_cancel_keeps_the_partial_file_and_the_next_pull_resumes(
    store: ModelStore, hub: FakeHub, files: Files
) -> None:
    held_at = 2 << 20  # the hub holds the download here until the test has cancelled
    pause = hub.pause_at(BIG_FILE, held_at)
    cancel = threading.Event()
    with ThreadPoolExecutor(max_workers=1) as pool:
        pulling = pool.submit(store.pull, BIG_NAME, None, cancel)
        assert pause.reached.wait(WAIT_S)
        cancel.set()
        pause.release.set()
        with pytest.raises(DownloadCancelled):
            pulling.result(timeout=WAIT_S)

    assert BIG_NAME not in store
    [partial] = partials(store)
    kept = partial.stat().st_size
    # the client stops at the first piece it reads after the cancel: at most one piece (64 KiB)
    # past the hold, and at least one piece in
    assert 0 < kept <= held_at + (1 << 20)
    assert kept < files.big.stat().st_size

    reports: list[PullProgress] = []
    model = store.pull(BIG_NAME, progress=reports.append)
    last_get = [r for r in hub.requests if r.method == "GET" and r.path.endswith(BIG_FILE)][-1]
    assert last_get.range == f"bytes={kept}-"
    assert reports[0].downloaded_bytes == kept
    assert model.sha256 == hub.file_sha256(REPO, BIG_FILE)
    assert partials(store) == []


def test_cancel_before_the_download_starts(store: ModelStore, hub: FakeHub) -> None:
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(DownloadCancelled):
        store.pull(BIG_NAME, cancel=cancel)
    assert hub.count("GET", BIG_FILE) == 0


def test_a_stale_partial_from_an_older_file_is_dropped(store: ModelStore, hub: FakeHub) -> None:
    stale = store.hub_dir / REPO / f"{BIG_FILE}.0123456789abcdef.incomplete"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"old bytes of another version")
    model = store.pull(BIG_NAME)
    assert not stale.exists()
    assert model.sha256 == hub.file_sha256(REPO, BIG_FILE)
    gets = [r for r in hub.requests if r.method == "GET" and r.path.endswith(BIG_FILE)]
    assert [r.range for r in gets] == [None]


def test_a_server_error_mid_pull_is_retried(store_root: Path, hub: FakeHub) -> None:
    store = fast_store(store_root, hub.url)
    hub.fail_next(BIG_FILE, 503, method="GET")
    model = store.pull(BIG_NAME)
    assert model.sha256 == hub.file_sha256(REPO, BIG_FILE)
    assert hub.count("GET", BIG_FILE) == 2


# --- disk and quota ------------------------------------------------------------------------------


def test_a_model_that_does_not_fit_on_the_disk_is_refused(store_root: Path, hub: FakeHub) -> None:
    store = ModelStore(store_root, endpoint=hub.url, headroom_bytes=0,
                       disk=FakeDisk(total_bytes=100 << 30, free_bytes=1 << 20))
    with pytest.raises(InsufficientDisk) as caught:
        store.pull(BIG_NAME)
    assert "6.0 MiB" in str(caught.value)
    assert "only 1.0 MiB may be used" in str(caught.value)
    assert hub.count("GET", "/resolve/") == 0
    assert store.list() == []


def test_disk_check_counts_bytes_already_downloaded(store_root: Path, hub: FakeHub) -> None:
    size = 6 << 20
    hub.cut_after(BIG_FILE, 5 << 20)
    disk = FakeDisk(total_bytes=100 << 30, free_bytes=1 << 30)
    client = HubClient(endpoint=hub.url, max_retries=0)  # the cut-off ends the first pull
    store = ModelStore(store_root, hub=client, disk=disk, headroom_bytes=0)
    with pytest.raises(HubOffline):
        store.pull(BIG_NAME)
    disk.free_bytes = 2 << 20  # less than the model, more than what is left to fetch
    store.hub.max_retries = 5
    model = store.pull(BIG_NAME)
    assert model.size_bytes > size


def quota_store(root: Path, hub: FakeHub, files: Files, models: int) -> ModelStore:
    tiny = files.tiny["a"].stat().st_size
    return ModelStore(root, endpoint=hub.url, quota_bytes=models * tiny + 100, clock=FakeClock())


def test_quota_evicts_the_least_recently_used(store_root: Path, hub: FakeHub, files: Files) -> None:
    store = quota_store(store_root, hub, files, models=2)
    a = store.pull(f"{REPO}:Q8_0")
    b = store.pull(f"{REPO}:Q4_K_M")
    store.get(a.name)  # a is now more recent than b
    c = store.pull(f"{REPO}:Q4_K_S")

    assert [m.name for m in store.list()] == sorted([a.name, c.name])
    assert not b.path.exists()
    assert a.path.exists()
    assert c.path.exists()
    assert store.used_bytes <= store.quota_bytes  # type: ignore[operator]

    store.pull(f"{REPO}:IQ4_XS")  # now a (touched before c was pulled) is the oldest
    assert sorted(m.name for m in store.list()) == sorted([c.name, f"{REPO}:IQ4_XS"])


def test_quota_never_evicts_protected_models(store_root: Path, hub: FakeHub, files: Files) -> None:
    store = quota_store(store_root, hub, files, models=2)
    a = store.pull(f"{REPO}:Q8_0")
    b = store.pull(f"{REPO}:Q4_K_M")
    store.pull(f"{REPO}:Q4_K_S", protect={a.name})
    assert a.name in store
    assert b.name not in store

    with pytest.raises(InsufficientDisk, match="may not be evicted"):
        store.pull(f"{REPO}:IQ4_XS", protect={a.name, f"{REPO}:Q4_K_S"})
    assert len(store.list()) == 2
    assert hub.count("GET", "IQ4_XS") == 0


def test_a_model_larger_than_the_quota_is_refused(store_root: Path, hub: FakeHub) -> None:
    store = ModelStore(store_root, endpoint=hub.url, quota_bytes=1 << 20)
    with pytest.raises(InsufficientDisk, match="larger than the model store quota"):
        store.pull(BIG_NAME)


# --- import, remove, describe --------------------------------------------------------------------


def test_import_copies_a_local_file_under_its_own_name(store: ModelStore, files: Files) -> None:
    model = store.import_file(files.real, "local/smollm2:q4")
    assert model.source == "import"
    assert model.sha256 == files.real_sha256
    assert model.path.is_relative_to(store.import_dir)
    assert model.path.read_bytes()[:4] == b"GGUF"
    assert model.info.block_count == 30
    assert files.real.exists()
    assert store.get("local/smollm2:q4").path == model.path

    with pytest.raises(InvalidModelName, match="already in the store"):
        store.import_file(files.real, "local/smollm2:q4")

    store.remove("local/smollm2:q4")
    assert not model.path.exists()
    assert not model.path.parent.exists()
    assert files.real.exists()


def test_import_refuses_what_is_not_gguf(store: ModelStore, tmp_path: Path) -> None:
    text = tmp_path / "model.gguf"
    text.write_text("not a model at all, but long enough to have a header\n")
    with pytest.raises(InvalidModelFile):
        store.import_file(text, "bad")
    with pytest.raises(InvalidModelFile, match="not a file"):
        store.import_file(tmp_path / "missing.gguf", "missing")
    with pytest.raises(InvalidModelName):
        store.import_file(text, "bad name")
    assert store.list() == []
    assert not store.import_dir.exists() or not any(store.import_dir.rglob("*.gguf"))


def test_import_a_split_model(store: ModelStore, files: Files) -> None:
    model = store.import_file(files.split[0], "split-model")
    assert [p.name for p in model.paths] == [p.name for p in files.split]
    assert model.info.parts == 2
    assert model.size_bytes == sum(p.stat().st_size for p in files.split)


def test_remove_deletes_the_files_and_forgets_the_model(store: ModelStore) -> None:
    model = store.pull(f"{REPO}:Q2_K")
    store.remove(model.name)
    assert not any(p.exists() for p in model.paths)
    assert not (store.hub_dir / REPO / "subdir").exists()
    assert store.list() == []
    assert ModelStore(store.root, endpoint=dead_endpoint()).list() == []
    with pytest.raises(ModelNotCached):
        store.remove(model.name)
    with pytest.raises(ModelNotCached):
        store.get(model.name)


def test_two_names_for_one_file_share_it_safely(store: ModelStore) -> None:
    upper = store.pull(f"{REPO}:Q8_0")
    lower = store.pull(f"{REPO}:q8_0")
    assert upper.path == lower.path
    store.remove(upper.name)
    assert lower.path.exists()
    assert store.get(lower.name).sha256 == upper.sha256


def test_descriptors(store: ModelStore, files: Files) -> None:
    pulled = store.pull(TINY_NAME)
    imported = store.import_file(files.tiny["b"], "mine")
    descriptors = store.descriptors(loaded={"mine"})
    assert descriptors == [
        ModelDescriptor(
            name=TINY_NAME,
            file_name="SmolLM2-135M-Instruct-Q8_0.gguf",
            size_bytes=pulled.size_bytes,
            sha256=pulled.sha256,
            parameter_count=pulled.info.parameter_count,
            quant="Q4_1",  # what the tiny file's header says
            context_length=256,
            loaded=False,
        ),
        imported.descriptor(loaded=True),
    ]
    assert descriptors[1].loaded
    assert store.descriptors() == [pulled.descriptor(), imported.descriptor()]


# --- the index -----------------------------------------------------------------------------------


def test_index_is_json_with_relative_paths(store: ModelStore) -> None:
    store.pull(TINY_NAME)
    document = json.loads((store.root / "index.json").read_text())
    record = document["models"][TINY_NAME]
    assert document["version"] == 1
    assert record["paths"] == [f"hub/{REPO}/SmolLM2-135M-Instruct-Q8_0.gguf"]
    assert len(record["sha256"]) == 64
    assert record["source"] == "hub"
    assert record["info"]["architecture"] == "llama"
    assert not list(store.root.glob(".index-*"))


def test_a_model_whose_files_vanished_is_forgotten(store: ModelStore) -> None:
    model = store.pull(TINY_NAME)
    model.path.unlink()
    with pytest.raises(ModelNotCached):
        store.get(TINY_NAME)
    assert store.list() == []


def test_files_deleted_while_stopped_are_dropped_on_load(store: ModelStore) -> None:
    model = store.pull(TINY_NAME)
    model.path.unlink()
    assert ModelStore(store.root, endpoint=dead_endpoint()).list() == []


def test_a_corrupt_index_is_set_aside(store_root: Path) -> None:
    store_root.mkdir(parents=True)
    (store_root / "index.json").write_text("{ not json")
    store = ModelStore(store_root, endpoint=dead_endpoint())
    assert store.list() == []
    assert len(list(store_root.glob("index.json.corrupt-*"))) == 1


def test_concurrent_gets_keep_the_index_whole(store: ModelStore) -> None:
    store.pull(TINY_NAME)
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(lambda _i: store.get(TINY_NAME), range(64)))
    document = json.loads((store.root / "index.json").read_text())
    assert list(document["models"]) == [TINY_NAME]


def test_resume_through_a_cdn_redirect(store: ModelStore, hub: FakeHub) -> None:
    hub.serve_lfs_from_cdn()
    hub.cut_after(BIG_FILE, 3 << 20)
    model = store.pull(BIG_NAME)
    gets = [r for r in hub.requests if r.method == "GET" and r.path.startswith("/cdn/")]
    assert [r.range for r in gets] == [None, f"bytes={3 << 20}-"]
    assert model.sha256 == hub.file_sha256(REPO, BIG_FILE)
