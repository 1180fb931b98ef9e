"""The mixture-of-experts ops (moe_topk, moe_weights, mul_mat_id) on the CPU backend against plain numpy:
top-k routing with renormalised weights, and expert products that read only the chosen experts' matrices
(the others are poisoned with NaN here and the result stays finite); the compiled experts' drivers
(core/backends/cpu/experts.py) against each chosen expert's own compiled product, as stored and repacked."""
from __future__ import annotations

import numpy as np
import pytest

from ggrun.core import ops
from ggrun.core.backends.cpu import CPUBackend, matmul
from ggrun.core.backends.op_harness import Leafs, run_on, weight_data
from ggrun.core.dtypes import DType
from ggrun.core.errors import GraphError
from ggrun.core.quants import dequantize, vec_dot_blocks
from ggrun.loaders.synthetic import quantize_q4_k

E, M, K, T, TOP = 6, 32, 256, 5, 2


def routing(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Softmax probabilities [T, E] and each token's TOP experts (largest first)."""
    logits = np.random.default_rng(seed).standard_normal((T, E)).astype(np.float32) * 3
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs = (probs / probs.sum(1, keepdims=True)).astype(np.float32)
    return probs, np.argsort(-probs, axis=1)[:, :TOP].astype(np.int32)


def test_topk_and_weights():
    probs, want_ids = routing()

    def ids(lf: Leafs):
        return ops.moe_topk(lf.input("p", DType.F32, probs), TOP)

    def weights(lf: Leafs):
        p = lf.input("p", DType.F32, probs)
        return ops.moe_weights(p, ops.moe_topk(p, TOP), norm=True)

    np.testing.assert_array_equal(run_on(CPUBackend(), ids), want_ids)
    chosen = np.take_along_axis(probs, want_ids, axis=1)
    np.testing.assert_allclose(run_on(CPUBackend(), weights), chosen / chosen.sum(1, keepdims=True), rtol=1e-6)


@pytest.mark.parametrize("dtype", [DType.F32, DType.Q4_K], ids=lambda t: t.name)
@pytest.mark.parametrize("per_slot", [False, True], ids=["shared-input", "input-per-slot"])
def test_mul_mat_id_reads_only_the_chosen_experts(dtype, per_slot):
    rng = np.random.default_rng(1)
    values = (rng.standard_normal((E, M, K)) / 16).astype(np.float32)
    stored = quantize_q4_k(values) if dtype is DType.Q4_K else values.copy()
    exact = dequantize(stored, "Q4_K", values.shape) if dtype is DType.Q4_K else values
    _, ids = routing()
    unused = sorted(set(range(E)) - set(ids.reshape(-1).tolist()))
    assert unused, "the routing must leave an expert out"
    for e in unused:  # a read of an unused expert would spread NaN
        stored[e] = 0xFF if dtype is DType.Q4_K else np.nan
    x = rng.standard_normal((T, TOP if per_slot else 1, K)).astype(np.float32)

    def build(lf: Leafs):
        w = lf.weight("experts", dtype, (E, M, K), stored)
        return ops.mul_mat_id(w, lf.input("x", DType.F32, x), lf.input("ids", DType.I32, ids))

    got = run_on(CPUBackend(), build)
    want = np.stack([[exact[ids[t, j]] @ x[t, j if per_slot else 0] for j in range(TOP)] for t in range(T)])
    assert got.shape == (T, TOP, M) and np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def test_mul_mat_id_refuses_mismatched_operands():
    lf = Leafs(CPUBackend())
    w = lf.weight("w", DType.F32, (E, M, K), np.zeros((E, M, K), np.float32))
    with pytest.raises(GraphError):
        ops.mul_mat_id(w, lf.input("x", DType.F32, np.zeros((T, 3, K), np.float32)),
                       lf.input("ids", DType.I32, np.zeros((T, TOP), np.int32)))


COMPILED_TYPES = [DType.Q4_0, DType.Q8_0, DType.Q4_K, DType.Q6_K, DType.MXFP4, DType.IQ4_XS]


@pytest.mark.parametrize("dtype", COMPILED_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("packed", [False, True], ids=["stored", "repacked"])
@pytest.mark.parametrize("per_slot", [False, True], ids=["shared-input", "input-per-slot"])
def test_compiled_experts_match_each_experts_own_product(dtype, packed, per_slot):
    """Nine tokens, two of six experts each (some experts get four rows or more: the kernels' four-row passes),
    under llama numerics: every pair's row equals its expert's own compiled product (mul_mat of that expert's
    matrix), and the experts no token chose (poisoned) are never read."""
    if packed and not matmul.experts_repacked(dtype, (E, M, K)):
        pytest.skip(f"{dtype.name} experts are not repacked on this host")
    n_tokens, rng = 9, np.random.default_rng(2)
    stored = weight_data(dtype, E * M, K, seed=3).reshape(E, M, -1)
    ids = np.stack([rng.choice(E - 1, TOP, replace=False) for _ in range(n_tokens)]).astype(np.int32)
    poisoned = stored.copy()
    poisoned[E - 1] = 0xFF  # expert E - 1 is never chosen: NaN scales wherever it would be read
    x = rng.standard_normal((n_tokens, TOP if per_slot else 1, K)).astype(np.float32)

    def weight(lf: Leafs, name: str, data: np.ndarray, shape: tuple[int, ...]):
        w = lf.weight(name, dtype, shape, data)
        w.params["act_quant"] = vec_dot_blocks(dtype.name)
        if packed:
            lf.ctx.prepare_weight(w)
        return w

    def experts(lf: Leafs):
        w = weight(lf, "experts", poisoned, (E, M, K))
        assert isinstance(w.params.get(matmul.REPACKED), np.ndarray) == packed
        return ops.mul_mat_id(w, lf.input("x", DType.F32, x), lf.input("ids", DType.I32, ids))

    def own(e: int, row: np.ndarray):
        return lambda lf: ops.mul_mat(weight(lf, "w", stored[e], (M, K)), lf.input("x", DType.F32, row[None]))

    got = run_on(CPUBackend(), experts)
    want = np.stack([[run_on(CPUBackend(), own(ids[t, j], x[t, j if per_slot else 0]))[0] for j in range(TOP)]
                     for t in range(n_tokens)])
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
