"""A prompt's products on the GPU meet the activations as ggml's CPU does: a prompt's k-quant experts read int8s of
the CPU's q8_K rounding (matmul.cu's mt_quantize_k; equal, bit for bit, to the CPU backend's round_rows on rows with
zeros, ties of magnitude and values of either sign), and an F32 weight's product is f32's, not f16's. Skipped
where cupy or a GPU is missing."""
from __future__ import annotations

import numpy as np
import pytest

from tests.core.gpu import device_indices, require_gpu

cupy = require_gpu()

from ggrun.core import ops  # noqa: E402
from ggrun.core.backends.cpu.quant.activations import round_rows  # noqa: E402
from ggrun.core.backends.cpu.quant.codes import ACT_Q8_K, act_arrays, act_arrays_bytes  # noqa: E402
from ggrun.core.backends.cuda import CUDABackend, matmul  # noqa: E402
from ggrun.core.backends.cuda.module import kernel  # noqa: E402
from ggrun.core.backends.op_harness import planned  # noqa: E402
from ggrun.core.dtypes import DType  # noqa: E402

def rows(n: int, k: int) -> np.ndarray:
    """Activation rows with the cases the rounding must keep: a zero block, a block whose largest magnitude is
    negative and one where it ties between a positive and a negative value (the first is the CPU's max)."""
    x = np.random.default_rng(3).standard_normal((n, k)).astype(np.float32)
    x[0, :256] = 0.0
    x[1, :256] *= 0.01
    x[1, 7] = -3.0
    x[2, :256] *= 0.01
    x[2, 5], x[2, 200] = 2.5, -2.5
    x[3] *= 1e-3
    return x


def cpu_q8_k(x: np.ndarray) -> np.ndarray:
    """x's rows as the CPU's q8_K blocks hold them (each int8 times its block's scale)."""
    n, k = x.shape
    qs, d, s, sums = act_arrays(np.zeros(act_arrays_bytes(n, k), np.uint8), n, k)
    out = np.zeros_like(x)
    round_rows(ACT_Q8_K, x, qs, d, s, sums, out)
    return out


@pytest.mark.parametrize("device", device_indices())
def test_expert_activations_quantized_as_the_cpus_q8_k(device):
    """mt_quantize_k (the int8 activations of a prompt's k-quant experts, mmq_idt): each value's int8 times its
    block's scale is, bit for bit, the CPU's q8_K rounding of it; the scale pairs (d, d times the int8s' sum) of
    each 32 hold that scale and that sum."""
    n, k, ldx = 5, 1024, 1040
    x = rows(n, k)
    with cupy.cuda.Device(device):
        wide = cupy.zeros((n, ldx), cupy.float32)
        wide[:, :k] = cupy.asarray(x)
        q = cupy.zeros((n, k), cupy.int8)
        sq = cupy.zeros((n, k // 32, 2), cupy.float32)
        kernel("matmul.cu", "mt_quantize_k")((-(-(n * k // 256) // 8),), (256,),
                                             (wide, q, np.uint64(0), sq, np.int32(k), np.int64(ldx), np.int32(n)))
        q, sq = cupy.asnumpy(q).astype(np.float32), cupy.asnumpy(sq)
    d = np.repeat(sq[:, :, 0], 32, axis=1)
    np.testing.assert_array_equal((q * d).view(np.uint32), cpu_q8_k(x).view(np.uint32))
    np.testing.assert_array_equal(sq[:, :, 1], sq[:, :, 0] * q.reshape(n, k // 32, 32).sum(axis=2, dtype=np.float32))
    assert not q[0, :256].any()


@pytest.mark.parametrize("device", device_indices())
def test_prompt_products_of_f32_weights_are_f32(device):
    """An F32 weight at 128 token rows (cuBLAS) meets the f32 activations as they are, as the CPU's product does
    (and ggml's CUDA backend): its product is the f32 one up to summation order, far closer than one of f16
    operands (or TF32's, whose rounding is f16's)."""
    n, m, k = 128, 96, 512
    rng = np.random.default_rng(2)
    w, x = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((n, k)).astype(np.float32)
    got = gpu_product(device, DType.F32, w, x)
    want = x.astype(np.float64) @ w.T.astype(np.float64)
    halves = x.astype(np.float16).astype(np.float64) @ w.astype(np.float16).T.astype(np.float64)
    err, err_f16 = np.abs(got - want).max(), np.abs(halves - want).max()
    assert err < err_f16 / 20, (err, err_f16)


def gpu_product(device: int, dtype: DType, data: np.ndarray, x: np.ndarray) -> np.ndarray:
    """mul_mat of a weight stored as `data` and the rows x, on the GPU; past mmqt's rows, so cuBLAS runs it
    (_gemm)."""
    n, k = x.shape
    assert n > matmul.MMQT_MAX_ROWS

    def build(lf):
        return ops.mul_mat(lf.weight("w", dtype, (data.shape[0], k), data), lf.input("x", DType.F32, x))
    sched, sg, leafs, out = planned(CUDABackend(device), build)
    for t, v in leafs.feeds.items():
        sched.set_tensor(t, v)
    sched.compute(sg)
    return sched.get_tensor(out)
