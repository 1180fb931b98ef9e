"""`ggrun version`: print the installed version."""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version as dist_version

import typer

from ggrun.cli.app import app


def ggrun_version() -> str:
    """The distribution version, or 'dev' when running from a source tree that is not installed."""
    try:
        return dist_version("ggrun")
    except PackageNotFoundError:
        return "dev"


@app.command("version")
def version_command() -> None:
    """Print ggrun's version."""
    typer.echo(ggrun_version())
