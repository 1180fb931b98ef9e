"""The `ggrun` entry point (cli.app): a command line that names a command imports only that command's module."""
from __future__ import annotations

import subprocess
import sys


def imported_commands(argv: list[str]) -> list[str]:
    code = ("import sys; from ggrun.cli.app import _register_commands; "
            f"_register_commands({argv!r}); "
            "print(sorted(m for m in sys.modules if m.startswith('ggrun.cli.cmd_')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return eval(out)


def test_a_named_command_imports_only_its_module():
    assert imported_commands(["version"]) == ["ggrun.cli.cmd_version"]
    assert imported_commands(["models", "pull", "-h"]) == ["ggrun.cli.cmd_models"]


def test_help_and_unknown_commands_import_every_command():
    every = imported_commands([])
    assert "ggrun.cli.cmd_run" in every and "ggrun.cli.cmd_version" in every
    assert imported_commands(["--help"]) == every == imported_commands(["no-such-command"])


def run_python(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def test_start_up_collects_garbage_less_often_and_freezes_what_imports_made():
    code = ("import atexit, gc, sys; sys.argv = ['ggrun', 'version']; from ggrun.cli.app import main; "
            "atexit.register(lambda: print(gc.get_threshold()[0], gc.get_freeze_count() > 1000)); main()")
    assert run_python(code).splitlines()[-1] == "10000 True"


def test_the_shared_cli_helpers_import_rich_only_when_printing():
    code = ("import sys; from ggrun.cli.common import err_console; a = 'rich' in sys.modules; "
            "err_console.print('x', end=''); print(a, 'rich' in sys.modules)")
    assert run_python(code) == "False True"
