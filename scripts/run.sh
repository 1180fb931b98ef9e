#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job: SmolLM2 writes text, with timings.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/ggrun run -p "${1:-The three most useful things to know about the ocean are}" -n 128 --temp 0
