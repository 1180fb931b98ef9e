#!/usr/bin/env bash
# Install ggrun as a user would and check it: a fresh clone of this repository (its last commit),
# `pip install .` (not editable) into a clean venv, then
#   - the top-level import names the installed distribution adds (only `ggrun` may appear),
#   - `ggrun run` from another folder (the model comes from ~/.cache/ggrun/models, downloaded if missing;
#     the kernels compile into a temporary cache, so this takes a few minutes).
# Everything it makes lives in a temporary folder that is removed at the end. $PYTHON picks the interpreter.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
PY=${PYTHON:-python3}
work=$(mktemp -d "${TMPDIR:-/tmp}/ggrun-check-install.XXXXXX")
trap 'rm -rf "$work"' EXIT
say() { echo "check_install: $*" >&2; }

say "cloning $root into $work/clone"
git clone -q "$root" "$work/clone"
say "creating a clean venv with $("$PY" -c 'import platform, sys; print(sys.executable, platform.python_version())')"
"$PY" -m venv "$work/venv"
say "pip install . (not editable)"
"$work/venv/bin/python" -m pip install -q --disable-pip-version-check "$work/clone"

cd "$work"  # from here on, nothing of the source tree is on the path (its ggrun.egg-info included)
say "top-level import names installed by the ggrun distribution:"
"$work/venv/bin/python" - <<'PY'
import importlib.metadata as md

import ggrun.cli.app

dist = md.distribution("ggrun")
names = sorted({f.parts[0] for f in dist.files if f.suffix == ".py" and not f.parts[0].endswith(".dist-info")})
print("  files:", names)
print("  top_level.txt:", (dist.read_text("top_level.txt") or "").split())
print("  ggrun imports from:", list(ggrun.__path__))
if names != ["ggrun"]:
    raise SystemExit("check_install: FAILED: names other than ggrun are installed")
PY

say "ggrun run from $work (another folder), kernels compiled into a temporary cache"
mkdir -p "$work/cache"
cache=${GGRUN_CACHE:-$HOME/.cache/ggrun}
if [ -d "$cache/models" ]; then ln -s "$cache/models" "$work/cache/models"; fi
GGRUN_CACHE="$work/cache" "$work/venv/bin/ggrun" run -no-cnv -p "The capital of France is" -n 8 --temp 0
say "OK: only ggrun is installed, and ggrun run works outside the source tree"
