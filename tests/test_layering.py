"""The import contracts in ``pyproject.toml`` (``[tool.importlinter]``) catch what they promise.

``dev.py test`` runs ``lint-imports`` on the real tree before pytest. These tests prove that a
broken contract fails that run: they copy the three packages and the config to a temporary
directory, add one forbidden import, and run ``lint-imports`` there. They also check the one
kind of cycle the ``acyclic_siblings`` contract cannot see: a package's ``__init__`` caught in a
cycle with its own modules (it compares only siblings, and a package is no sibling of its
children).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("shared_schema", "queen_server", "desktop_worker")
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def copy_of_the_tree(tmp_path: Path) -> Path:
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def lint_imports(tree: Path, contract: str) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` for one contract (by id) over ``tree``, which it imports from first."""
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--contract", contract],
        cwd=tree, capture_output=True, text=True, timeout=120,
    )


@pytest.mark.parametrize(
    ("contract", "name", "module", "forbidden", "reported"),
    [
        pytest.param(
            "swarm-core", "queen_server.swarm imports no other room of the queen",
            "queen_server.swarm.registry", "queen_server.billing.pricing",
            "queen_server.swarm.registry -> queen_server.billing.pricing", id="swarm-core"),
        pytest.param(
            "swarm-libraries", "queen_server.swarm uses no web, database or server library",
            "queen_server.swarm.routing", "sqlalchemy",
            "queen_server.swarm.routing -> sqlalchemy", id="swarm-libraries"),
        pytest.param(
            "edges-on-top", "queen_server.http and queen_server.web sit above",
            "queen_server.storage.engine", "queen_server.http.deps",
            "queen_server.storage.engine -> queen_server.http.deps", id="edges-on-top"),
        pytest.param(
            "edges-on-top", "queen_server.http and queen_server.web sit above",
            "queen_server.web.pages", "queen_server.http.io",
            "queen_server.web.pages -> queen_server.http.io", id="http-and-web-apart"),
        pytest.param(
            "sides-apart", "the queen and the worker never import each other",
            "queen_server.identity", "desktop_worker.identity",
            "queen_server.identity -> desktop_worker.identity", id="sides-apart"),
        pytest.param(
            "worker-headless", "the headless worker imports no Qt and no queen library",
            "desktop_worker.service", "PySide6.QtCore",
            "desktop_worker.service -> PySide6", id="worker-headless"),
        pytest.param(
            "worker-no-llama", "the worker's own process never loads llama.cpp",
            "desktop_worker.engine.pool", "desktop_worker.engine.llama_model",
            "desktop_worker.engine.pool -> desktop_worker.engine.llama_model",
            id="worker-no-llama"),
        pytest.param(
            "acyclic", "no import cycles inside the queen or the worker",
            "desktop_worker.errors", "desktop_worker.store",
            ".errors -> .store", id="acyclic"),
    ],
)
def test_a_broken_contract_fails_the_run(
    tmp_path: Path, contract: str, name: str, module: str, forbidden: str, reported: str
) -> None:
    tree = copy_of_the_tree(tmp_path)
    source = tree / (module.replace(".", "/") + ".py")
    with source.open("a", encoding="utf-8") as handle:
        handle.write(f"\nimport {forbidden}  # noqa: E402, F401 (broken on purpose)\n")
    result = lint_imports(tree, contract)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert f"{name}" in output
    assert "BROKEN" in output
    assert reported in output, output  # this very import, in the copy, broke it


def module_cycles(graph: grimp.ImportGraph, package: str) -> list[list[str]]:
    """The strongly connected groups of more than one module inside ``package`` (Tarjan's
    algorithm, without recursion): each is at least one import cycle."""
    modules = sorted(m for m in graph.modules if m == package or m.startswith(package + "."))
    inside = set(modules)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def imported_by(module: str) -> Iterator[str]:
        return iter(sorted(graph.find_modules_directly_imported_by(module) & inside))

    for start in modules:
        if start in index:
            continue
        work = [(start, imported_by(start))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            module, pending = work[-1]
            step = next(pending, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, imported_by(step)))
                elif step in on_stack:
                    low[module] = min(low[module], index[step])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[module])
            if low[module] == index[module]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == module:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))
    return groups


def test_module_cycles_finds_a_package_caught_with_its_own_module() -> None:
    graph = grimp.ImportGraph()
    for module in ("pkg", "pkg.a", "pkg.b", "pkg.c"):
        graph.add_module(module)
    graph.add_import(importer="pkg", imported="pkg.a")
    graph.add_import(importer="pkg.a", imported="pkg.b")
    graph.add_import(importer="pkg.b", imported="pkg")  # pkg -> a -> b -> pkg
    graph.add_import(importer="pkg.c", imported="pkg.a")  # no cycle
    assert module_cycles(graph, "pkg") == [["pkg", "pkg.a", "pkg.b"]]


@pytest.mark.parametrize("package", ["queen_server", "desktop_worker"])
def test_no_module_is_in_an_import_cycle(package: str) -> None:
    graph = grimp.build_graph(package, cache_dir=None)
    assert module_cycles(graph, package) == []
