"""The CUDA kernel of ops.argmax (greedy sampling) against the CPU's, exactly: rows of tricky values (ties,
-0 beside +0, NaN and infinities), one row as wide as a vocabulary (split over blocks, merged by the last)
and many rows (a block each), rows with a stride; the same plan run again, as a reused decode graph is.
Each case also checks that the CUDA kernel ran rather than the cupy fallback. Skipped where cupy or a
GPU is missing."""
from __future__ import annotations

import numpy as np
import pytest

from tests.core.gpu import device_indices, require_gpu

cupy = require_gpu()

from ggrun.core import ops  # noqa: E402
from ggrun.core.backends.cpu import CPUBackend  # noqa: E402
from ggrun.core.backends.cuda import CUDABackend  # noqa: E402
from ggrun.core.backends.op_harness import planned, run_on  # noqa: E402
from ggrun.core.dtypes import DType  # noqa: E402
from tests.core.test_argmax import ref_argmax, tricky_rows  # noqa: E402

F32 = DType.F32


@pytest.fixture(scope="module", params=device_indices(), ids=lambda i: f"CUDA{i}")
def gpu(request):
    """Every GPU of the machine in turn (its KV cache, uploads, graphs and fetches with its device current)."""
    return CUDABackend(request.param)


def check(gpu, x: np.ndarray, build=None) -> np.ndarray:
    """The GPU's argmax of x (or of what build makes of it), which must equal the CPU's from a CUDA kernel."""
    build = build or (lambda lf: ops.argmax(lf.input("logits", F32, x)))
    got = run_on(gpu, build)
    np.testing.assert_array_equal(got, run_on(CPUBackend(), build))
    _, sg, _, _ = planned(gpu, build)
    steps = gpu.prepare(sg.splits[0].nodes).steps
    assert all(s.capturable for s in steps), "fell back to cupy array kernels"
    return got


@pytest.mark.parametrize("shape", [(1, 1), (1, 7), (1, 1023), (1, 1025), (3, 33), (12, 5000), (1, 131_073),
                                   (2, 262_144), (300, 257)])
def test_argmax_of_tricky_rows(gpu, shape):
    x = tricky_rows(np.random.default_rng(shape[0] + shape[1]), *shape)
    np.testing.assert_array_equal(check(gpu, x), ref_argmax(x))


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", [0, 70_000, 128_255])
def test_one_non_finite_value_in_a_vocabulary_row(gpu, value, where):
    x = np.random.default_rng(1).standard_normal((1, 128_256)).astype(np.float32)
    x[0, where] = value
    check(gpu, x)


def test_ties_across_blocks_keep_the_first(gpu):
    """The maximum in several blocks' chunks of one row: the first block's index wins."""
    x = np.zeros((1, 100_000), np.float32)
    x[0, [99_999, 65_000, 4_000, 3_000]] = 5.0
    assert check(gpu, x)[0] == 3_000


def test_argmax_of_rows_with_a_stride(gpu):
    x = tricky_rows(np.random.default_rng(2), 6, 4096)
    check(gpu, x, lambda lf: ops.argmax(ops.view(lf.input("wide", F32, x), (3, 3000), (2 * 4096 * 4, 4))))


def test_argmax_runs_again(gpu):
    """Split rows elect their merging block with counters they must leave at zero: the same plan run again
    with new values, eagerly, captured and replayed, gives the right ids each time."""
    rng = np.random.default_rng(4)
    zeros = np.zeros((2, 150_000), np.float32)
    sched, sg, leafs, out = planned(gpu, lambda lf: ops.argmax(lf.input("logits", F32, zeros)))
    (inp,) = leafs.feeds
    for _ in range(5):
        x = rng.standard_normal((2, 150_000)).astype(np.float32)
        sched.set_tensor(inp, x)
        sched.compute(sg)
        np.testing.assert_array_equal(sched.get_tensor(out), ref_argmax(x))
