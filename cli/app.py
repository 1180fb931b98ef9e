"""The `ggrun` Typer app: registers the subcommands and maps ggrun's errors to exit codes.

No model logic lives here; commands parse options, call the runtime and render results.
"""
from __future__ import annotations

import gc
import os
import sys

# OpenBLAS's idle threads spin after each product, holding the cores the compiled kernels' threads need;
# with this they sleep at once. OpenBLAS reads it when numpy loads it, which the commands' imports do, so
# it is set first; a user's own setting wins (core/backends/cpu/threads.py says why waiting threads sleep).
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

import typer  # noqa: E402

from ggrun.cli import library_patches  # noqa: E402
from ggrun.core.errors import GGRunError, Interrupted, one_line  # noqa: E402

app = typer.Typer(
    name="ggrun",
    help="Run GGUF language models on a memory-planned compute graph (numpy CPU, cupy GPU).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _register_commands(argv: list[str] | None = None) -> None:
    """Import the command modules; each one, `cmd_<name>.py`, adds the command `<name>` to `app`.

    Given the command line (`argv`) that names a command, only its module is imported: a run does not
    pay for the imports of every other command. Help, no command or an unknown one imports them all."""
    import importlib
    import pkgutil

    from ggrun import cli

    names = [info.name for info in pkgutil.iter_modules(cli.__path__) if info.name.startswith("cmd_")]
    words = [a for a in argv or () if not a.startswith("-")]
    wanted = f"cmd_{words[0]}" if words else None
    for name in [wanted] if wanted in names else names:
        importlib.import_module(f"ggrun.cli.{name}")


@app.callback()
def _root() -> None:
    """Run GGUF language models on a memory-planned compute graph (numpy CPU, cupy GPU)."""


def main() -> None:
    """Console entry point: one clear line and exit 2 for bad input (ggrun's own checks and
    malformed options alike), 1 for runtime failures; never a traceback for either. Ctrl-C is
    `interrupted` and exit 130: a command that armed cli.interrupt has shown what it had first."""
    library_patches.apply()  # before the commands import the engine
    _fewer_collections()
    _register_commands(sys.argv[1:])
    if not gc.get_freeze_count():  # once per process (tests call main() again and again)
        gc.freeze()  # what the imports made lives as long as the process: later collections skip it
    try:
        code = app(standalone_mode=False)
    except Interrupted:
        _interrupted()
    except GGRunError as err:
        print(f"error: {one_line(str(err))}", file=sys.stderr)
        sys.exit(err.exit_code)
    except Exception as err:
        if not _is_usage_error(err):
            raise
        if type(err).__name__ == "NoArgsIsHelpError":
            err.show()  # no arguments at all: the help, as Typer prints it
        else:
            print(f"error: {err.format_message()} (see --help)", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        _interrupted()
    if code == 130:  # Typer's answer to a KeyboardInterrupt outside an armed Interrupt (loading, say)
        _interrupted()
    sys.exit(code if isinstance(code, int) else 0)


def _fewer_collections() -> None:
    """Python's cycle collector runs every 700 allocations and, every hundredth time, walks every object
    there is; numba and the kernel modules make hundreds of thousands, which start-up (imports, graphs
    built and planned) then walks again and again: a fifth of ggrun's time to its first token. ggrun's
    objects are long-lived and rarely cyclic, so the collector runs 14 times less often."""
    gc.set_threshold(10_000, 10, 10)


def _interrupted() -> None:
    sys.stdout.flush()
    print("interrupted", file=sys.stderr)
    sys.exit(130)


def _is_usage_error(err: Exception) -> bool:
    """Click's bad-option errors (Typer vendors click, so match by shape, not by class)."""
    return hasattr(err, "format_message") and getattr(err, "exit_code", None) == 2


if __name__ == "__main__":  # python -m ggrun.cli.app: the commands register on the imported module's app
    from ggrun.cli.app import main as _main

    _main()
