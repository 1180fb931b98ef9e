"""The build ggrun reports (bench's `build:` and build_commit): its own checkout's commit, never that of a
git repository it merely lies inside."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from ggrun.cli.cmd_version import build_commit, checkout_commit, ggrun_version

ROOT = Path(__file__).resolve().parents[2]


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, text=True, check=True).stdout.strip()


def _init_repo(path: Path) -> str:
    """A git repository at path with one commit of whatever it holds; returns that commit."""
    _git(path, "init", "-q")
    _git(path, "add", "-A")
    _git(path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "x")
    return _git(path, "rev-parse", "--short", "HEAD")


needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


@needs_git
def test_a_checkout_of_ggrun_reports_its_commit(tmp_path):
    src = tmp_path / "ggrun"
    src.mkdir()
    shutil.copy(ROOT / "pyproject.toml", src / "pyproject.toml")
    assert checkout_commit(src) is None  # not a git checkout yet
    commit = _init_repo(src)
    assert checkout_commit(src) == commit


@needs_git
def test_ggrun_inside_another_repository_reports_no_commit(tmp_path):
    (tmp_path / "README").write_text("somebody's project\n")
    site = tmp_path / "venv" / "site-packages" / "ggrun"
    site.mkdir(parents=True)
    shutil.copy(ROOT / "pyproject.toml", site / "pyproject.toml")
    _init_repo(tmp_path)
    assert checkout_commit(site) is None


@needs_git
def test_a_foreign_checkout_is_not_ggrun(tmp_path):
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "other"\n')
    _init_repo(tmp_path)
    assert checkout_commit(tmp_path) is None


def test_build_commit_is_the_commit_or_the_version():
    expected = checkout_commit(ROOT) or ggrun_version()
    assert build_commit() == expected
