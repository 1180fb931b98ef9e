#!/bin/bash
# Issue 34's GPU serving figures in one command, on one GPU: `ggrun serve` against llama-server on the same
# synthetic llama-1b Q4_0 (bench_serve.py), both with every layer on the GPU (-ngl 99), 64 slots, -c 32768
# (512 cells a slot: a chat prompt of the tiny tokenizer is at most ~140 tokens, plus 128 generated), streamed
# greedy chats of 128 tokens each (ignore_eos) from 1, 16 and 64 concurrent clients, two alternating rounds:
# generated t/s, time to first token p50 and p99, the HTTP layer's share, and the ratios ggrun / llama-server.
# Everything ends within ~200 s (the bench's own `timeout`; SIGTERM stops both servers); server logs go to OUT.
#
# The model (700 MB, ~10 s; written here if MODEL is missing):
#   python3 -m ggrun.loaders.synthetic /tmp/synth/llama-1b-q4_0-text.gguf llama-1b q4_0
# Its vocabulary is the tiny byte-level tokenizer padded to llama-1b's 128256 with text tokens (" w0", " w1", ...)
# so that what the random weights pick streams as text in both servers (a file written before that change,
# padded with control tokens, streams nothing: hence the new name); it has no chat template, so both servers
# take --chat-template chatml. (--tokenizer-from OTHER.gguf gives it a real tokenizer padded the same way.)
#
# Usage: bash scripts/bench/serve_gpu.sh MODEL.gguf LLAMA_BIN_DIR [OUT]
#   (LLAMA_BIN_DIR: llama.cpp's CUDA build/bin, with llama-server; OUT default /tmp/serve_gpu). The environment
#   may change the settings, e.g. the same run on a CPU: NGL=0 THREADS=1 LEVELS=1,8 NP=8 CTX=4096 N=32.
set -o pipefail
M=${1:?model}; LLB=${2:?llama.cpp bin dir}; OUT=${3:-/tmp/serve_gpu}
NGL=${NGL:-99} THREADS=${THREADS:-4} LEVELS=${LEVELS:-1,16,64} NP=${NP:-64} CTX=${CTX:-32768} N=${N:-128}
mkdir -p "$OUT" "$(dirname "$M")"
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} PYTHONUNBUFFERED=1
T0=$(date +%s); t() { echo "[t=$(( $(date +%s) - T0 ))s] $*"; }
[ -x "$LLB/llama-server" ] || { echo "no llama-server in $LLB"; exit 2; }
python3 -c "import httpx, fastapi, uvicorn" || { echo "bench_serve needs httpx, and ggrun serve fastapi and uvicorn"; exit 2; }
if [ ! -f "$M" ]; then
  t "writing $M"
  timeout 60 python3 -m ggrun.loaders.synthetic "$M" llama-1b q4_0 || exit 1
fi
t "bench_serve at $LEVELS"
timeout -k 20 190 python3 scripts/bench/bench_serve.py -m "$M" -ngl "$NGL" --levels "$LEVELS" -n "$N" -np "$NP" \
  -c "$CTX" -t "$THREADS" --rounds 2 --chat-template chatml --llama-bin "$LLB" --log-dir "$OUT" 2>&1 | tee "$OUT/bench_serve.log"
rc=$?
[ $rc = 0 ] || { echo "bench_serve: exit $rc; last server lines:"; tail -4 "$OUT"/bench_serve_*.log; }
t end
