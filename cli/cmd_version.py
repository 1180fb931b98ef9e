"""`ggrun version`: print the installed version, and the build ggrun reports (its version and, run from a
git checkout of ggrun itself, that checkout's commit)."""
from __future__ import annotations

import functools
import subprocess
from importlib.metadata import PackageNotFoundError, version as dist_version
from pathlib import Path

import typer

from ggrun.cli.app import app


def ggrun_version() -> str:
    """The distribution version, or 'dev' when running from a source tree that is not installed."""
    try:
        return dist_version("ggrun")
    except PackageNotFoundError:
        return "dev"


@functools.cache
def build_commit() -> str:
    """llama-bench's build_commit for ggrun: the short commit of the git checkout ggrun runs from, or its
    version where ggrun is not run from its own checkout."""
    return checkout_commit(Path(__file__).resolve().parents[1]) or ggrun_version()


def checkout_commit(root: Path) -> str | None:
    """The short commit of `root` when it is the top of a git checkout of ggrun, else None: ggrun
    installed into site-packages, even inside somebody else's git repository, has no commit of its own."""
    if not _is_ggrun_checkout(root):
        return None
    try:
        top = _git(root, "rev-parse", "--show-toplevel")
        commit = _git(root, "rev-parse", "--short", "HEAD")
    except (OSError, subprocess.SubprocessError):
        return None
    if not commit or not top or Path(top).resolve() != root.resolve():
        return None
    return commit


def _is_ggrun_checkout(root: Path) -> bool:
    """Whether `root` (the folder above cli/) is ggrun's source tree: its pyproject names ggrun."""
    try:
        text = (root / "pyproject.toml").read_text(encoding="utf-8")
    except OSError:
        return False
    return 'name = "ggrun"' in text


def _git(root: Path, *args: str) -> str:
    """One git command's output in `root`, stripped; empty when git fails there."""
    out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=5)
    return out.stdout.strip() if out.returncode == 0 else ""


@app.command("version")
def version_command() -> None:
    """Print ggrun's version."""
    typer.echo(ggrun_version())
