"""How CLI tests run ggrun: in this process through the console entry point (exit code, stdout,
stderr), or as a real process of its own."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ENTRY = [sys.executable, "-c", "from ggrun.cli.app import main; main()"]


def ggrun(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, *args) -> tuple[int, str, str]:
    """Run `ggrun ARGS` in this process; (exit code, stdout, stderr)."""
    from ggrun.cli.app import main

    monkeypatch.setattr(sys, "argv", ["ggrun", *map(str, args)])
    code = 0
    try:
        main()
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    out, err = capsys.readouterr()
    return code, out, err


def ggrun_process(*args, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run `ggrun ARGS` as its own process through the same entry point as the console script."""
    full_env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([*ENTRY, *map(str, args)], capture_output=True, text=True, cwd=REPO, env=full_env,
                          timeout=timeout)
