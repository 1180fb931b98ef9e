"""`ggrun models`: list the models known by name, and `ggrun models pull NAME` to download one.

Rendering only: the registry, cache and download live in loaders.download.
"""
from __future__ import annotations

import typer
from rich.console import Console
from rich.table import Table

from ggrun.cli.app import app
from ggrun.loaders import download
from ggrun.loaders.download import KNOWN_MODELS, is_cached, pull

models_app = typer.Typer(help="List the models ggrun knows by name, or download one.", no_args_is_help=False)
app.add_typer(models_app, name="models")


@models_app.callback(invoke_without_command=True)
def models_list(ctx: typer.Context) -> None:
    """List the known models (use a name with -m NAME): file, size and whether it is downloaded."""
    if ctx.invoked_subcommand is not None:
        return
    table = Table("name", "file", "size", "cached", "description")
    for model in KNOWN_MODELS.values():
        name = f"{model.name} (default)" if model.name == download.DEFAULT_MODEL else model.name
        cached = "yes" if is_cached(model) else "no"
        table.add_row(name, model.file, f"{model.size / 1e6:.0f} MB", cached, model.description)
    Console().print(table)


@models_app.command("pull")
def models_pull(
    name: str = typer.Argument(..., help=f"Model name: {', '.join(KNOWN_MODELS)}."),
    force: bool = typer.Option(False, "--force", help="Download again even if the model is cached."),
) -> None:
    """Download a known model into the cache (checked by sha256) and print its path."""
    typer.echo(pull(name, force=force))
