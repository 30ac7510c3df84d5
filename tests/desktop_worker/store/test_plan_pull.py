"""``ModelStore.plan_pull``: what a pull would take, checked before any download."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from desktop_worker.errors import AmbiguousFilter, DownloadCancelled, RepoNotFound
from desktop_worker.store import ModelStore
from tests.desktop_worker.store.conftest import (
    BIG_FILE,
    BIG_NAME,
    REAL_NAME,
    REPO,
    TINY_NAME,
    Files,
)
from tests.support.fake_disk import FakeDisk
from tests.support.fake_hub import FakeHub


def gets(hub: FakeHub) -> int:
    return hub.count("GET", contains="/resolve/")


def test_a_plan_reads_sizes_and_downloads_nothing(store: ModelStore, hub: FakeHub, files: Files):
    plan = store.plan_pull(REAL_NAME)
    assert plan.total_bytes == files.real.stat().st_size
    assert plan.on_disk_bytes == 0
    assert plan.problem is None
    assert not plan.cached
    assert plan.files == ("SmolLM2-135M-Instruct-Q4_1.gguf",)
    assert gets(hub) == 0


def test_a_stored_model_plans_as_cached_with_no_network(store, hub):
    store.pull(TINY_NAME)
    listed = hub.count()
    plan = store.plan_pull(TINY_NAME)
    assert plan.cached
    assert plan.problem is None
    assert hub.count() == listed


def test_the_quota_and_the_disk_are_checked(store_root, hub, files):
    over_quota = ModelStore(store_root, endpoint=hub.url, quota_bytes=1 << 20)
    assert "larger than the model store quota" in over_quota.plan_pull(BIG_NAME).problem
    full_disk = ModelStore(store_root / "b", endpoint=hub.url, headroom_bytes=0,
                           disk=FakeDisk(total_bytes=100 << 30, free_bytes=1 << 20))
    problem = full_disk.plan_pull(BIG_NAME).problem
    assert problem is not None
    assert "only 1.0 MiB may be used" in problem
    assert gets(hub) == 0


def test_a_partial_download_counts_as_on_disk(store, hub):
    pause = hub.pause_at(BIG_FILE, 2 << 20)
    cancel = threading.Event()
    with ThreadPoolExecutor(max_workers=1) as pool:
        pulling = pool.submit(store.pull, BIG_NAME, None, cancel)
        assert pause.reached.wait(30)
        cancel.set()
        pause.release.set()
        with pytest.raises(DownloadCancelled):
            pulling.result(timeout=30)
    assert store.plan_pull(BIG_NAME).on_disk_bytes > 0


def test_bad_names_fail_as_a_pull_would(store):
    with pytest.raises(RepoNotFound):
        store.plan_pull("nobody/nothing-GGUF:Q4_K_M")
    with pytest.raises(AmbiguousFilter):
        store.plan_pull(f"{REPO}:Q4_K")
