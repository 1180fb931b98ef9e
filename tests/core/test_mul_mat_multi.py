"""mul_mat_multi (several weights' products with one input, one node): the op's views, its
reference kernel against separate mul_mats, the CPU's fused call (input quantized once, one r8
kernel call) bit for bit against the CPU's single products, and the fallbacks (weights that
cannot share a call; a backend without the op gets plain mul_mat nodes).
"""
from __future__ import annotations

import numpy as np
import pytest

from ggrun.core import ops
from ggrun.core.backends.cpu import CPUBackend
from ggrun.core.backends.cpu import backend as cpu_backend
from ggrun.core.backends.cpu import matmul
from ggrun.core.backends.cpu.quant import avx2_r8, avx512, codes
from ggrun.core.backends.op_harness import Leafs, ReferenceBackend, nmse, run_on, weight_data
from ggrun.core.backends.sim import SimBackend
from ggrun.core.dtypes import DType
from ggrun.core.errors import GraphError
from ggrun.core.llm import blocks
from tests.core.test_cpu_matmul import MAX_NMSE, act_quant_of, two_threads  # noqa: F401

K = 256


@pytest.fixture(autouse=True)
def compiled_only(monkeypatch):
    """The CPU backend may not fall back to the reference kernels for products."""
    kernels = dict(cpu_backend.KERNELS)

    def refuse(*args):
        raise AssertionError("the reference kernel ran on the CPU backend")
    kernels["mul_mat"] = kernels["mul_mat_multi"] = refuse
    monkeypatch.setattr(cpu_backend, "KERNELS", kernels)


def weights_and_x(types: tuple[DType, ...], rows: tuple[int, ...], n: int, seed: int = 0):
    data = [weight_data(t, m, K, seed + i) for i, (t, m) in enumerate(zip(types, rows))]
    x = np.random.default_rng(seed + 9).standard_normal((n, K)).astype(np.float32)
    return data, x


def make_weights(lf: Leafs, types, rows, data, numerics: str) -> list:
    ws = []
    for i, (t, m, raw) in enumerate(zip(types, rows, data)):
        w = lf.weight(f"w{i}", t, (m, K), raw)
        if numerics == "llama" and act_quant_of(t):
            w.params["act_quant"] = act_quant_of(t)
        if lf.ctx.backend.name == "CPU":
            lf.ctx.prepare_weight(w)  # the layout the engine makes at load
        ws.append(w)
    return ws


def fused(types, rows, n, numerics="llama", seed=0):
    """build(leafs) -> the mul_mat_multi node (its flat result)."""
    data, x = weights_and_x(types, rows, n, seed)

    def build(lf: Leafs):
        ws = make_weights(lf, types, rows, data, numerics)
        views = ops.mul_mat_multi(tuple(ws), lf.input("x", DType.F32, x), tuple(f"p{i}" for i in range(len(ws))))
        return views[0].view_src
    return build


def separate(types, rows, n, numerics="llama", seed=0) -> np.ndarray:
    """Each product as its own mul_mat node on the CPU, flattened one after another."""
    data, x = weights_and_x(types, rows, n, seed)
    parts = []
    for i in range(len(types)):
        def build(lf: Leafs, i=i):
            w = make_weights(lf, types[i:i + 1], rows[i:i + 1], data[i:i + 1], numerics)[0]
            return ops.mul_mat(w, lf.input("x", DType.F32, x))
        parts.append(run_on(CPUBackend(), build).reshape(-1))
    return np.concatenate(parts)


def test_views_are_each_product_one_after_another():
    lf = Leafs(CPUBackend())
    wq = lf.weight("q", DType.F32, (6, 32), np.zeros((6, 32), np.float32))
    wk = lf.weight("k", DType.F32, (2, 32), np.zeros((2, 32), np.float32))
    q, k = ops.mul_mat_multi((wq, wk), lf.input("x", DType.F32, np.zeros((3, 32), np.float32)), ("q", "k"))
    node = q.view_src
    assert node is k.view_src and node.op == "mul_mat_multi" and node.shape == (3 * 8,)
    assert (q.name, q.shape, q.view_offset, q.is_contiguous) == ("q", (3, 6), 0, True)
    assert (k.name, k.shape, k.view_offset, k.is_contiguous) == ("k", (3, 2), 3 * 6 * 4, True)


def test_bad_operands_are_refused():
    lf = Leafs(CPUBackend())
    w = lf.weight("w", DType.F32, (4, 32), np.zeros((4, 32), np.float32))
    x = lf.input("x", DType.F32, np.zeros((2, 32), np.float32))
    with pytest.raises(GraphError):
        ops.mul_mat_multi((w,), lf.input("y", DType.F32, np.zeros((2, 16), np.float32)), ("a",))  # K differs
    with pytest.raises(GraphError):
        ops.mul_mat_multi((w, w), x, ("a",))  # one name per weight
    with pytest.raises(GraphError):
        ops.mul_mat_multi((w,), lf.input("z", DType.F32, np.zeros((1, 2, 32), np.float32)), ("a",))  # b not 2-d


def test_reference_kernel_is_the_separate_products():
    types, rows = (DType.Q4_1, DType.Q8_0), (24, 8)
    data, x = weights_and_x(types, rows, 5)
    got = run_on(ReferenceBackend(), fused(types, rows, 5))
    want = []
    for i in range(2):
        def build(lf: Leafs, i=i):
            w = make_weights(lf, types[i:i + 1], rows[i:i + 1], data[i:i + 1], "llama")[0]
            return ops.mul_mat(w, lf.input("x", DType.F32, x))
        want.append(run_on(ReferenceBackend(), build).reshape(-1))
    np.testing.assert_array_equal(got, np.concatenate(want))


# q/k/v and gate/up of the two models' kinds (rows not a multiple of 8 leave partial groups),
# weights of one activation format but several types, and pairs that cannot share a call
CASES = [
    ((DType.Q4_1, DType.Q4_1, DType.Q4_1), (40, 13, 13)),
    ((DType.Q5_0, DType.Q5_0, DType.Q8_0), (32, 8, 8)),
    ((DType.Q4_0, DType.Q5_1), (16, 21)),
    ((DType.Q4_K, DType.Q6_K), (24, 9)),
    ((DType.Q4_1, DType.Q4_K), (16, 8)),   # Q8_1 and Q8_K activations: one call each
    ((DType.Q2_K, DType.Q3_K), (8, 8)),    # not repacked: one call each
    ((DType.Q4_0,) * 4, (8, 8, 8, 8)),     # more weights than the fused call's slots
]


@pytest.mark.parametrize("numerics", ["llama", "f32"])
@pytest.mark.parametrize("n", [1, 6, 33, 135])
@pytest.mark.parametrize("types,rows", CASES, ids=lambda c: "-".join(map(str, c)))
def test_cpu_equals_its_single_products_and_the_reference(types, rows, n, numerics):
    got = run_on(CPUBackend(), fused(types, rows, n, numerics))
    np.testing.assert_array_equal(got, separate(types, rows, n, numerics))
    want = run_on(ReferenceBackend(), fused(types, rows, n, numerics))
    assert nmse(got, want) <= MAX_NMSE[numerics]


def test_one_call_serves_weights_that_share_activation_blocks(monkeypatch):
    if codes.SIMD == "generic":
        pytest.skip("the r8 and r16 layouts are AVX2's and AVX-512's")
    module, name = (avx512, "mul_mat_r16") if codes.SIMD == "avx512" else (avx2_r8, "mul_mat_r8_avx2")
    calls, real = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *args: calls.append(args[3]) or real(*args))
    run_on(CPUBackend(), fused((DType.Q5_0, DType.Q5_0, DType.Q8_0), (32, 8, 8), 5))
    assert calls == [3]  # one call, three parts
    calls.clear()
    run_on(CPUBackend(), fused((DType.Q4_1, DType.Q4_K), (16, 8), 5))
    assert calls == [1, 1]


def test_threads_split_the_parts_groups(two_threads):  # noqa: F811
    types, rows = (DType.Q4_1, DType.Q4_1, DType.Q4_1), (40, 13, 13)
    np.testing.assert_array_equal(run_on(CPUBackend(), fused(types, rows, 7)), separate(types, rows, 7))


def test_a_backend_without_the_op_gets_separate_products():
    for backend, op in ((CPUBackend(), "mul_mat_multi"), (SimBackend(refuse=frozenset({"mul_mat_multi"})), "mul_mat")):
        lf = Leafs(backend)
        ws = tuple(lf.weight(n, DType.F32, (4, 32), np.zeros((4, 32), np.float32)) for n in "gu")
        g, u = blocks.products(lf.input("x", DType.F32, np.zeros((2, 32), np.float32)), ws, ("g", "u"), name="gu")
        assert (g.name, u.name) == ("g", "u")
        assert (g.view_src.op if g.view_src is not None else g.op) == op
        assert g.shape == u.shape == (2, 4)


def test_scratch_covers_every_part():
    """A node's scratch is the most any of its calls needs (the fused call, or the largest part)."""
    lf = Leafs(CPUBackend())
    ws = make_weights(lf, (DType.Q2_K, DType.Q4_0), (8, 8), weights_and_x((DType.Q2_K, DType.Q4_0), (8, 8), 1)[0],
                      "llama")
    node = ops.mul_mat_multi(tuple(ws), lf.input("x", DType.F32, np.zeros((40, K), np.float32)), ("a", "b"))[0].view_src
    single = [matmul._plan(w, node.srcs[-1]).scratch_bytes() for w in ws]
    assert matmul._multi_scratch(node) == max(single) > 0
