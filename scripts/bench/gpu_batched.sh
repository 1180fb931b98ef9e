#!/bin/bash
# Issue 31's GPU figures and checks in one command, on one GPU (CUDA_VISIBLE_DEVICES=0: with several GPUs
# visible, ggrun and llama.cpp both split the layers over all of them), for a GPU machine:
#   1. the CUDA tests of many sequences and of the sampler, the KQ mask made from the cells included
#      (tests/core/test_cuda_batched.py: its kernel against the reference, a session with it against one with
#      host-filled masks), and the CPU-side tests of those masks;
#   2. ggrun bench --batched against llama-batched-bench (-npp 128 -ntg 128 -npl 1,16,64,128), once with
#      host-filled masks (GGRUN_MASK_FROM_CELLS=0) and once with masks made from the cells (the default);
#   3. ggrun parallel -np 64 -ns 256 -n 128: how many sequences finished (all 256 should), then its generated t/s
#      against bench --batched's S_TG at B = 64, alternating (bench_parallel.py --batched: issue 31's 0.8x);
#   4. bench_serve.py at concurrency 1, 16 and 64 against llama-server (issue 34's GPU bench: serve_gpu.sh).
# Logs go to OUT (default /tmp/gpu_batched).
#
# Usage: bash scripts/bench/gpu_batched.sh MODEL.gguf LLAMA_BIN_DIR [OUT]
#   (a synthetic llama-1b Q4_0: python3 -m ggrun.loaders.synthetic /tmp/synth/llama-1b-q4_0.gguf llama-1b q4_0;
#    LLAMA_BIN_DIR: cuda_anchor.sh's build/bin)
set -o pipefail
M=${1:?model}; LLB=${2:?llama.cpp bin dir}; OUT=${3:-/tmp/gpu_batched}
mkdir -p "$OUT"
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} PYTHONUNBUFFERED=1
T0=$(date +%s); t() { echo "[t=$(( $(date +%s) - T0 ))s] $*"; }
G=(python3 -c "from ggrun.cli.app import main; main()")

t "tests"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/core/test_cuda_batched.py tests/core/test_cuda_sample.py \
  tests/llm/test_inputs.py 2>&1 | tee "$OUT/tests.log" | grep -E "passed|failed|Error|assert" | tail -12
for mask in 0 1; do
  t "bench --batched against llama-batched-bench, GGRUN_MASK_FROM_CELLS=$mask"
  GGRUN_MASK_FROM_CELLS=$mask timeout 150 python3 scripts/bench/bench_batched.py -m "$M" -ngl 99 -npp 128 -ntg 128 \
    -npl 1,16,64,128 --rounds 1 --llama-bin "$LLB" --target 1.5 2>&1 | tee "$OUT/bench_batched_mask$mask.log"
done
t "parallel -np 64 -ns 256 -n 128"
timeout 90 "${G[@]}" parallel -m "$M" -ngl 99 -np 64 -ns 256 -n 128 -c 32768 >"$OUT/parallel.out" 2>"$OUT/parallel.err"
echo "sequences finished: $(grep -c '^Client' "$OUT/parallel.out") of 256, skipped: $(grep -c skipped "$OUT/parallel.out")"
tail -5 "$OUT/parallel.out"; tail -2 "$OUT/parallel.err"
timeout 240 python3 scripts/bench/bench_parallel.py --batched -m "$M" -ngl 99 -np 64 -ns 256 -n 128 -c 32768 \
  --rounds 3 2>&1 | tee "$OUT/parallel_vs_batched.log" | tail -2
bash scripts/bench/serve_gpu.sh "$M" "$LLB" "$OUT/serve"
t end
