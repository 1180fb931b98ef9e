"""CUDA's int8 tensor-core products in ggml's tile layout (mmqt, mmq_idt) against the reference kernels, for the
token rows they serve (past mmq's, up to MMQT_MAX_ROWS: decode buckets of many sequences, prompt micro-batches)
and every type they read (tests/core/op_cases.py has the other paths' cases): weight heights that leave the last tile part-filled, K of several staged chunks with a
last one of a single block, rows whose blocks start at any byte (MXFP4's 17-byte blocks), several weights of one
launch with both kinds of activation sums, and a prompt's experts grouped by expert. Skipped where cupy or a GPU
is missing."""
from __future__ import annotations

import numpy as np
import pytest

from tests.core.gpu import require_gpu

cupy = require_gpu()

from ggrun.core import ops  # noqa: E402
from ggrun.core.backends.cuda import CUDABackend, matmul  # noqa: E402
from ggrun.core.backends.cuda.matmul import MMQ_MAX_ROWS  # noqa: E402
from ggrun.core.backends.op_harness import compare, planned, weight_data  # noqa: E402
from ggrun.core.dtypes import DType  # noqa: E402
from tests.core.op_cases import GLU, MUL_MAT, values  # noqa: E402

MMQ_CASE_TYPES = (DType.Q4_0, DType.Q4_1, DType.Q5_0, DType.Q5_1, DType.Q8_0, DType.Q4_K, DType.Q5_K, DType.IQ4_NL,
                  DType.MXFP4)
F32, I32 = DType.F32, DType.I32


TILED_ROWS = 256  # token rows mmqt's kernels can take (its largest tile, twice)


@pytest.fixture(scope="module")
def gpu():
    return CUDABackend(0)


@pytest.fixture(autouse=True)
def mmqt_wherever_it_can(monkeypatch):
    """mmqt for every product it can run (past mmq's rows up to TILED_ROWS, any weight's height), so that its
    numerics are checked on shapes the dispatch would give other kernels (_mt_serves picks by speed)."""
    monkeypatch.setattr(matmul, "MMQT_MAX_ROWS", TILED_ROWS)
    monkeypatch.setattr(matmul, "MT_WIDTH", 0.0)


@pytest.mark.parametrize("m, k, n, tiled", [(3072, 2048, 64, True), (2048, 2048, 64, False), (16384, 2048, 16, True),
                                            (3072, 2048, 16, True), (16384, 2048, 128, False), (2048, 8192, 16, True),
                                            (2048, 8192, 32, True), (2048, 8192, 64, False), (2048, 2048, 16, False)])
def test_mmqt_serves_wide_weights_of_few_dozen_rows(gpu, monkeypatch, m, k, n, tiled):
    """With the dispatch's own settings: mmqt for weights at least MT_WIDTH times as high as K up to MMQT_MAX_ROWS token
    rows, and for those at most half as high up to MT_TALL_ROWS; else mmq or f16 tiles and cuBLAS (where each measured
    faster)."""
    monkeypatch.undo()
    assert ("mul_mat (mmqt)" in _steps(gpu, _product(DType.Q4_0, m, k, n, 1))) == tiled


def _width(dtype: DType, blocks: int) -> int:
    """K of `blocks` blocks of 32 (a k-quant: rounded up to its super-blocks of 256)."""
    return -(-blocks * 32 // dtype.block_size) * dtype.block_size


def _product(dtype: DType, m: int, k: int, n: int, seed: int):
    rng = np.random.default_rng(seed)
    data, x = weight_data(dtype, m, k, seed=seed), values(rng, n, k)
    return lambda lf: ops.mul_mat(lf.weight("w", dtype, (m, k), data), lf.input("x", F32, x))


def _steps(gpu, build) -> list[str]:
    _, sg, _, _ = planned(gpu, build)
    return [s.name for s in gpu.prepare(sg.splits[0].nodes).steps]


@pytest.mark.parametrize("n", [17, 33, 64, 100, 128, 256, 512])
@pytest.mark.parametrize("dtype", MMQ_CASE_TYPES, ids=lambda t: t.name)
def test_rows(gpu, dtype, n):
    """67 weight rows (one part-filled tile) of a short K (3 blocks: one chunk, part-filled); mmqt where it serves."""
    build = _product(dtype, 67, _width(dtype, 3), n, n)
    assert ("mul_mat (mmqt)" in _steps(gpu, build)) == (MMQ_MAX_ROWS < n <= TILED_ROWS)
    assert compare(gpu, build) < MUL_MAT["CUDA"]


@pytest.mark.parametrize("n", [37, 130])
@pytest.mark.parametrize("dtype", MMQ_CASE_TYPES, ids=lambda t: t.name)
def test_tiles_and_chunks(gpu, dtype, n):
    """200 weight rows (several tiles, the last part-filled) of K in several chunks, the last of one block for the
    32-element types (33 blocks: rows of odd bytes, so a chunk's weight bytes start anywhere in a 16-byte word)."""
    assert compare(gpu, _product(dtype, 200, _width(dtype, 33), n, n + 1)) < MUL_MAT["CUDA"]


@pytest.mark.parametrize("n", [24, 40])
@pytest.mark.parametrize("dtype", [DType.Q4_0, DType.Q4_K, DType.MXFP4], ids=lambda t: t.name)
def test_split_k(gpu, dtype, n):
    """Tall weights (few tiles, K of 97 blocks: 13 chunks in shares, the last share shorter), one and three of them in a
    launch: each tile's last block adds the shares, and leaves its ticket at 0 for the next launch."""
    k = _width(dtype, 97)
    ms = (80, 40, 72)
    assert all(matmul._mt_split(list(h), n, k) > 1 for h in (ms[:1], ms))
    rng = np.random.default_rng(n)
    data = [weight_data(dtype, m, k, seed=i) for i, m in enumerate(ms)]
    x = values(rng, n, k)

    def one(lf):
        return ops.mul_mat(lf.weight("w0", dtype, (ms[0], k), data[0]), lf.input("x", F32, x))

    def three(lf):
        ws = tuple(lf.weight(f"w{i}", dtype, (m, k), d) for i, (m, d) in enumerate(zip(ms, data)))
        return ops.mul_mat_multi(ws, lf.input("x", F32, x), ("p0", "p1", "p2"))[0].view_src
    for build in (one, three):
        assert "mul_mat (mmqt)" in _steps(gpu, build)
        assert compare(gpu, build) < MUL_MAT["CUDA"]
        assert not gpu.tickets(1).any()


@pytest.mark.parametrize("n", [24, 64])
def test_weights_of_one_launch(gpu, n):
    """q, k and v of one type in one launch beside a k-quant (the other kind of activation sums) and MXFP4."""
    kinds = ((DType.Q4_0, 96), (DType.Q4_0, 40), (DType.Q4_0, 72), (DType.Q4_K, 50), (DType.MXFP4, 33))
    k = 512
    rng = np.random.default_rng(n)
    data = [weight_data(dt, m, k, seed=i) for i, (dt, m) in enumerate(kinds)]
    x = values(rng, n, k)

    def build(lf):
        ws = tuple(lf.weight(f"w{i}", dt, (m, k), d) for i, ((dt, m), d) in enumerate(zip(kinds, data)))
        return ops.mul_mat_multi(ws, lf.input("x", F32, x), tuple(f"p{i}" for i in range(len(ws))))[0].view_src
    assert compare(gpu, build) < MUL_MAT["CUDA"]


@pytest.mark.parametrize("dtype", [DType.Q4_0, DType.Q5_K, DType.MXFP4], ids=lambda t: t.name)
def test_gated(gpu, dtype):
    """gate and up in one launch, the gated unit after them."""
    m, k, n = 150, 512, 48
    rng = np.random.default_rng(3)
    gd, ud = (weight_data(dtype, m, k, seed=i) for i in (1, 2))
    x = values(rng, n, k)

    def build(lf):
        gate, up = lf.weight("gate", dtype, (m, k), gd), lf.weight("up", dtype, (m, k), ud)
        return ops.mul_mat_glu(gate, up, lf.input("x", F32, x), "swiglu")
    assert compare(gpu, build) < GLU["CUDA"]


@pytest.mark.parametrize("per_slot", [False, True], ids=["tokens", "slots"])
@pytest.mark.parametrize("n", [40, 130])
@pytest.mark.parametrize("dtype", [DType.MXFP4, DType.Q4_0, DType.Q5_K, DType.Q8_0], ids=lambda t: t.name)
def test_experts(gpu, dtype, n, per_slot):
    """A prompt's experts (8 of them, 4 a token) through mmq_idt: 70 rows an expert, K of several chunks."""
    n_expert, k, m = 8, 4, 70
    cols = _width(dtype, 33)
    rng = np.random.default_rng(n)
    data = weight_data(dtype, n_expert * m, cols, seed=n)
    x = values(rng, n, k if per_slot else 1, cols)
    ids = np.stack([rng.choice(n_expert, size=k, replace=False) for _ in range(n)]).astype(np.int32)

    def build(lf):
        return ops.mul_mat_id(lf.weight("w", dtype, (n_expert, m, cols), data), lf.input("x", F32, x),
                              lf.input("ids", I32, ids))
    assert compare(gpu, build) < MUL_MAT["CUDA"]
