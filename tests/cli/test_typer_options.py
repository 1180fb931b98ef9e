"""Options of plain types skip typer's pydantic adapters (cli/library_patches/typer_options.py): the same settings and the
same error messages as typer's own way, and a run's options parse without importing pydantic."""
from __future__ import annotations

import subprocess
import sys

import pytest
import typer.core

from ggrun.cli.cmdline import parse_settings
from ggrun.cli.run_settings import run_settings

LINES = [
    ["-m", "m.gguf", "-p", "The capital of France is", "-n", "16", "--temp", "0"],
    ["-n", "-2", "-c", "0", "-t", "2", "-tb", "1", "--top-p", "1e-2", "--min-p", ".05", "--repeat-penalty", "1.1"],
    ["-r", "User:", "-r", "\\n", "-ctk", "q8_0", "-ctv", "f16", "-fa", "off", "-ngl", "all", "-cnv", "-sys", "hi"],
    ["-n", "3.0", "--temp", "inf", "-s", "+7", "-no-cnv", "--ignore-eos"],  # values left to typer's adapter
]
BAD = [["-n", "x"], ["--temp", "warm"], ["-ctk", "q9"], ["-fa", "maybe"], ["-ngl", "many"]]


def typer_own(monkeypatch) -> None:
    monkeypatch.setattr(typer.core, "build_runtime_param", typer.core.build_runtime_param.typer_own)


@pytest.mark.parametrize("argv", LINES, ids=lambda a: " ".join(a[:4]))
def test_settings_are_typers_own(argv, monkeypatch):
    ours = parse_settings(run_settings, argv)
    typer_own(monkeypatch)
    assert ours == parse_settings(run_settings, argv)


@pytest.mark.parametrize("argv", BAD, ids=" ".join)
def test_bad_values_get_typers_message(argv, monkeypatch):
    with pytest.raises(Exception) as ours:
        parse_settings(run_settings, argv)
    typer_own(monkeypatch)
    with pytest.raises(Exception) as theirs:
        parse_settings(run_settings, argv)
    assert (type(ours.value), str(ours.value)) == (type(theirs.value), str(theirs.value))


def test_run_options_parse_without_pydantic():
    code = ("import sys; from ggrun.cli import library_patches; library_patches.apply();"
            "from ggrun.cli.cmdline import parse_settings; from ggrun.cli.run_settings import run_settings;"
            f"parse_settings(run_settings, {LINES[0] + LINES[2]!r}); print('pydantic' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
