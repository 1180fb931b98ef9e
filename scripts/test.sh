#!/usr/bin/env bash
# Set up (scripts/setup.sh; on CI also chromium for the chat page's test, scripts/setup/setup_browser.sh, and
# always Ray Serve for the replicas' test, scripts/setup/setup_cluster.sh), fetch SmolLM2 and gemma-3-270m into the cache, and run the test suite;
# then the CPU kernel tests again under each instruction-set level below this CPU's best
# (GGRUN_CPU_ISA=avx2, =generic: core/backends/cpu/isa.py), each compiled for its level. A level the
# CPU lacks is not run; with GGRUN_CPU_ISA set, only the suite at that level runs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
[ -n "${CI:-}" ] && bash scripts/setup/setup_browser.sh
bash scripts/setup/setup_cluster.sh
.venv/bin/ggrun models pull smollm2
.venv/bin/ggrun models pull gemma3-270m
.venv/bin/python -m pytest "$@"
[ -n "${GGRUN_CPU_ISA:-}" ] && exit 0
KERNEL_TESTS=(tests/core/test_backend_ops.py tests/core/test_cpu_ops.py tests/core/test_cpu_matmul.py
              tests/core/test_mul_mat_glu.py tests/core/test_mul_mat_multi.py tests/core/test_kv_quant.py
              tests/core/test_argmax.py tests/core/test_moe_ops.py)
for level in $(.venv/bin/python -c "from ggrun.core.backends.cpu import isa; print(*isa.LEVELS[:isa.LEVELS.index(isa.LEVEL)])"); do
    echo "test.sh: the CPU kernel tests under GGRUN_CPU_ISA=$level"
    GGRUN_CPU_ISA=$level .venv/bin/python -m pytest -x "${KERNEL_TESTS[@]}"
done
