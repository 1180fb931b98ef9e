"""What only the CPU backend's compiled kernels promise beyond the shared op cases (tests/core/op_cases.py,
run on every backend by test_backend_ops.py): results computed in place where the planner lets a node
take its source's memory, and attention split over threads giving the one-thread result bit for bit.
`bound_calls` says which nodes a compiled kernel took (test_kv_quant.py asks it too)."""
from __future__ import annotations

from functools import partial

import numpy as np
import pytest

from ggrun.core import ops
from ggrun.core.backends.cpu import CPUBackend, jit, set_threads
from ggrun.core.backends.kernels import KERNELS
from ggrun.core.backends.op_harness import compare, planned, run_on, weight_data
from ggrun.core.dtypes import DType
from tests.core.op_cases import ATTENTION, ELEMENTWISE, attention_graph, causal_mask, values

F32, F16 = DType.F32, DType.F16
rng = np.random.default_rng(20240607)


def bound_calls(build) -> dict[str, bool]:
    """For each compute node of the graph (by name): did a compiled kernel take it?"""
    backend = CPUBackend()
    _, sg, _, _ = planned(backend, build)
    calls = backend.prepare(sg.splits[0].nodes)
    return {n.name: not (isinstance(c, partial) and c.func in KERNELS.values()) for n, c in zip(sg.splits[0].nodes, calls)}


def check(build, threshold: float) -> None:
    """The CPU backend's result within threshold of the reference's, its output node compiled."""
    err = compare(CPUBackend(), build)
    assert err < threshold, err
    name, compiled = list(bound_calls(build).items())[-1]
    assert compiled, f"{name} fell back to the reference kernel"


def _inplace(build) -> list:
    _, sg, _, _ = planned(CPUBackend(), build)
    return sg.plans["CPU"].inplace


def test_rms_norm_mul_in_place():
    """When it is its source's last consumer, the result takes the source's memory: still right."""
    xd, wd = values(rng, 7, 576), values(rng, 576)

    def build(lf):
        x = ops.scale(lf.input("x", F32, xd), 2.0, name="x2")
        return ops.rms_norm_mul(x, lf.weight("w", F32, wd.shape, wd), 1e-5, name="normed")
    check(build, ELEMENTWISE["CPU"])
    assert any(n.name == "normed" and s.name == "x2" for n, s in _inplace(build))


def test_swiglu_in_place():
    gd, ud = values(rng, 7, 100, scale=4.0), values(rng, 7, 100)

    def build(lf):
        g = ops.scale(lf.input("g", F32, gd), 1.5, name="g")
        return ops.swiglu(g, lf.input("u", F32, ud), name="act")
    check(build, ELEMENTWISE["CPU"])
    assert any(n.name == "act" for n, _ in _inplace(build))


@pytest.mark.parametrize("n,h,h_kv,d,n_kv,used", [(64, 4, 1, 32, 64, 64), (70, 4, 2, 64, 256, 200),
                                                  (130, 9, 3, 16, 300, 290)])
def test_flash_attn_tiled_prompt(n, h, h_kv, d, n_kv, used):
    """Prompt batches of 64 tokens or more (llama.cpp's tiled path): tiles of tokens cut short, cells
    past the last tile's end and past the used ones, a cache holding earlier tokens."""
    check(attention_graph(n, h, h_kv, d, n_kv, n_kv + 5, mask=lambda: causal_mask(n, n_kv, used, rows=n + 3))(rng),
          ATTENTION["CPU"])


def test_flash_attn_tiled_sliding_window():
    check(attention_graph(100, 4, 1, 32, 256, 256, mask=lambda: causal_mask(100, 256, 180, window=70))(rng),
          ATTENTION["CPU"])


def test_flash_attn_tiled_row_does_not_depend_on_its_tile():
    """A token's result over the same cache is the same bitwise whether it came in a batch of 128
    (the second tile) or of 64 (the first), and whichever of the four rows computed together it is."""
    n_kv = 256
    mask = causal_mask(128, n_kv, 200)
    qd = values(rng, 128, 4, 32)
    kd, vd = values(rng, n_kv, 2 * 32).astype(np.float16), values(rng, n_kv, 2 * 32).astype(np.float16)

    def build(rows: slice, m: np.ndarray):
        def graph(lf):
            k, v = lf.weight("k", F16, kd.shape, kd), lf.weight("v", F16, vd.shape, vd)
            k.params["act_quant"] = v.params["act_quant"] = "f16"
            view = ((n_kv, 2, 32), (2 * 32 * 2, 32 * 2, 2))
            keys, vals = (ops.permute(ops.view(t, *view), (1, 0, 2)) for t in (k, v))
            q = ops.permute(lf.input("q", F32, np.ascontiguousarray(qd[rows])), (1, 0, 2))
            return ops.flash_attn(q, keys, vals, lf.input("mask", F16, m), 32 ** -0.5)
        return graph
    whole = run_on(CPUBackend(), build(slice(0, 128), mask))
    for lo in (64, 62):
        part = run_on(CPUBackend(), build(slice(lo, 128), np.ascontiguousarray(mask[lo:])))
        assert np.array_equal(part, whole[lo:])


@pytest.mark.parametrize("n", [33, 130], ids=["cells", "tiled"])
def test_flash_attn_on_several_threads(n):
    """The work shared by two threads (KV heads and blocks of tokens, or heads and tiles of tokens)
    gives the one-thread result, bitwise: a row's arithmetic never depends on how the work was split."""
    import numba

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("one core")
    build = attention_graph(n, 9, 3, 64, 300, 300)(rng)
    one = run_on(CPUBackend(), build)
    before = jit.threads()
    try:
        set_threads(2)
        check(build, ATTENTION["CPU"])
        two = run_on(CPUBackend(), build)
    finally:
        set_threads(before)
    assert np.array_equal(two, one)


def blocks_mask(n_seq: int, n_kv: int, shared: int, blocks: list[list[tuple[int, int]]]) -> np.ndarray:
    """f16 [n_seq, n_kv]: a decode step of n_seq sequences, each token seeing cells 0..shared-1 (a shared
    system prompt) and its sequence's own ranges of cells [a, b) (blocks of its own, core/llm/kv_blocks.py),
    every other cell hidden."""
    m = np.full((n_seq, n_kv), -np.inf, dtype=np.float32)
    m[:, :shared] = 0
    for t, ranges in enumerate(blocks):
        for a, b in ranges:
            m[t, a:b] = 0
    return m.astype(np.float16)


@pytest.mark.parametrize("threads", [1, 2])
def test_flash_attn_decode_of_sequences_in_blocks_of_their_own(threads):
    """Each of 12 tokens sees a shared prefix and its own blocks of cells, between which lie whole tiles
    of the others' cells (skipped by each token's tile spans) and a partly filled block."""
    blocks = [[(64 * (2 + 2 * t), 64 * (3 + 2 * t)), (64 * (3 + 2 * t), 64 * (3 + 2 * t) + 5 + t)]
              for t in range(12)]
    blocks[3] = [(64 * 30 + 7, 64 * 30 + 20), (100, 120)]  # cells out of order, inside another's tile
    before = jit.threads()
    try:
        set_threads(threads)
        check(attention_graph(12, 9, 3, 64, 64 * 32, 64 * 32 + 5,
                              mask=lambda: blocks_mask(12, 64 * 32, 70, blocks))(rng), ATTENTION["CPU"])
    finally:
        set_threads(before)


@pytest.mark.parametrize("dtype", [DType.Q8_0, DType.Q6_K, F16])
def test_products_of_no_rows_compute_nothing(dtype, monkeypatch):
    """A prompt micro-batch that asks no logits has products of 0 rows (its last layer's and the output head's):
    their calls do nothing. numpy's fallback decoded the whole weight first (3.4 s for gemma-3-270m's head)."""
    m, k = 96, 256
    wd = weight_data(dtype, m, k, 3)

    def build(lf):
        x = ops.view(lf.input("x", F32, values(rng, 4, k)), (0, k), name="none")
        return ops.mul_mat(lf.weight("w", dtype, (m, k), wd), x, name="head")

    monkeypatch.setitem(KERNELS, "mul_mat", None)  # a fallback would be a call of None
    assert bound_calls(build)["head"]
    out = run_on(CPUBackend(), build)
    assert out.shape == (0, m)
