#!/usr/bin/env bash
# Create .venv (once) and install ggrun with its test and serve extras into it, saying what each step does.
# $PYTHON picks the interpreter that makes the venv (default: python3); ggrun needs Python 3.11 or newer.
# The install is redone only when pyproject.toml changed since the last one (a stamp in .venv says which).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
say() { echo "setup: $*" >&2; }

if [ ! -x .venv/bin/python ]; then
    if ! command -v "$PY" >/dev/null 2>&1; then
        say "no '$PY' on this machine: install Python 3.11 or newer, or name one with PYTHON=/path/to/python3.12"
        exit 2
    fi
    if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
        say "$PY is Python $("$PY" -c 'import platform; print(platform.python_version())'); ggrun needs 3.11 or newer (choose one with PYTHON=/path/to/python3.12)"
        exit 2
    fi
    say "creating .venv with $("$PY" -c 'import platform, sys; print(sys.executable, platform.python_version())')"
    "$PY" -m venv .venv
fi

stamp=.venv/.ggrun-installed
want=$(cksum < pyproject.toml)
if [ ! -x .venv/bin/ggrun ] || [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    say "updating pip in .venv"
    .venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip >/dev/null 2>&1 || true
    say "installing ggrun and its dependencies (numpy, numba, gguf, typer, rich, jinja2, pytest; fastapi, uvicorn, llguidance and openai for ggrun serve) into .venv: about a minute the first time"
    .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test,serve]"
    echo "$want" > "$stamp"
fi
say "ready: .venv/bin/ggrun ($(.venv/bin/python -c 'import platform; print("Python", platform.python_version())'))"
