#!/usr/bin/env bash
# Set up (scripts/setup.sh), fetch the default model into the cache, and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ggrun models pull smollm2
exec .venv/bin/python -m pytest "$@"
