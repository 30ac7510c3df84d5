"""A hostile hub's file names: the real huggingface_hub client lists them from the fake hub on
127.0.0.1, and the store refuses each by POSIX and Windows rules (on every OS) before any path
is built from it, so nothing is written outside the models folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from desktop_worker.errors import HubError
from desktop_worker.store import ModelStore
from desktop_worker.store.names import check_repo_path
from tests.desktop_worker.store.conftest import Files
from tests.support.fake_hub import FakeHub, FakeRepo

HOSTILE_REPO = "evil-user/Hostile-GGUF"

# Each name holds a unique word (the filter that picks it) and is unsafe in one way.
HOSTILE = {
    "w01": ("../../escape-w01.gguf", "'..'"),
    "w02": ("/tmp/absolute-w02.gguf", "absolute"),
    "w03": ("sub\\..\\..\\back-w03.gguf", "'\\\\'"),
    "w04": ("C:/drive-w04.gguf", "':'"),
    "w05": ("c:drive-relative-w05.gguf", "':'"),
    "w06": ("CON.gguf/x-w06.gguf", "reserved device name"),
    "w07": ("nul.w07.gguf", "reserved device name"),
    "w08": ("com1/x-w08.gguf", "reserved device name"),
    "w09": ("LPT9.w09.gguf", "reserved device name"),
    "w10": ("trailing./x-w10.gguf", "ends in a dot or a space"),
    "w11": ("trailing /x-w11.gguf", "ends in a dot or a space"),
    "w12": ("what?-w12.gguf", "'?'"),
    "w13": ("a<b>-w13.gguf", "'<'"),
    "w14": ("pipe|-w14.gguf", "'|'"),
    "w15": ("star*-w15.gguf", "'*'"),
    "w16": ('quote"-w16.gguf', "'\"'"),
    "w17": ("tab\t-w17.gguf", "'\\t'"),
    "w18": ("dir//x-w18.gguf", "empty part"),
    "w19": ("./dot-w19.gguf", "'.' part"),
}


@pytest.fixture
def hostile_hub(files: Files) -> FakeHub:
    repo_files = {path: files.tiny["a"] for path, _ in HOSTILE.values()}
    repo_files["fine/ok-w99.gguf"] = files.tiny["b"]
    with FakeHub([FakeRepo(HOSTILE_REPO, files=repo_files)]) as running:
        yield running


def everything_under(root: Path) -> set[Path]:
    return {path for path in root.rglob("*")}


@pytest.mark.parametrize("tag", sorted(HOSTILE))
def test_a_hostile_file_name_is_refused_before_any_path_is_built(
        tmp_path: Path, hostile_hub: FakeHub, tag: str) -> None:
    _path, problem = HOSTILE[tag]
    root = tmp_path / "home" / "models"
    store = ModelStore(root, endpoint=hostile_hub.url)
    before = everything_under(tmp_path)
    with pytest.raises(HubError, match="unsafe file path") as refused:
        store.plan_pull(f"{HOSTILE_REPO}:{tag}")
    assert problem.strip("'") in str(refused.value)
    with pytest.raises(HubError, match="unsafe file path"):
        store.pull(f"{HOSTILE_REPO}:{tag}")
    # It was listed, never fetched, and nothing new exists outside the models folder.
    assert hostile_hub.count(contains="/api/models/") >= 2
    assert hostile_hub.count(contains="/resolve/") == 0
    outside = {p for p in everything_under(tmp_path) - before if root not in (p, *p.parents)}
    assert outside == set()
    assert store.list() == []


def test_a_safe_file_beside_hostile_ones_still_pulls(tmp_path: Path, hostile_hub: FakeHub) -> None:
    store = ModelStore(tmp_path / "models", endpoint=hostile_hub.url)
    model = store.pull(f"{HOSTILE_REPO}:w99")
    assert model.path == store.hub_dir / "evil-user" / "Hostile-GGUF" / "fine" / "ok-w99.gguf"
    assert model.path.is_file()


@pytest.mark.parametrize("path", [
    "model.gguf", "sub/dir/m-Q4_K_M.gguf", "con-model.gguf", "CONSOLE.gguf", "com10.gguf",
    "a.b.c.gguf", "models/x-00001-of-00002.gguf", "über/模型.gguf", ".hidden/m.gguf",
])
def test_ordinary_paths_pass(path: str) -> None:
    assert check_repo_path(path) == tuple(path.split("/"))


@pytest.mark.parametrize("path", [
    "", "/abs.gguf", "a/../b.gguf", "..", "a\\b.gguf", "C:x.gguf", "a/COM\u00b9.gguf",
    "aux", "Nul .gguf", "CONIN$.gguf", "x.gguf.", "x.gguf ", "a\x00b.gguf", "a\x7fb.gguf",
    "a/", "x" * 256 + ".gguf", "/".join(["d"] * 600),
])
def test_unsafe_paths_are_refused(path: str) -> None:
    with pytest.raises(HubError, match="refusing it"):
        check_repo_path(path, "some/repo")
