"""The `ggrun` Typer app: registers the subcommands and maps ggrun's errors to exit codes.

No model logic lives here; commands parse options, call the runtime and render results.
"""
from __future__ import annotations

import sys

import typer

from core.errors import GGRunError

app = typer.Typer(
    name="ggrun",
    help="Run GGUF language models on a memory-planned compute graph (numpy CPU, cupy GPU).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _register_commands() -> None:
    """Import the command modules; each one adds its command(s) to `app`."""
    import importlib
    import pkgutil

    import cli

    for info in pkgutil.iter_modules(cli.__path__):
        if info.name.startswith("cmd_"):
            importlib.import_module(f"cli.{info.name}")


@app.callback()
def _root() -> None:
    """Run GGUF language models on a memory-planned compute graph (numpy CPU, cupy GPU)."""


def main() -> None:
    """Console entry point: one clear line and exit 2 for bad input, 1 for runtime failures.

    Typer handles usage errors itself (exit 2); ggrun's own errors surface here.
    """
    _register_commands()
    try:
        app()
    except GGRunError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
