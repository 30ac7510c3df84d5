"""The documentation site (mkdocs.yml, docs/) and the README that leads to it: every page the nav
names exists and every page is in the nav, the README is a landing page whose links reach those
pages and that keeps the two quick-start commands, every ``APIARY_`` setting of the queen and the
worker is documented on some page, and ``mkdocs build --strict`` passes (``dev.py test`` builds
it too, before pytest)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from desktop_worker.settings import WorkerSettings
from queen_server.settings import QueenSettings

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
QUICK_START = (
    "python3 dev.py run     # set up .venv and start the local swarm\n"
    "python3 dev.py test    # set up .venv, then run ruff, the import contracts and all the tests\n"
)
# A markdown link or image: [text](target) or ![alt](target).
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
# Settings that are the app's own bookkeeping, or another spelling of a documented one.
UNDOCUMENTED = {
    "first_run_done",  # the app sets it once its first-run wizard succeeded
    "queen_urls",  # every URL of APIARY_QUEEN_URL (comma-separated), parsed
}


def mkdocs_config() -> dict:
    return yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))


def nav_pages(nav: list) -> Iterator[str]:
    """Every page the nav names, depth first."""
    for entry in nav:
        items = entry.values() if isinstance(entry, dict) else [entry]
        for item in items:
            if isinstance(item, list):
                yield from nav_pages(item)
            else:
                yield item


def test_the_site_is_built_from_docs_with_the_material_theme():
    config = mkdocs_config()
    assert config["docs_dir"] == "docs"
    assert config["theme"]["name"] == "material"
    sections = [next(iter(entry)) for entry in config["nav"]]
    assert sections == ["Home", "Hobbyists", "Developers", "Operators", "Contributors"]


def test_every_page_in_the_nav_exists_and_every_page_is_in_the_nav():
    pages = list(nav_pages(mkdocs_config()["nav"]))
    assert len(pages) == len(set(pages)), "a page is in the nav twice"
    missing = [page for page in pages if not (DOCS / page).is_file()]
    assert not missing, f"the nav names pages that do not exist: {missing}"
    on_disk = {path.relative_to(DOCS).as_posix() for path in DOCS.rglob("*.md")}
    assert on_disk - set(pages) == set(), "pages in docs/ that the nav leaves out"
    assert "ARCHITECTURE.md" in pages  # the contributors' section, at its old path


def test_the_readme_is_a_landing_page_that_links_to_every_page_of_the_site():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 150, "the README is a landing page: the rest is in docs/"
    assert f"```bash\n{QUICK_START}```" in text  # the two quick-start commands, as they were
    targets = [target for target in LINK.findall(text) if "://" not in target]
    broken = [target for target in targets
              if target != "../../releases"  # GitHub's releases page, beside the repository
              and not (ROOT / target.split("#")[0]).exists()]
    assert not broken, f"the README links to files that do not exist: {broken}"
    linked = {target.split("#")[0] for target in targets}
    unlinked = [page for page in nav_pages(mkdocs_config()["nav"])
                if f"docs/{page}" not in linked]
    assert not unlinked, f"pages of the site the README does not link to: {unlinked}"


@pytest.mark.parametrize("settings", [QueenSettings, WorkerSettings],
                         ids=["queen", "worker"])
def test_every_setting_is_documented(settings):
    text = "\n".join(path.read_text(encoding="utf-8") for path in DOCS.rglob("*.md"))
    missing = [f"APIARY_{name.upper()}" for name in settings.model_fields
               if name not in UNDOCUMENTED and f"APIARY_{name.upper()}" not in text]
    assert not missing, f"settings no page of docs/ mentions: {missing}"


@pytest.mark.timeout(120)
def test_mkdocs_builds_the_site_strict(tmp_path: Path):
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, capture_output=True, text=True)
    assert built.returncode == 0, built.stdout + built.stderr
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "ARCHITECTURE" / "index.html").is_file()
