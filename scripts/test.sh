#!/usr/bin/env bash
# Set up (scripts/setup.sh), fetch SmolLM2 and gemma-3-270m into the cache, and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ggrun models pull smollm2
.venv/bin/ggrun models pull gemma3-270m
exec .venv/bin/python -m pytest "$@"
