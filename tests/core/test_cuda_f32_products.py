"""A prompt's product of an F32 weight on the GPU is f32's, as ggml's CPU and CUDA backends compute it (cuBLAS over
f16 operands parted the tiny F32 family models' greedy tokens from the CPU's). Skipped where cupy or a GPU is
missing."""
from __future__ import annotations

import numpy as np
import pytest

from tests.core.gpu import device_indices, require_gpu

require_gpu()

from ggrun.core import ops  # noqa: E402
from ggrun.core.backends.cuda import CUDABackend, matmul  # noqa: E402
from ggrun.core.backends.op_harness import planned  # noqa: E402
from ggrun.core.dtypes import DType  # noqa: E402


@pytest.mark.parametrize("device", device_indices())
def test_prompt_products_of_f32_weights_are_f32(device):
    """An F32 weight at 128 token rows (past mmqt's, so cuBLAS runs it: _gemm) meets the f32 activations as they
    are: its product is the f32 one up to summation order, far closer than one of f16 operands (or TF32's, whose
    rounding is f16's)."""
    n, m, k = 128, 96, 512
    assert n > matmul.MMQT_MAX_ROWS
    rng = np.random.default_rng(2)
    w, x = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((n, k)).astype(np.float32)

    def build(lf):
        return ops.mul_mat(lf.weight("w", DType.F32, (m, k), w), lf.input("x", DType.F32, x))
    sched, sg, leafs, out = planned(CUDABackend(device), build)
    for t, v in leafs.feeds.items():
        sched.set_tensor(t, v)
    sched.compute(sg)
    got = sched.get_tensor(out)
    want = x.astype(np.float64) @ w.T.astype(np.float64)
    halves = x.astype(np.float16).astype(np.float64) @ w.astype(np.float16).T.astype(np.float64)
    err, err_f16 = np.abs(got - want).max(), np.abs(halves - want).max()
    assert err < err_f16 / 20, (err, err_f16)
