"""Quantized KV caches (Q8_0, Q4_0) op by op: the reference encoders and rotation against independent
formulas and against ggml itself (tests/data/ggml_kv_quant.json, from scripts/tools/ggml_kv_reference.py),
and the CPU backend's compiled kernels against the reference array kernels (core/backends/
op_harness.py): cache writes bit for bit (set_rows; rope_set_rows and the K-shift's rope_shift
within a rounding step), attention over quantized and mixed caches by NMSE and against ggml's
flash_attn_ext, the unfused product against quantized keys."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ggrun.core import ops
from ggrun.core.backends.cpu import CPUBackend, jit, set_threads
from ggrun.core.backends.kernels import round_q8_blocks, walsh_hadamard
from ggrun.core.backends.op_harness import ReferenceBackend, compare, nmse, run_on
from ggrun.core.dtypes import DType
from ggrun.core.quants import dequantize, quantize, quantize_q4_0, quantize_q8_0
from tests.core.op_cases import causal_mask
from tests.core.test_cpu_ops import bound_calls

F32, F16, I32, Q8_0, Q4_0 = DType.F32, DType.F16, DType.I32, DType.Q8_0, DType.Q4_0
NMSE_EXACT = 1e-10  # integer block sums and f32 sums in ggml's order: only the reference's float sums differ
NMSE_VKQ16 = 5e-4  # an f16 V cache: the CPU sums values in f16 as ggml does, the reference in f32
NMSE_REQUANTIZED = 1e-6  # a cache written from RoPE's output: a value may land one rounding step apart

rng = np.random.default_rng(20250101)
GGML = json.loads((Path(__file__).parents[1] / "data" / "ggml_kv_quant.json").read_text(encoding="utf-8"))


def values(*shape: int, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


# ---- the reference encoders and rotation -------------------------------------------------------

def test_q8_0_rounds_half_to_even_with_ggml_scale():
    """d = amax / 127 as f16, q = rint(x * 127 / amax): with amax 127, 62.5 -> 62 and 63.5 -> 64 (ties
    to even, as _mm256_round_ps), -127 stays -127; a block of zeros stores d 0."""
    x = np.zeros((2, 32), np.float32)
    x[0, :4] = [127.0, 62.5, 63.5, -127.0]
    b = quantize_q8_0(x).reshape(2, 34)
    assert b[0, :2].view(np.float16)[0] == np.float16(1.0)
    assert b[0, 2:6].view(np.int8).tolist() == [127, 62, 64, -127]
    assert not b[1].any()


def test_q4_0_takes_the_signed_largest_value_and_packs_halves():
    """d = (first value of largest magnitude) / -8; element j in the low nibble of byte j, j + 16 in its
    high nibble; q = min(15, trunc(x / d + 8.5))."""
    x = np.zeros((1, 32), np.float32)
    x[0, 0], x[0, 5], x[0, 16], x[0, 17] = -8.0, 8.0, 4.0, 3.4
    b = quantize_q4_0(x).reshape(18)
    assert b[:2].view(np.float16)[0] == np.float16(1.0)  # -8 / -8
    q = np.concatenate([b[2:] & 15, b[2:] >> 4]).astype(int)
    assert q[0] == 0 and q[5] == 15 and q[16] == 12 and q[17] == 11 and q[1] == 8
    np.testing.assert_array_equal(dequantize(b, "Q4_0", (32,))[[0, 5, 16, 17]], [-8.0, 7.0, 4.0, 3.0])


# largest error over a block's largest magnitude: half a step of amax/127 plus the f16 scale's rounding
# times 127 steps (Q8_0); a full step of amax/8 (Q4_0: the extreme opposite the signed max clips to 7)
@pytest.mark.parametrize("dtype", [Q8_0, Q4_0], ids=["q8_0", "q4_0"])
def test_encoders_store_what_ggml_stores(dtype):
    """Rows with a block of zeros, Q8_0's ties and Q4_0's signed maximum: the bytes ggml's CPU from_float
    writes."""
    x = np.array(GGML["from_float"]["x"], dtype=np.float32)
    assert [row.tobytes().hex() for row in quantize(x, dtype.name)] == GGML["from_float"][dtype.label]


@pytest.mark.parametrize("dtype,bound", [(Q8_0, 1 / 254 + 2.0 ** -11), (Q4_0, 1 / 8)], ids=["q8_0", "q4_0"])
def test_encoders_round_trip_within_their_step(dtype, bound):
    x = values(64, 96) * rng.uniform(0.01, 30, size=(64, 1)).astype(np.float32)
    back = dequantize(quantize(x, dtype.name).reshape(-1), dtype.name, x.shape)
    amax = np.abs(x.reshape(-1, 32)).max(axis=1, keepdims=True)
    assert np.all(np.abs(back - x).reshape(-1, 32) <= amax * bound * 1.01 + 1e-12)


def test_walsh_hadamard_is_sylvesters_matrix_and_its_own_inverse():
    n = 64
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    x = values(5, 2 * n)
    y = walsh_hadamard(np, x, n)
    want = (x.reshape(5, 2, n).astype(np.float64) @ h.T / np.sqrt(n)).reshape(5, 2 * n)
    np.testing.assert_allclose(y, want, atol=1e-5)
    np.testing.assert_allclose(walsh_hadamard(np, y, n), x, atol=1e-5)


# ---- cache writes: the compiled kernels store exactly the reference's bytes -------------------

def block_cache(lf, name: str, dtype: DType, n_ctx: int, width: int, rotation: int = 0, seed: int = 0):
    """A cache tensor of dtype holding random rows (blocks for a quantized type), rotated as given."""
    data = np.random.default_rng(seed).standard_normal((n_ctx, width)).astype(np.float32)
    t = lf.ctx.new_tensor(name, dtype, (n_ctx, width))
    lf.ctx.backend.array(t)[...] = quantize(data, dtype.name) if dtype.is_quantized else data.astype(dtype.np_dtype)
    if rotation:
        t.params["hadamard"] = rotation
    return t


def check_cache(build, dtype: DType, exact: bool = True) -> None:
    """The CPU's cache after the write equals the reference's byte for byte (`exact`), or, where
    RoPE's angles differ in their last bits (f32 as ggml's rope cache on the CPU, f64 in the
    reference), decodes to values within a rounding step's NMSE; the compiled kernel took the node."""
    got = run_on(CPUBackend(), build)
    want = run_on(ReferenceBackend(), build)
    if exact:
        np.testing.assert_array_equal(got, want)
    else:
        shape = (got.shape[0], got.shape[1] // dtype.type_size * dtype.block_size)
        decoded = [dequantize(a.astype(np.uint8).reshape(-1), dtype.name, shape) for a in (got, want)]
        assert nmse(*decoded) < NMSE_REQUANTIZED
    taken = bound_calls(build)
    assert taken[list(taken)[-1]], "the compiled kernel did not take the node"


CASES = [(Q8_0, 0), (Q8_0, 64), (Q4_0, 0), (Q4_0, 128)]
CASE_IDS = ["q8_0", "q8_0-rot64", "q4_0", "q4_0-rot128"]


@pytest.mark.parametrize("dtype,rotation", CASES, ids=CASE_IDS)
def test_set_rows(dtype, rotation):
    rows, idx = values(7, 256, scale=3.0), np.array([5, 0, 63, 8, 9, 1, 40], np.int32)
    check_cache(lambda lf: ops.set_rows(block_cache(lf, "cache", dtype, 64, 256, rotation),
                                        lf.input("rows", F32, rows), lf.input("idx", I32, idx)), dtype)


@pytest.mark.parametrize("dtype,rotation", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("mode,n_dims", [(ops.ROPE_NORMAL, 128), (ops.ROPE_NEOX, 64)], ids=["normal", "neox-partial"])
def test_rope_set_rows(dtype, rotation, mode, n_dims):
    x, pos = values(5, 2, 128), np.array([0, 7, 100, 3, 4095], np.int32)
    idx = np.array([9, 2, 30, 31, 0], np.int32)
    check_cache(lambda lf: ops.rope_set_rows(block_cache(lf, "cache", dtype, 40, 256, rotation),
                                             lf.input("k", F32, x), lf.input("idx", I32, idx),
                                             lf.input("pos", I32, pos), n_dims, mode, 1e4), dtype, exact=False)


def test_rope_set_rows_with_fused_norm():
    x, w, pos, idx = values(3, 2, 64), values(64), np.arange(3, dtype=np.int32), np.array([4, 1, 2], np.int32)
    check_cache(lambda lf: ops.rope_set_rows(block_cache(lf, "cache", Q8_0, 8, 128, 64), lf.input("k", F32, x),
                                             lf.input("idx", I32, idx), lf.input("pos", I32, pos), 64,
                                             ops.ROPE_NEOX, norm=lf.weight("w", F32, w.shape, w), eps=1e-6),
                Q8_0, exact=False)


@pytest.mark.parametrize("dtype,rotation", CASES, ids=CASE_IDS)
def test_rope_shift(dtype, rotation):
    shift = rng.integers(-40, 40, size=48).astype(np.int32)
    shift[:5] = 0
    check_cache(lambda lf: ops.rope_shift(block_cache(lf, "cache", dtype, 48, 256, rotation), lf.input("s", I32, shift),
                                          128, 128, ops.ROPE_NORMAL, 1e4), dtype, exact=False)


def test_rope_shift_re_rotates_the_stored_keys():
    """Against an independent rotation: every row decoded, turned back, rotated by its delta in NEOX
    pairs, turned again, re-quantized; rows with delta 0 come back within one rounding step."""
    n_ctx, d = 16, 64
    shift = np.arange(n_ctx, dtype=np.int32) - 4
    build = lambda lf: ops.rope_shift(block_cache(lf, "cache", Q8_0, n_ctx, d, 64, seed=3), lf.input("s", I32, shift),
                                      d, d, ops.ROPE_NEOX, 1e4)
    before = dequantize(quantize(np.random.default_rng(3).standard_normal((n_ctx, d)).astype(np.float32), "Q8_0")
                        .reshape(-1), "Q8_0", (n_ctx, d))
    plain = walsh_hadamard(np, before, 64).astype(np.float64)
    theta = shift[:, None] * 1e4 ** (-np.arange(0, d, 2) / d)
    x0, x1 = plain[:, :d // 2], plain[:, d // 2:]
    rotated = np.concatenate([x0 * np.cos(theta) - x1 * np.sin(theta), x0 * np.sin(theta) + x1 * np.cos(theta)], 1)
    want = walsh_hadamard(np, rotated.astype(np.float32), 64)
    got = dequantize(run_on(CPUBackend(), build).astype(np.uint8).reshape(-1), "Q8_0", (n_ctx, d))
    step = np.abs(want).reshape(n_ctx, -1, 32).max(axis=-1, keepdims=True) / 127
    assert np.all(np.abs(got - want).reshape(n_ctx, -1, 32) <= 1.01 * step)


# ---- attention over quantized and mixed caches ----------------------------------------------------

def cache_heads(t, n_kv: int, h_kv: int, d: int):
    elem = 0 if t.dtype.is_quantized else t.dtype.itemsize
    return ops.permute(ops.view(t, (n_kv, h_kv, d), (t.strides[0], t.dtype.row_bytes(d), elem)), (1, 0, 2))


def attention_graph(n, h, h_kv, d, n_kv, type_k, type_v, rot_k=0, rot_v=0, llama=True, mask=None, sinks=None):
    qd = values(n, h, d)
    mask = causal_mask(n, n_kv, n_kv) if mask is None else mask

    def build(lf):
        k = block_cache(lf, "k", type_k, n_kv + 9, h_kv * d, rot_k, seed=1)
        v = block_cache(lf, "v", type_v, n_kv + 9, h_kv * d, rot_v, seed=2)
        if llama:  # what the session sets: q rounded to K's vec_dot type, f16 sums for an f16 V
            for t in (k, v):
                if t.dtype is F16:
                    t.params["act_quant"] = "f16"
            if type_k.is_quantized:
                k.params["act_quant"] = "q8_0"
        q = ops.permute(lf.input("q", F32, qd), (1, 0, 2))
        s = None if sinks is None else lf.weight("sinks", F32, sinks.shape, sinks)
        return ops.flash_attn(q, cache_heads(k, n_kv, h_kv, d), cache_heads(v, n_kv, h_kv, d),
                              lf.input("mask", F16, mask), d ** -0.5, sinks=s)
    return build


def check_attention(build, threshold: float) -> None:
    err = compare(CPUBackend(), build)
    assert err < threshold, err
    taken = bound_calls(build)
    assert taken[list(taken)[-1]], "flash_attn fell back to the reference kernel"


@pytest.mark.parametrize("type_k,type_v,rot_k,rot_v,threshold", [
    (Q8_0, Q8_0, 0, 0, NMSE_EXACT), (Q4_0, Q4_0, 0, 0, NMSE_EXACT), (Q8_0, Q8_0, 64, 64, NMSE_EXACT),
    (Q4_0, Q8_0, 128, 64, NMSE_EXACT), (Q8_0, F16, 64, 0, NMSE_VKQ16), (F16, Q4_0, 0, 64, NMSE_EXACT),
    (Q8_0, F32, 0, 0, NMSE_EXACT), (F32, F16, 0, 0, NMSE_VKQ16)],
    ids=["q8_0", "q4_0", "q8_0-rot", "q4_0-k-q8_0-v-rot", "q8_0-k-f16-v", "f16-k-q4_0-v", "q8_0-k-f32-v", "f32-k-f16-v"])
@pytest.mark.parametrize("n,h,h_kv,n_kv", [(1, 9, 3, 256), (7, 4, 2, 77), (33, 4, 1, 300)])
def test_flash_attn(n, h, h_kv, n_kv, type_k, type_v, rot_k, rot_v, threshold):
    check_attention(attention_graph(n, h, h_kv, 128, n_kv, type_k, type_v, rot_k, rot_v), threshold)


def test_flash_attn_matches_ggml():
    """Over a Q4_0 K and a Q8_0 V cache, the compiled attention gives what ggml_flash_attn_ext gives on
    the same bytes, within f32's last bits (expf's rounding); the reference within its float sums."""
    f = GGML["flash_attn"]
    n, h, h_kv, d, n_kv = f["shape"]
    q = np.array(f["q"], dtype=np.float32).reshape(n, h, d)
    mask = np.array(f["mask"], dtype=np.float32).reshape(n, n_kv).astype(np.float16)
    rows = {name: np.array([np.frombuffer(bytes.fromhex(r), np.uint8) for r in f[name]]) for name in ("k", "v")}
    want = np.array(f["out"], dtype=np.float32).reshape(n, h, d)

    def build(lf):
        caches = []
        for name, dtype in (("k", Q4_0), ("v", Q8_0)):
            t = lf.ctx.new_tensor(name, dtype, (n_kv, h_kv * d))
            lf.ctx.backend.array(t)[...] = rows[name]
            caches.append(t)
        caches[0].params["act_quant"] = "q8_0"
        q_heads = ops.permute(lf.input("q", F32, q), (1, 0, 2))
        return ops.flash_attn(q_heads, cache_heads(caches[0], n_kv, h_kv, d), cache_heads(caches[1], n_kv, h_kv, d),
                              lf.input("mask", F16, mask), f["scale"])

    np.testing.assert_allclose(run_on(CPUBackend(), build), want, rtol=0, atol=2e-6)
    assert nmse(run_on(ReferenceBackend(), build), want) < NMSE_EXACT


def test_flash_attn_in_f32_numerics():
    """Without llama numerics' rounding (no act_quant), queries meet the decoded keys as f32."""
    check_attention(attention_graph(7, 4, 2, 64, 100, Q4_0, Q8_0, 64, 64, llama=False), NMSE_EXACT)


def test_flash_attn_decode_over_a_padded_sliding_window():
    mask = causal_mask(5, 256, 150, rows=8, window=32)
    check_attention(attention_graph(5, 4, 2, 64, 256, Q8_0, Q8_0, 64, 64, mask=mask), NMSE_EXACT)


@pytest.mark.parametrize("type_k,type_v", [(Q8_0, Q4_0), (Q8_0, F16)])
def test_flash_attn_with_sinks(type_k, type_v):
    """gpt-oss's attention sinks over quantized caches (the cell-by-cell kernel; f16 sums for an f16 V)."""
    sinks = np.array([8.0, 0.5, -1.0, 2.0, -40.0, 1.5, 0.0, -3.0], dtype=np.float32)
    check_attention(attention_graph(7, 8, 2, 64, 100, type_k, type_v, 64, 0, sinks=sinks),
                    NMSE_EXACT if type_v is Q4_0 else NMSE_VKQ16)


def test_flash_attn_on_several_threads():
    """Two threads share (KV head, block of tokens) items: the one-thread result, bitwise."""
    import numba

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("one core")
    build = attention_graph(33, 9, 3, 64, 300, Q8_0, Q4_0, 64, 64)
    one = run_on(CPUBackend(), build)
    before = jit.threads()
    try:
        set_threads(2)
        two = run_on(CPUBackend(), build)
    finally:
        set_threads(before)
    assert np.array_equal(two, one)


def test_unfused_scores_against_quantized_keys():
    """-no-fa: q @ K^T against a rotated Q8_0 cache's heads (the reference kernel) equals the product of
    the query turned and rounded to 8-bit blocks (as the reference rounds activations) with the decoded
    keys."""
    n, h, h_kv, d, n_kv = 3, 4, 2, 64, 20
    qd = values(n, h, d)

    def build(lf):
        k = block_cache(lf, "k", Q8_0, n_kv, h_kv * d, 64, seed=5)
        k.params["act_quant"] = "q8_0"
        return ops.mul_mat(cache_heads(k, n_kv, h_kv, d), ops.permute(lf.input("q", F32, qd), (1, 0, 2)))

    got = run_on(CPUBackend(), build)  # [h, n, n_kv]
    keys = dequantize(quantize(np.random.default_rng(5).standard_normal((n_kv, h_kv * d)).astype(np.float32),
                               "Q8_0").reshape(-1), "Q8_0", (n_kv, h_kv, d))
    q = round_q8_blocks(np, walsh_hadamard(np, qd.transpose(1, 0, 2), 64))
    want = np.einsum("hnd,khd->hnk", q.astype(np.float64), np.repeat(keys, h // h_kv, axis=1).astype(np.float64))
    np.testing.assert_allclose(got, want, atol=1e-4)
