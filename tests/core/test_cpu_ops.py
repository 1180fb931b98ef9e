"""The CPU backend's compiled kernels against the reference array kernels, op by op (the harness in
backend_ops.py: one graph on each backend, compared by NMSE with test-backend-ops' thresholds),
at odd shapes: 1, 2, 7, 33 and 512 tokens, grouped-query heads, cache lengths that are multiples
of nothing, f16 and f32 caches, masks with a padded tail, in-place results. Each case also checks
that the compiled kernel ran (a binder accepted the node) rather than the reference."""
from __future__ import annotations

from functools import partial

import numpy as np
import pytest

from ggrun.core import ops
from ggrun.core.backends.cpu import CPUBackend, jit, set_threads
from ggrun.core.backends.kernels import KERNELS
from ggrun.core.dtypes import DType
from tests.core.backend_ops import compare, planned, run_on

F32, F16, I32 = DType.F32, DType.F16, DType.I32
NMSE_ELEMENTWISE = 1e-7
NMSE_ATTENTION = 5e-4

rng = np.random.default_rng(20240607)


def values(*shape: int, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def bound_calls(build) -> dict[str, bool]:
    """For each compute node of the graph (by name): did a compiled kernel take it?"""
    backend = CPUBackend()
    _, sg, _, _ = planned(backend, build)
    calls = backend.prepare(sg.splits[0].nodes)
    return {n.name: not (isinstance(c, partial) and c.func in KERNELS.values()) for n, c in zip(sg.splits[0].nodes, calls)}


def check(build, threshold: float, compiled: str | None = None) -> float:
    """NMSE of the CPU backend against the reference for this graph, below threshold; the node named
    `compiled` (the output node by default) ran a compiled kernel."""
    err = compare(CPUBackend(), build)
    assert err < threshold, err
    taken = bound_calls(build)
    name = compiled if compiled is not None else list(taken)[-1]
    assert taken[name], f"{name} fell back to the reference kernel"
    return err


# ---- norms ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(1, 576), (2, 577), (7, 64), (33, 13), (512, 576)])
def test_rms_norm_mul(shape):
    xd, wd = values(*shape), values(shape[-1])
    check(lambda lf: ops.rms_norm_mul(lf.input("x", F32, xd), lf.weight("w", F32, wd.shape, wd), 1e-6),
          NMSE_ELEMENTWISE)


def test_rms_norm_mul_per_head_weight():
    """q/k norms: the weight spans head_dim and repeats over tokens and heads."""
    xd, wd = values(7, 3, 32, scale=5.0), values(32)
    check(lambda lf: ops.rms_norm_mul(lf.input("x", F32, xd), lf.weight("w", F32, wd.shape, wd), 1e-6),
          NMSE_ELEMENTWISE)


def test_rms_norm_mul_in_place():
    """When it is its source's last consumer, the result takes the source's memory: still right."""
    xd, wd = values(7, 576), values(576)

    def build(lf):
        x = ops.scale(lf.input("x", F32, xd), 2.0, name="x2")
        return ops.rms_norm_mul(x, lf.weight("w", F32, wd.shape, wd), 1e-5, name="normed")
    check(build, NMSE_ELEMENTWISE)
    sched, sg = _planned(build)
    assert any(n.name == "normed" and s.name == "x2" for n, s in sg.plans["CPU"].inplace)


def test_rms_norm():
    xd = values(33, 577, scale=3.0)
    check(lambda lf: ops.rms_norm(lf.input("x", F32, xd), 1e-5), NMSE_ELEMENTWISE)


@pytest.mark.parametrize("post", [False, True], ids=["llama", "gemma3-post"])
@pytest.mark.parametrize("n", [1, 2, 7, 33])
def test_add_rms_norm(n, post):
    xd, hd, wd, pd = values(n, 577), values(n, 577, scale=3.0), values(577), values(577)

    def build(lf):
        p = lf.weight("p", F32, pd.shape, pd) if post else None
        return ops.add_rms_norm(lf.input("x", F32, xd), lf.input("h", F32, hd), lf.weight("w", F32, wd.shape, wd),
                                1e-6, post=p)
    check(build, NMSE_ELEMENTWISE)


# ---- rope ----------------------------------------------------------------------------------------

def positions(n: int) -> np.ndarray:
    return np.sort(rng.choice(2048, size=n, replace=False)).astype(np.int32)


ROPES = [(ops.ROPE_NORMAL, 64, 64, 10000.0, 1.0), (ops.ROPE_NEOX, 32, 32, 1e6, 1.0),
         (ops.ROPE_NEOX, 48, 64, 10000.0, 0.25), (ops.ROPE_NORMAL, 6, 10, 500.0, 1.0)]


@pytest.mark.parametrize("mode,n_dims,d,base,fscale", ROPES)
@pytest.mark.parametrize("n", [1, 2, 7, 33])
def test_rope(n, mode, n_dims, d, base, fscale):
    xd, pos = values(n, 3, d), positions(n)
    check(lambda lf: ops.rope(lf.input("x", F32, xd), lf.input("pos", I32, pos), n_dims, mode, base, fscale),
          NMSE_ELEMENTWISE)


def test_rope_of_a_prompt():
    xd, pos = values(512, 9, 64), np.arange(512, dtype=np.int32)
    check(lambda lf: ops.rope(lf.input("x", F32, xd), lf.input("pos", I32, pos), 64), NMSE_ELEMENTWISE)


@pytest.mark.parametrize("n", [1, 7])
def test_rope_with_fused_norm_and_scale(n):
    """gemma3's queries: per-head norm, RoPE (neox), then the attention scale, in one node."""
    xd, wd, pos = values(n, 4, 32, scale=4.0), values(32), positions(n)
    check(lambda lf: ops.rope(lf.input("x", F32, xd), lf.input("pos", I32, pos), 32, ops.ROPE_NEOX, 1e6,
                              out_scale=0.17, norm=lf.weight("w", F32, wd.shape, wd), eps=1e-6), NMSE_ELEMENTWISE)


def cache_data(dtype: DType, n_ctx: int, width: int) -> np.ndarray:
    return values(n_ctx, width).astype(dtype.np_dtype)


def _cache(lf, name: str, dtype: DType, data: np.ndarray):
    return lf.weight(name, dtype, data.shape, data)


@pytest.mark.parametrize("dtype", [F16, F32])
@pytest.mark.parametrize("mode,n_dims,d,base,fscale", ROPES[:3])
@pytest.mark.parametrize("n", [1, 2, 33])
def test_rope_set_rows(n, mode, n_dims, d, base, fscale, dtype):
    """Keys rotated straight into scattered cache rows; the whole cache (written and untouched rows)
    is compared."""
    xd, pos, cd = values(n, 2, d), positions(n), cache_data(dtype, 100, 2 * d)
    idx = rng.choice(100, size=n, replace=False).astype(np.int32)
    check(lambda lf: ops.rope_set_rows(_cache(lf, "cache", dtype, cd), lf.input("k", F32, xd),
                                       lf.input("idx", I32, idx), lf.input("pos", I32, pos), n_dims, mode, base,
                                       fscale), NMSE_ELEMENTWISE)


def test_rope_set_rows_with_fused_norm():
    xd, wd, pos, cd = values(7, 1, 32, scale=3.0), values(32), positions(7), cache_data(F16, 40, 32)
    idx = np.arange(10, 17, dtype=np.int32)
    check(lambda lf: ops.rope_set_rows(_cache(lf, "cache", F16, cd), lf.input("k", F32, xd),
                                       lf.input("idx", I32, idx), lf.input("pos", I32, pos), 32, ops.ROPE_NEOX,
                                       norm=lf.weight("w", F32, wd.shape, wd), eps=1e-6), NMSE_ELEMENTWISE)


@pytest.mark.parametrize("dtype", [F16, F32])
def test_set_rows(dtype):
    rows, idx, cd = values(7, 96), np.array([5, 0, 63, 8, 9, 1, 40], dtype=np.int32), cache_data(dtype, 64, 96)
    check(lambda lf: ops.set_rows(_cache(lf, "cache", dtype, cd), lf.input("rows", F32, rows),
                                  lf.input("idx", I32, idx)), NMSE_ELEMENTWISE)


# ---- attention -----------------------------------------------------------------------------------

def causal_mask(n: int, n_kv: int, used: int, rows: int | None = None, window: int | None = None) -> np.ndarray:
    """f16 [rows >= n, n_kv]: token t (at position used - n + t) sees cells up to its position
    (within `window` when given); cells from `used` on are padding; padding rows are garbage."""
    m = np.full((rows or n, n_kv), -np.inf, dtype=np.float32)
    for t in range(n):
        p = used - n + t
        lo = 0 if window is None else max(0, p - window + 1)
        m[t, lo:p + 1] = 0
    m[n:] = 3.0  # rows past the tokens: a kernel that reads them is wrong
    return m.astype(np.float16)


def attention_graph(n, h, h_kv, d, n_kv, n_ctx, dtype=F16, q_f16=True, mask=None, scale=None):
    qd = values(n, h, d)
    kd, vd = values(n_ctx, h_kv * d).astype(dtype.np_dtype), values(n_ctx, h_kv * d).astype(dtype.np_dtype)
    mask = causal_mask(n, n_kv, n_kv) if mask is None else mask
    scale = d ** -0.5 if scale is None else scale

    def build(lf):
        k = lf.weight("k", dtype, kd.shape, kd)
        v = lf.weight("v", dtype, vd.shape, vd)
        if q_f16:
            k.params["act_quant"] = v.params["act_quant"] = "f16"
        e = dtype.itemsize
        view = ((n_kv, h_kv, d), (h_kv * d * e, d * e, e))
        keys = ops.permute(ops.view(k, *view), (1, 0, 2))
        vals = ops.permute(ops.view(v, *view), (1, 0, 2))
        q = ops.permute(lf.input("q", F32, qd), (1, 0, 2))
        return ops.flash_attn(q, keys, vals, lf.input("mask", F16, mask), scale)
    return build


@pytest.mark.parametrize("n,h,h_kv,d,n_kv", [(1, 9, 3, 64, 256), (2, 4, 2, 32, 77), (7, 8, 8, 16, 300),
                                             (33, 4, 1, 32, 513), (8, 6, 2, 64, 65)])
def test_flash_attn(n, h, h_kv, d, n_kv):
    check(attention_graph(n, h, h_kv, d, n_kv, n_kv + 11), NMSE_ATTENTION)


def test_flash_attn_of_a_prompt():
    check(attention_graph(512, 9, 3, 64, 512, 512), NMSE_ATTENTION)


@pytest.mark.parametrize("q_f16", [True, False], ids=["q-f16", "q-f32"])
def test_flash_attn_f32_cache(q_f16):
    check(attention_graph(7, 4, 2, 32, 100, 100, dtype=F32, q_f16=q_f16), NMSE_ATTENTION)


def test_flash_attn_decode_over_a_padded_cache():
    """One token over 256 cells of which 37 hold data (the padded n_kv of a decode step), mask rows
    padded to 8, as the graph gets them."""
    mask = causal_mask(1, 256, 37, rows=8)
    check(attention_graph(1, 9, 3, 64, 256, 300, mask=mask), NMSE_ATTENTION)


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
    mask = blocks_mask(12, 64 * 32, 70, blocks)
    before = jit.threads()
    try:
        set_threads(threads)
        check(attention_graph(12, 9, 3, 64, 64 * 32, 64 * 32 + 5, mask=mask), NMSE_ATTENTION)
    finally:
        set_threads(before)


def test_flash_attn_sliding_window():
    mask = causal_mask(33, 200, 150, window=8)
    check(attention_graph(33, 4, 1, 32, 200, 200, mask=mask), NMSE_ATTENTION)


def test_flash_attn_on_several_threads():
    """The work shared by two threads (KV heads and blocks of tokens) gives the one-thread result,
    bitwise: a row's arithmetic never depends on how the work was split."""
    import numba

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("one core")
    build = attention_graph(33, 9, 3, 64, 300, 300)
    one = run_on(CPUBackend(), build)
    before = jit.threads()
    try:
        set_threads(2)
        check(build, NMSE_ATTENTION)
        two = run_on(CPUBackend(), build)
    finally:
        set_threads(before)
    assert np.array_equal(two, one)


# ---- element-wise, softmax and data movement -----------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 7, 33, 512])
def test_swiglu(n):
    gd, ud = values(n, 1536, scale=4.0), values(n, 1536)
    check(lambda lf: ops.swiglu(lf.input("g", F32, gd), lf.input("u", F32, ud)), NMSE_ELEMENTWISE)


@pytest.mark.parametrize("f16_table", [True, False], ids=["table", "exact"])
@pytest.mark.parametrize("n", [1, 7, 33])
def test_geglu(n, f16_table):
    gd, ud = values(n, 2048, scale=5.0), values(n, 2048)
    gd[0, :8] = [-12, -10, -9.99, 0, 9.99, 10, 11, 65504]  # both ends of ggml's table
    check(lambda lf: ops.geglu(lf.input("g", F32, gd), lf.input("u", F32, ud), f16_table=f16_table),
          NMSE_ELEMENTWISE)


def test_gelu_table_and_silu():
    xd = values(7, 333, scale=6.0)
    check(lambda lf: ops.gelu(lf.input("x", F32, xd), f16_table=True), NMSE_ELEMENTWISE)
    check(lambda lf: ops.silu(lf.input("x", F32, xd)), NMSE_ELEMENTWISE)


def test_swiglu_in_place():
    gd, ud = values(7, 100, scale=4.0), values(7, 100)

    def build(lf):
        g = ops.scale(lf.input("g", F32, gd), 1.5, name="g")
        return ops.swiglu(g, lf.input("u", F32, ud), name="act")
    check(build, NMSE_ELEMENTWISE)
    sched, sg = _planned(build)
    assert any(n.name == "act" for n, _ in sg.plans["CPU"].inplace)


@pytest.mark.parametrize("b_shape", [(7, 33), (33,), (1, 33), (1,)])
@pytest.mark.parametrize("op", [ops.add, ops.mul])
def test_add_mul_broadcast(op, b_shape):
    ad, bd = values(7, 33), values(*b_shape)
    check(lambda lf: op(lf.input("a", F32, ad), lf.input("b", F32, bd)), NMSE_ELEMENTWISE)


def test_scale():
    xd = values(3, 640)
    check(lambda lf: ops.scale(lf.input("x", F32, xd), 25.3), NMSE_ELEMENTWISE)


@pytest.mark.parametrize("n,n_kv,heads", [(1, 256, 9), (7, 77, 4), (33, 300, 2)])
def test_soft_max_with_a_padded_mask(n, n_kv, heads):
    """The non-fused attention's softmax: kq [heads, tokens, n_kv] * scale + mask (f16, more rows
    than tokens, a padded tail) over the last axis."""
    xd, mask = values(heads, n, n_kv, scale=4.0), causal_mask(n, n_kv, n_kv - 3, rows=n + 5)
    check(lambda lf: ops.soft_max(lf.input("kq", F32, xd), lf.input("mask", F16, mask), 0.125),
          NMSE_ELEMENTWISE)


def test_soft_max_without_mask():
    xd = values(3, 5, 77, scale=4.0)
    check(lambda lf: ops.soft_max(lf.input("x", F32, xd), scale=0.7), NMSE_ELEMENTWISE)


@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("n", [1, 2, 33])
def test_get_rows(dtype, n):
    table = values(50, 576).astype(dtype.np_dtype)
    ids = rng.integers(0, 50, size=n).astype(np.int32)
    check(lambda lf: ops.get_rows(lf.weight("t", dtype, table.shape, table), lf.input("ids", I32, ids)),
          NMSE_ELEMENTWISE)


def test_get_rows_of_an_intermediate():
    """The output rows of the last layer: rows of a computed stream."""
    xd, ids = values(7, 64), np.array([6, 2], dtype=np.int32)
    check(lambda lf: ops.get_rows(ops.scale(lf.input("x", F32, xd), 1.0), lf.input("ids", I32, ids)),
          NMSE_ELEMENTWISE)


@pytest.mark.parametrize("dtype", [F32, F16])
def test_cont_of_permuted_heads(dtype):
    """kqv [heads, tokens, d] merged to [tokens, heads, d] (the non-fused attention's cont)."""
    xd = values(9, 7, 64).astype(dtype.np_dtype)
    check(lambda lf: ops.cont(ops.permute(lf.input("x", dtype, xd), (1, 0, 2))), NMSE_ELEMENTWISE)


def _planned(build):
    sched, sg, _, _ = planned(CPUBackend(), build)
    return sched, sg
