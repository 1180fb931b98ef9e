#!/usr/bin/env bash
# Install the extra ggrun[cluster] (ray[serve], about 370 MB) into .venv for `ggrun serve --replicas` and its
# test (tests/cli/serve/test_cluster.py, which skips without it); scripts/test.sh runs it.
# Kept out of scripts/setup.sh so that a plain set-up does not download Ray.
set -euo pipefail
cd "$(dirname "$0")/../.."
say() { echo "setup_cluster: $*" >&2; }
if .venv/bin/python -c 'import ray.serve' >/dev/null 2>&1; then
    exit 0
fi
say "installing ggrun[cluster] (ray[serve]) into .venv for ggrun serve --replicas and its test"
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[cluster]"
