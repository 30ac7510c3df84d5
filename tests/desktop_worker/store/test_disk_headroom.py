"""The volunteer's disk (issue 34): the store never fills its disk past the headroom.

The hostile party is whoever asks for a model: a file bigger than the free disk is refused before
its first byte, a download that would end inside the headroom stops midway and deletes what it
wrote, and two downloads together cannot do what one may not. The disk is a ``FakeDisk`` (set
sizes, shrinking as files land), the hub the fake hub on 127.0.0.1, the client the real one.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from desktop_worker.errors import DownloadCancelled, InsufficientDisk
from desktop_worker.store import ModelStore
from desktop_worker.store.disk import (
    GIB,
    CheckPacer,
    DiskGuard,
    LocalDisk,
    default_headroom_bytes,
    default_quota_gb,
    writable_bytes,
)
from tests.desktop_worker.store.conftest import BIG_FILE, BIG_NAME, REPO, TINY_NAME
from tests.support.fake_disk import FakeDisk, huge_file
from tests.support.fake_hub import FakeHub, FakeRepo
from tests.support.processes import base_env

MIB = 1 << 20
HUGE_REPO = "someone/Huge-GGUF"
HUGE_FILE = "huge-Q8_0.gguf"
HUGE_NAME = f"{HUGE_REPO}:Q8_0"


def incomplete(root: Path) -> list[Path]:
    return sorted(root.rglob("*.incomplete")) if root.exists() else []


# --- the rules, with plain numbers ---------------------------------------------------------------


def test_the_default_headroom_is_a_tenth_of_the_disk_from_10_to_50_gb():
    assert default_headroom_bytes(50 * GIB) == 10 * GIB
    assert default_headroom_bytes(100 * GIB) == 10 * GIB
    assert default_headroom_bytes(300 * GIB) == 30 * GIB
    # A big disk keeps 50 GB, not a tenth: an owner with 150 GB free on 2 TB can still store.
    assert default_headroom_bytes(500 * GIB) == 50 * GIB
    assert default_headroom_bytes(2000 * GIB) == 50 * GIB


def test_the_default_quota_is_half_the_free_disk_in_whole_gb():
    assert default_quota_gb(79 * GIB) == 39.0
    assert default_quota_gb(GIB) == 1.0  # never 0: 0 means "no quota"


def test_what_may_be_written_counts_headroom_and_downloads_under_way():
    assert writable_bytes(30 * GIB, 10 * GIB) == 20 * GIB
    assert writable_bytes(30 * GIB, 10 * GIB, 15 * GIB) == 5 * GIB
    assert writable_bytes(5 * GIB, 10 * GIB) < 0


def test_the_disk_is_read_again_by_bytes_or_by_time():
    now = [0.0]
    pacer = CheckPacer(step_bytes=100, interval_s=1.0, clock=lambda: now[0])
    assert pacer.due(0)  # at once
    assert not pacer.due(99)
    assert pacer.due(100)
    now[0] = 0.5
    assert not pacer.due(150)
    now[0] = 1.6  # a slow download is still checked every second
    assert pacer.due(151)


def test_the_guard_counts_reservations_and_stops_a_download_that_would_cross(tmp_path):
    disk = FakeDisk(total_bytes=100 * GIB, free_bytes=12 * GIB)  # 10 GB headroom: 2 GB room
    guard = DiskGuard(tmp_path, disk, check_step_bytes=MIB)
    assert guard.room_bytes() == 2 * GIB
    assert guard.problem("m", GIB) is None
    first = guard.reserve(GIB + GIB // 2)
    assert guard.room_bytes() == GIB // 2
    assert "downloads under way will still write" in (guard.problem("m", GIB) or "")
    watch = guard.watch("m", first, GIB + GIB // 2, clock=lambda: 0.0)  # by bytes alone
    watch(0)  # fits as reserved
    disk.free_bytes = 11 * GIB  # someone else wrote 1 GB: 1.5 GB still to come, 1 GB of room
    watch(MIB // 2)  # not due yet: half a step since the last reading
    with pytest.raises(InsufficientDisk, match="stopped downloading m"):
        watch(MIB)
    guard.release(first)
    assert guard.room_bytes() == GIB


def test_the_real_disk_is_read_where_the_folder_would_be(tmp_path):
    usage = LocalDisk().usage(tmp_path / "not" / "made" / "yet")
    assert 0 < usage.free_bytes <= usage.total_bytes


# --- refused before any byte ---------------------------------------------------------------------


@pytest.fixture
def huge_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    huge_file(tmp_path / "hub-files" / HUGE_FILE, 64 * GIB, monkeypatch)
    with FakeHub([FakeRepo(HUGE_REPO, files={HUGE_FILE: tmp_path / "hub-files" / HUGE_FILE})]
                 ) as hub:
        yield hub


def test_a_64_gb_file_on_a_disk_with_30_gb_free_is_refused_before_any_byte(store_root, huge_hub):
    disk = FakeDisk(total_bytes=500 * GIB, free_bytes=30 * GIB)
    store = ModelStore(store_root, endpoint=huge_hub.url, disk=disk)
    with pytest.raises(InsufficientDisk) as caught:
        store.pull(HUGE_NAME)
    message = str(caught.value)
    assert "needs 64.0 GiB" in message
    assert "30.0 GiB free" in message
    assert "50.0 GiB of it free" in message  # the headroom: a tenth of a 500 GB disk
    assert huge_hub.count(contains="/resolve/") == 0  # neither HEAD nor GET for the file
    assert store.list() == []
    assert incomplete(store_root) == []
    assert store.plan_pull(HUGE_NAME).problem is not None  # the app's check says the same
    assert store.room_bytes() == 0  # 30 GB free is inside the 50 GB headroom


def test_the_headroom_alone_refuses_a_file_the_free_disk_could_hold(store_root, hub, files):
    size = files.big.stat().st_size
    # 10 GB headroom (a 50 GB disk): the free space less the headroom is 1 MiB short.
    disk = FakeDisk(total_bytes=50 * GIB, free_bytes=10 * GIB + size - MIB)
    store = ModelStore(store_root, endpoint=hub.url, disk=disk)
    with pytest.raises(InsufficientDisk, match=r"always leaves 10\.0 GiB of it free"):
        store.pull(BIG_NAME)
    assert hub.count(contains=BIG_FILE) == 0
    disk.free_bytes += 2 * MIB
    assert store.pull(BIG_NAME).size_bytes == size  # with room, the same pull goes through


def test_the_queen_is_told_the_room_less_the_headroom_and_the_quota(store_root, hub):
    disk = FakeDisk(total_bytes=100 * GIB, free_bytes=30 * GIB)
    assert ModelStore(store_root, endpoint=hub.url, disk=disk).room_bytes() == 20 * GIB
    owner = ModelStore(store_root, endpoint=hub.url, disk=disk, headroom_bytes=25 * GIB)
    assert owner.room_bytes() == 5 * GIB
    quota = ModelStore(store_root, endpoint=hub.url, disk=disk, quota_bytes=3 * GIB)
    assert quota.room_bytes() == 3 * GIB


def test_check_room_refuses_by_size_with_no_hub_request(store_root, hub):
    disk = FakeDisk(total_bytes=100 * GIB, free_bytes=30 * GIB)
    store = ModelStore(store_root, endpoint=hub.url, disk=disk)
    with pytest.raises(InsufficientDisk, match=r"needs 64\.0 GiB"):
        store.check_room(BIG_NAME, 64 * GIB, [BIG_FILE])
    store.check_room(BIG_NAME, 19 * GIB, [BIG_FILE])  # fits: no error
    assert hub.count() == 0


# --- stopped midway ------------------------------------------------------------------------------


def test_a_download_that_would_cross_the_headroom_midway_stops_and_is_deleted(store_root, hub,
                                                                              files):
    size = files.big.stat().st_size  # about 6 MiB
    # Room for the file when it starts, with 2 MiB to spare; then another program fills the disk
    # as fast as the download does (2 bytes gone per byte downloaded).
    disk = FakeDisk(total_bytes=50 * GIB, free_bytes=10 * GIB + size + 2 * MIB,
                    filled_by=store_root, cost_per_byte=2.0)
    store = ModelStore(store_root, endpoint=hub.url, disk=disk, disk_check_bytes=256 * 1024)
    with pytest.raises(InsufficientDisk) as caught:
        store.pull(BIG_NAME)
    assert "stopped downloading" in str(caught.value)
    assert "the partial download was deleted" in str(caught.value)
    assert hub.count("GET", BIG_FILE) == 1  # it had started
    assert incomplete(store_root) == []  # and what it wrote is gone
    assert list(store_root.rglob("*.gguf")) == []
    assert store.list() == []
    assert disk.reads >= 3  # read again while the bytes arrived, not only at the start
    # It stopped before the disk went inside the headroom: 10 GiB was never crossed.
    assert disk.lowest_free >= 10 * GIB


def test_two_downloads_together_cannot_cross_the_headroom(store_root, hub, files):
    big = files.big.stat().st_size
    disk = FakeDisk(total_bytes=50 * GIB, free_bytes=10 * GIB + big + 1024)
    store = ModelStore(store_root, endpoint=hub.url, disk=disk)
    pause = hub.pause_at(BIG_FILE, 1 * MIB)
    with ThreadPoolExecutor(max_workers=1) as pool:
        first = pool.submit(store.pull, BIG_NAME)
        try:
            assert pause.reached.wait(30)
            assert store.room_bytes() < 2 * MIB  # the queen hears what the first still writes
            # The tiny model (3 KiB) would fit the free disk alone, not beside the big download.
            with pytest.raises(InsufficientDisk, match="downloads under way will still write"):
                store.pull(TINY_NAME)
        finally:
            pause.release.set()
        assert first.result(timeout=30).size_bytes == big
    assert hub.count("GET", "Q8_0") == 0


def test_a_cancelled_download_keeps_its_partial_file(store_root, hub):
    """Only a disk stop deletes the partial file: a cancel keeps it to resume (unchanged)."""
    disk = FakeDisk(total_bytes=100 * GIB, free_bytes=50 * GIB)
    store = ModelStore(store_root, endpoint=hub.url, disk=disk)
    pause = hub.pause_at(BIG_FILE, 2 * MIB)
    cancel = threading.Event()
    with ThreadPoolExecutor(max_workers=1) as pool:
        pulling = pool.submit(store.pull, BIG_NAME, None, cancel)
        try:
            assert pause.reached.wait(30)
        finally:
            cancel.set()
            pause.release.set()
        with pytest.raises(DownloadCancelled):
            pulling.result(timeout=30)
    assert len(incomplete(store_root)) == 1


# --- the owner's own pull, from the command line -------------------------------------------------


def test_the_cli_pull_refuses_a_model_past_the_headroom_in_plain_words(tmp_path, hub):
    env = base_env(tmp_path)
    env.update({"HF_ENDPOINT": hub.url, "APIARY_KEY_PATH": str(tmp_path / "key.pem"),
                # more than any disk here has: every model crosses it
                "APIARY_DISK_HEADROOM_GB": str(1 << 30)})
    result = subprocess.run(
        [sys.executable, "-m", "desktop_worker.cli", "models", "pull", BIG_NAME,
         "--models-dir", str(tmp_path / "models")],
        env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"apiary-worker: {BIG_NAME} needs 6.0 MiB")
    assert "Apiary always leaves" in last
    assert "Traceback" not in result.stderr
    assert hub.count(contains=f"{REPO}/resolve/") == 0


def test_the_settings_store_takes_the_owners_quota_or_half_of_what_it_could_hold(store_root):
    """``store_for``: what the worker, the Models tab and ``models`` open. An unchosen quota is
    half of the free disk plus what the store holds, so it does not shrink as the store fills;
    0 is no quota; the owner's headroom reaches the store."""
    from types import SimpleNamespace

    from desktop_worker.store import store_for

    def settings(quota_gb: float | None, headroom_gb: float | None = None) -> SimpleNamespace:
        return SimpleNamespace(models_dir=store_root, disk_quota_gb=quota_gb, hf_endpoint=None,
                               disk_headroom_bytes=int(headroom_gb * GIB) if headroom_gb
                               else None)

    disk = FakeDisk(total_bytes=100 * GIB, free_bytes=30 * GIB)
    assert store_for(settings(None), disk=disk).quota_bytes == 15 * GIB
    assert store_for(settings(0), disk=disk).quota_bytes is None
    assert store_for(settings(7), disk=disk).quota_bytes == 7 * GIB
    assert store_for(settings(7, headroom_gb=12), disk=disk).room_bytes() == 7 * GIB
    assert store_for(settings(0, headroom_gb=25), disk=disk).room_bytes() == 5 * GIB
