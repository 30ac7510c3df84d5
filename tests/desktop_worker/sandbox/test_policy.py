"""What an engine child may read: folders on ``PYTHONPATH`` (a ``pip install --target`` site,
as on a GPU machine whose image lacks the packages) are read, so the child can import from them
after it has confined itself; the owner's home folder is never among them."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from desktop_worker.sandbox import landlock
from desktop_worker.sandbox.policy import policy_for, pythonpath_folders
from desktop_worker.sandbox.process import child_environment


def test_pythonpath_folders_are_read_but_never_the_home_folder(tmp_path: Path) -> None:
    home = tmp_path / "home"
    site = tmp_path / "site"
    inside = home / "projects" / "apiary"
    for folder in (site, inside):
        folder.mkdir(parents=True)
    entries = [str(site), "", str(home), str(tmp_path), str(tmp_path / "missing"), str(inside)]
    assert pythonpath_folders(":".join(entries), home) == [str(site), str(inside)]


@pytest.mark.skipif(not sys.platform.startswith("linux") or landlock.abi_version() <= 0,
                    reason="Landlock confines the child on Linux only")
@pytest.mark.timeout(60)
def test_a_confined_child_imports_from_pythonpath_only_when_the_policy_reads_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "late_module.py").write_text("ANSWER = 42\n")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    script = textwrap.dedent("""
        import sys
        from desktop_worker.sandbox.confine import confine
        from shared_schema.engine_ipc import SandboxPolicy
        confine(SandboxPolicy.model_validate_json(sys.argv[1]), "context")
        try:
            import late_module
            print("imported", late_module.ANSWER)
        except (ImportError, OSError) as exc:
            print("refused", type(exc).__name__)
    """)

    def run(with_site: bool) -> str:
        monkeypatch.setenv("PYTHONPATH", str(site) if with_site else "")
        policy = policy_for("context", scratch=str(scratch))
        env = child_environment(str(scratch))
        env["PYTHONPATH"] = str(site)  # the child's Python always has it on sys.path
        project = str(Path(__file__).parents[3])
        done = subprocess.run([sys.executable, "-c", f"import sys; sys.path.append({project!r})"
                               f"\nexec({script!r})", policy.model_dump_json()],
                              capture_output=True, text=True, timeout=60, cwd=scratch, env=env)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip().splitlines()[-1]

    assert run(with_site=True) == "imported 42"
    assert run(with_site=False).startswith("refused")
