"""Every op against a plain numpy reference, run through the real path (graph -> scheduler ->
plan -> compute), on random data with odd sizes, non-contiguous views, broadcasting and
f16/bf16 operands; and bad uses of the graph API, which must raise GraphError naming the tensors.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from ggrun.core import ops
from ggrun.core.dtypes import DType
from ggrun.core.errors import GraphError
from ggrun.core.tensor import new_tensor
from tests.core.harness import Runner, as_f64, f32_to_bf16

F32, F16, BF16, I32 = DType.F32, DType.F16, DType.BF16, DType.I32
FLOATS = [F32, F16, BF16]


def close(got: np.ndarray, want: np.ndarray, tol: float = 1e-5) -> None:
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=tol, atol=tol)


# ---- numpy references ---------------------------------------------------------------------

def ref_silu(x):
    return x / (1 + np.exp(-x))


def ref_gelu_exact(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def ref_gelu(x):
    """ggml's CPU GELU: a table indexed by the f16-rounded input holding f16 results; x or 0 past |x| >= 10."""
    x = np.asarray(x, dtype=np.float64)
    table = ref_gelu_exact(x.astype(np.float16).astype(np.float64)).astype(np.float16).astype(np.float64)
    return np.where(np.abs(x) >= 10, np.where(x > 0, x, 0), table)


def ref_rms_norm(x, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def ref_norm(x, eps):
    c = x - x.mean(axis=-1, keepdims=True)
    return c / np.sqrt(np.mean(c * c, axis=-1, keepdims=True) + eps)


def ref_softmax(x, mask=None, scale=1.0):
    x = x * scale
    if mask is not None:
        x = x + mask[: x.shape[-2]]
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def ref_mul_mat(a, b):
    """ggml semantics: out[..., n, m] = sum_k a[..., m, k] * b[..., n, k]; a's heads repeat over b's."""
    a_batch, b_batch = a.shape[:-2], b.shape[:-2]
    a = a.reshape((1,) * (len(b_batch) - len(a_batch)) + a.shape)
    out = np.empty(b_batch + (b.shape[-2], a.shape[-2]))
    for idx in np.ndindex(*b_batch):
        a_idx = tuple(i // (nb // na) for i, nb, na in zip(idx, b_batch, a.shape[:-2]))
        out[idx] = b[idx] @ a[a_idx].T
    return out


def ref_rope(x, pos, n_dims, neox, base, fscale):
    """llama.cpp's rope, written as loops over the rotated pairs."""
    out = x.copy()
    for i in range(n_dims // 2):
        theta = pos[:, None] * fscale * base ** (-2 * i / n_dims)
        j0, j1 = (i, i + n_dims // 2) if neox else (2 * i, 2 * i + 1)
        x0, x1 = x[:, :, j0], x[:, :, j1]
        out[:, :, j0] = x0 * np.cos(theta) - x1 * np.sin(theta)
        out[:, :, j1] = x0 * np.sin(theta) + x1 * np.cos(theta)
    return out


# ---- views --------------------------------------------------------------------------------

def test_view_with_offset_and_strides_of_an_intermediate(rt: Runner):
    """A strided window into a computed tensor reads the right elements."""
    xd = rt.random(5, 7)
    x = rt.input("x", xd)
    y = ops.scale(x, 2.0, name="y")
    item = 4
    v = ops.view(y, (2, 3), strides=(2 * 7 * item, 2 * item), offset=(1 * 7 + 1) * item, name="win")
    got_view, got_cont = rt.run(v, ops.cont(v))
    want = (2 * xd.astype(np.float64))[1:5:2, 1:7:2]
    close(got_view, want)
    close(got_cont, want)


def test_reshape_then_permute_then_cont(rt: Runner):
    xd = rt.random(3, 10)
    x = rt.input("x", xd)
    y = ops.silu(x)
    r = ops.reshape(y, (3, 2, 5))
    p = ops.permute(r, (2, 0, 1))
    got = rt.run1(ops.cont(p))
    close(got, ref_silu(xd.astype(np.float64)).reshape(3, 2, 5).transpose(2, 0, 1))


def test_reshape_infers_minus_one(rt: Runner):
    x = rt.input("x", rt.random(4, 6))
    assert ops.reshape(x, (-1, 3)).shape == (8, 3)


def test_transpose_of_a_weight_through_cont(rt: Runner):
    wd = rt.random(3, 5, 7, dtype=F16)
    w = rt.weight("w", wd)
    got = rt.run1(ops.cont(ops.transpose(w)))
    assert got.dtype == np.float16
    np.testing.assert_array_equal(got, wd.transpose(0, 2, 1))


@pytest.mark.parametrize("dtype", FLOATS)
def test_cont_copies_bits_of_a_permuted_view(rt: Runner, dtype: DType):
    xd = rt.random(2, 3, 5, dtype=dtype)
    x = rt.input("x", xd)
    got = rt.run1(ops.cont(ops.permute(x, (1, 2, 0))))
    np.testing.assert_array_equal(got, xd.transpose(1, 2, 0))


# ---- casts and copies ---------------------------------------------------------------------

@pytest.mark.parametrize("src,dst", [(F32, F16), (F32, BF16), (F16, F32), (BF16, F32), (BF16, F16), (F16, BF16)])
def test_cast(rt: Runner, src: DType, dst: DType):
    xd = rt.random(3, 17, dtype=src, scale=10.0)
    x = rt.input("x", xd)
    got = rt.run1(ops.cast(x, dst))
    values = as_f64(xd, src).astype(np.float32)
    want = f32_to_bf16(values) if dst is BF16 else values.astype(dst.np_dtype)
    np.testing.assert_array_equal(got, want)


def test_cast_to_bf16_rounds_to_nearest_even(rt: Runner):
    """Values exactly halfway between two bf16 numbers round to the one with an even mantissa."""
    one = np.float32(1.0).view(np.uint32)
    halfway = np.array([one + 0x8000, one + 0x18000, one + 0x7FFF, one + 0x8001], dtype=np.uint32).view(np.float32)
    x = rt.input("x", halfway)
    got = rt.run1(ops.cast(x, BF16))
    np.testing.assert_array_equal(got, [0x3F80, 0x3F82, 0x3F80, 0x3F81])


@pytest.mark.parametrize("dtype", FLOATS)
def test_cpy_into_a_view_of_a_cache(rt: Runner, dtype: DType):
    """cpy writes a (transposed) source into rows 2..3 of a cache tensor and leaves the rest alone."""
    cache_data = rt.random(6, 5, dtype=dtype)
    cache = rt.weight("cache", cache_data, dtype=dtype)
    src_data = rt.random(5, 2)
    src = ops.transpose(ops.scale(rt.input("src", src_data), 1.0))  # non-contiguous [2, 5]
    dst = ops.view(cache, (2, 5), offset=2 * 5 * dtype.itemsize)
    written = ops.cpy(src, dst, name="written")
    got = rt.run1(ops.cont(written))
    want_rows = src_data.T.astype(np.float32)
    want_rows = f32_to_bf16(want_rows) if dtype is BF16 else want_rows.astype(dtype.np_dtype)
    np.testing.assert_array_equal(got, want_rows)
    after = rt.backend.get_tensor(cache)
    np.testing.assert_array_equal(after[2:4], want_rows)
    np.testing.assert_array_equal(np.delete(after, [2, 3], axis=0), np.delete(cache_data, [2, 3], axis=0))


def test_cpy_into_a_view_of_an_intermediate_is_seen_by_its_readers(rt: Runner):
    xd = rt.random(4, 3)
    x = rt.input("x", xd)
    base = ops.scale(x, 1.0, name="base")
    dst = ops.view(base, (3,), offset=3 * 4)  # row 1
    row = ops.scale(rt.input("row", np.arange(3, dtype=np.float32)), 10.0)
    written = ops.cpy(row, dst)
    whole = ops.view(written, (4, 3), offset=-3 * 4)  # the whole of base again, after the write
    got = rt.run1(ops.add(whole, whole))
    want = xd.astype(np.float64).copy()
    want[1] = [0, 10, 20]
    close(got, 2 * want)


@pytest.mark.parametrize("dtype", FLOATS)
def test_set_rows_writes_indexed_rows(rt: Runner, dtype: DType):
    cache_data = rt.random(9, 6, dtype=dtype)
    cache = rt.weight("kv", cache_data, dtype=dtype)
    rows = rt.random(3, 6)
    idx = np.array([7, 0, 4], dtype=np.int32)
    out = ops.set_rows(cache, rt.input("rows", rows), rt.input("idx", idx))
    got = rt.run1(ops.cont(out))
    want = cache_data.copy()
    want[idx] = f32_to_bf16(rows) if dtype is BF16 else rows.astype(dtype.np_dtype)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", FLOATS)
def test_get_rows(rt: Runner, dtype: DType):
    table = rt.random(11, 7, dtype=dtype)
    ids = np.array([3, 3, 10, 0, 5], dtype=np.int32)
    got = rt.run1(ops.get_rows(rt.weight("tok_embd", table, dtype=dtype), rt.input("ids", ids)))
    assert got.dtype == np.float32
    close(got, as_f64(table, dtype)[ids], tol=0)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_concat(rt: Runner, dtype: DType, axis: int):
    ad = rt.random(3, 5, dtype=dtype)
    bd = rt.random(3, 5, dtype=dtype)[:, :4] if axis else rt.random(2, 5, dtype=dtype)
    bd = np.ascontiguousarray(bd)
    a = ops.transpose(ops.transpose(rt.input("a", ad)))  # a non-contiguous path to the same values
    got = rt.run1(ops.concat(a, rt.input("b", bd), axis))
    np.testing.assert_array_equal(got, np.concatenate([ad, bd], axis=axis))


def test_concat_of_3d_along_the_middle(rt: Runner):
    ad, bd = rt.random(2, 3, 4), rt.random(2, 1, 4)
    got = rt.run1(ops.concat(rt.input("a", ad), rt.input("b", bd), 1))
    np.testing.assert_array_equal(got, np.concatenate([ad, bd], axis=1))


# ---- element-wise -------------------------------------------------------------------------

BROADCASTS = [((5, 7), (5, 7)), ((5, 7), (7,)), ((5, 7), (1, 7)), ((5, 7), (5, 1)),
              ((2, 3, 5), (3, 5)), ((2, 3, 5), (2, 1, 5)), ((2, 3, 5), (1,))]


@pytest.mark.parametrize("op,fn", [(ops.add, np.add), (ops.mul, np.multiply)])
@pytest.mark.parametrize("a_shape,b_shape", BROADCASTS)
def test_binary_broadcasts_second_operand(rt: Runner, op, fn, a_shape, b_shape):
    ad, bd = rt.random(*a_shape), rt.random(*b_shape)
    got = rt.run1(op(rt.input("a", ad), rt.weight("b", bd)))
    close(got, fn(ad.astype(np.float64), bd.astype(np.float64)))


@pytest.mark.parametrize("op,fn", [(ops.add, np.add), (ops.mul, np.multiply)])
@pytest.mark.parametrize("a_dtype,b_dtype", [(F16, F32), (F32, BF16), (BF16, F16)])
def test_binary_mixed_dtypes_give_f32(rt: Runner, op, fn, a_dtype, b_dtype):
    ad, bd = rt.random(4, 9, dtype=a_dtype), rt.random(9, dtype=b_dtype)
    got = rt.run1(op(rt.input("a", ad), rt.input("b", bd)))
    assert got.dtype == np.float32
    close(got, fn(as_f64(ad, a_dtype), as_f64(bd, b_dtype)))


def test_binary_on_a_transposed_operand(rt: Runner):
    ad, bd = rt.random(6, 4), rt.random(6)
    got = rt.run1(ops.mul(ops.transpose(rt.input("a", ad)), rt.input("b", bd)))
    close(got, ad.T.astype(np.float64) * bd)


UNARY = [
    ("scale", lambda a: ops.scale(a, -0.37), lambda x: x * -0.37),
    ("silu", ops.silu, ref_silu),
    ("gelu", ops.gelu, ref_gelu_exact),
    ("rms_norm", lambda a: ops.rms_norm(a, 1e-5), lambda x: ref_rms_norm(x, 1e-5)),
    ("norm", lambda a: ops.norm(a, 1e-6), lambda x: ref_norm(x, 1e-6)),
]


@pytest.mark.parametrize("name,op,ref", UNARY, ids=[u[0] for u in UNARY])
@pytest.mark.parametrize("dtype", FLOATS)
def test_unary(rt: Runner, name, op, ref, dtype: DType):
    xd = rt.random(3, 13, dtype=dtype, scale=3.0)
    got = rt.run1(op(rt.input("x", xd)))
    assert got.dtype == np.float32
    close(got, ref(as_f64(xd, dtype)), tol=1e-5)


@pytest.mark.parametrize("name,op,ref", UNARY, ids=[u[0] for u in UNARY])
def test_unary_on_a_permuted_view(rt: Runner, name, op, ref):
    xd = rt.random(5, 3, 7)
    got = rt.run1(op(ops.permute(rt.input("x", xd), (1, 0, 2))))
    close(got, ref(xd.astype(np.float64).transpose(1, 0, 2)))


def test_rms_norm_eps_matters(rt: Runner):
    """A large eps shrinks the result: eps is added to the mean square, not ignored."""
    xd = rt.random(2, 5, scale=0.01)
    got = rt.run1(ops.rms_norm(rt.input("x", xd), 1.0))
    close(got, ref_rms_norm(xd.astype(np.float64), 1.0))


@pytest.mark.parametrize("op,act", [(ops.swiglu, ref_silu), (ops.geglu, ref_gelu_exact)])
@pytest.mark.parametrize("dtype", FLOATS)
def test_gated(rt: Runner, op, act, dtype: DType):
    gd, ud = rt.random(5, 11, dtype=dtype, scale=2.0), rt.random(5, 11, dtype=dtype)
    got = rt.run1(op(rt.input("gate", gd), rt.input("up", ud)))
    close(got, act(as_f64(gd, dtype)) * as_f64(ud, dtype))


# ---- mul_mat ------------------------------------------------------------------------------

@pytest.mark.parametrize("w_dtype", FLOATS)
@pytest.mark.parametrize("act_quant", [None, "f16"])
def test_mul_mat_weight_times_batch(rt: Runner, w_dtype: DType, act_quant):
    """A 2-d weight [M, K] times activations [N, K] gives [N, M]. A weight marked act_quant f16
    (llama numerics, as the KV cache is) sees the activations rounded to f16 first."""
    wd, xd = rt.random(9, 13, dtype=w_dtype), rt.random(5, 13)
    w = rt.weight("w", wd)
    if act_quant:
        w.params["act_quant"] = act_quant
    got = rt.run1(ops.mul_mat(w, rt.input("x", xd)))
    assert got.shape == (5, 9)
    x_seen = xd.astype(np.float16) if act_quant else xd
    close(got, ref_mul_mat(as_f64(wd, w_dtype), x_seen.astype(np.float64)), tol=1e-4)


@pytest.mark.parametrize("act_quant,block", [("q8_0", 32), ("q8_k", 256)])
def test_mul_mat_rounds_activations_to_8_bit_blocks(rt: Runner, act_quant, block):
    """Against a weight marked q8_0 / q8_k, activations are rounded in blocks of 32 / 256 values to
    multiples of amax/127 (an f16 scale for q8_0, f32 for q8_k), as llama.cpp's vec_dot types hold them."""
    wd, xd = rt.random(7, 2 * block), rt.random(3, 2 * block)
    w = rt.weight("w", wd)
    w.params["act_quant"] = act_quant
    got = rt.run1(ops.mul_mat(w, rt.input("x", xd)))
    blocks = xd.astype(np.float64).reshape(3, 2, block)
    d = np.abs(blocks).max(axis=-1, keepdims=True) / 127
    if act_quant == "q8_0":
        d = d.astype(np.float16).astype(np.float64)
    x_seen = (np.round(blocks / d) * d).reshape(3, 2 * block)
    close(got, ref_mul_mat(wd.astype(np.float64), x_seen), tol=1e-4)


def test_mul_mat_2d_weight_broadcasts_over_a_3d_batch(rt: Runner):
    wd, xd = rt.random(6, 7), rt.random(3, 4, 7)
    got = rt.run1(ops.mul_mat(rt.weight("w", wd), rt.input("x", xd)))
    close(got, ref_mul_mat(wd.astype(np.float64), xd.astype(np.float64)), tol=1e-4)


@pytest.mark.parametrize("h_kv,h_q", [(1, 4), (2, 6), (3, 3)])
def test_mul_mat_grouped_query_heads(rt: Runner, h_kv: int, h_q: int):
    """a [Hkv, M, K] against b [Hq, N, K]: query head h reads kv head h // (Hq / Hkv)."""
    ad, bd = rt.random(h_kv, 5, 8), rt.random(h_q, 3, 8)
    got = rt.run1(ops.mul_mat(rt.input("k", ad), rt.input("q", bd)))
    assert got.shape == (h_q, 3, 5)
    close(got, ref_mul_mat(ad.astype(np.float64), bd.astype(np.float64)), tol=1e-4)


def test_mul_mat_grouped_query_4d(rt: Runner):
    ad, bd = rt.random(2, 2, 5, 8), rt.random(2, 6, 3, 8)
    got = rt.run1(ops.mul_mat(rt.input("k", ad), rt.input("q", bd)))
    close(got, ref_mul_mat(ad.astype(np.float64), bd.astype(np.float64)), tol=1e-4)


def test_mul_mat_attention_with_permuted_operands(rt: Runner):
    """Attention as a model builds it: k and q are [tokens, heads, dim] permuted to
    [heads, tokens, dim]; v is permuted to [heads, dim, tokens]; all non-contiguous."""
    n_tok, h_kv, h_q, d = 7, 2, 4, 6
    kd, qd, vd = rt.random(n_tok, h_kv, d), rt.random(n_tok, h_q, d), rt.random(n_tok, h_kv, d)
    k = ops.permute(rt.input("k", kd), (1, 0, 2))
    q = ops.permute(rt.input("q", qd), (1, 0, 2))
    v = ops.permute(rt.input("v", vd), (1, 2, 0))
    kq = ops.mul_mat(k, q, name="kq")
    kqv = ops.mul_mat(v, kq, name="kqv")
    got_kq, got_kqv = rt.run(kq, kqv)
    k64, q64, v64 = (x.astype(np.float64) for x in (kd, qd, vd))
    want_kq = ref_mul_mat(k64.transpose(1, 0, 2), q64.transpose(1, 0, 2))
    close(got_kq, want_kq, tol=1e-4)
    close(got_kqv, ref_mul_mat(v64.transpose(1, 2, 0), want_kq), tol=1e-4)


def test_mul_mat_f16_activations(rt: Runner):
    wd, xd = rt.random(4, 6), rt.random(3, 6, dtype=F16)
    got = rt.run1(ops.mul_mat(rt.weight("w", wd), rt.input("x", xd)))
    close(got, ref_mul_mat(wd.astype(np.float64), xd.astype(np.float64)), tol=1e-4)


# ---- rope ---------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", [ops.ROPE_NORMAL, ops.ROPE_NEOX], ids=["normal", "neox"])
@pytest.mark.parametrize("n_dims,base,fscale", [(8, 10000.0, 1.0), (4, 10000.0, 1.0), (6, 500000.0, 0.25)])
def test_rope(rt: Runner, mode: int, n_dims: int, base: float, fscale: float):
    """Rotation of the first n_dims of each head at the positions given by an i32 input."""
    xd = rt.random(5, 3, 8)
    pos = np.array([0, 1, 7, 130, 4095], dtype=np.int32)
    got = rt.run1(ops.rope(rt.input("x", xd), rt.input("pos", pos), n_dims, mode, base, fscale))
    want = ref_rope(xd.astype(np.float64), pos.astype(np.float64), n_dims, mode == ops.ROPE_NEOX, base, fscale)
    close(got, want, tol=1e-4)


def ref_rope_yarn(x, pos, n_dims, neox, base, fscale, yarn: ops.Yarn):
    """ggml's rope_yarn (ggml-cpu ops.cpp) transcribed: per pair i0 = 2i the angle ramps from the
    interpolated to the original one between the corrections of beta_fast and beta_slow; cos and sin scaled."""
    def corr(n_rot):
        return n_dims * math.log(yarn.n_ctx_orig / (n_rot * 2 * math.pi)) / (2 * math.log(base))
    low, high = max(0, math.floor(corr(yarn.beta_fast))), min(n_dims - 1, math.ceil(corr(yarn.beta_slow)))
    mscale = yarn.attn_factor * (1 + 0.1 * math.log(1 / fscale))
    out = x.copy()
    for i in range(n_dims // 2):
        extrap = pos[:, None] * base ** (-2 * i / n_dims)
        mix = (1 - min(1, max(0, (i - low) / max(0.001, high - low)))) * yarn.ext_factor
        theta = fscale * extrap * (1 - mix) + extrap * mix
        j0, j1 = (i, i + n_dims // 2) if neox else (2 * i, 2 * i + 1)
        x0, x1 = x[:, :, j0], x[:, :, j1]
        out[:, :, j0] = (x0 * np.cos(theta) - x1 * np.sin(theta)) * mscale
        out[:, :, j1] = (x0 * np.sin(theta) + x1 * np.cos(theta)) * mscale
    return out


@pytest.mark.parametrize("attn_factor", [1.0, 0.8])
def test_rope_yarn(rt: Runner, attn_factor: float):
    """gpt-oss's YaRN (factor 32 over 4096 positions, base 150000): fast pairs keep their angles, slow ones are
    interpolated, a ramp between; the cached keys' RoPE (rope_set_rows) turns them alike."""
    yarn = ops.Yarn(1.0, attn_factor, 32.0, 1.0, 4096)
    xd = rt.random(5, 3, 64)
    pos = np.array([0, 1, 7, 130, 4095], dtype=np.int32)
    got = rt.run1(ops.rope(rt.input("x", xd), rt.input("pos", pos), 64, ops.ROPE_NEOX, 150000.0, 1 / 32, yarn=yarn))
    want = ref_rope_yarn(xd.astype(np.float64), pos.astype(np.float64), 64, True, 150000.0, 1 / 32, yarn)
    close(got, want, tol=1e-4)
    plain = ref_rope(xd.astype(np.float64), pos.astype(np.float64), 64, True, 150000.0, 1 / 32)
    assert np.abs(want - plain).max() > 0.1  # the ramp matters at these positions
    cache = rt.input("cache", np.zeros((6, 3 * 64), np.float32))
    idx = np.array([5, 0, 2, 1, 3], dtype=np.int32)
    stored = rt.run1(ops.rope_set_rows(cache, rt.input("k", xd), rt.input("idx", idx), rt.input("pos", pos), 64,
                                       ops.ROPE_NEOX, 150000.0, 1 / 32, yarn=yarn))
    close(stored[idx].reshape(5, 3, 64), want, tol=1e-4)


def test_rope_on_a_reshaped_projection_in_f16(rt: Runner):
    xd = rt.random(4, 12, dtype=F16)
    pos = np.array([3, 2, 1, 0], dtype=np.int32)
    x = ops.reshape(rt.input("x", xd), (4, 2, 6))
    got = rt.run1(ops.rope(x, rt.input("pos", pos), 6, ops.ROPE_NEOX))
    want = ref_rope(xd.astype(np.float64).reshape(4, 2, 6), pos.astype(np.float64), 6, True, 10000.0, 1.0)
    close(got, want, tol=1e-4)


def test_rope_position_zero_is_identity(rt: Runner):
    xd = rt.random(2, 2, 4)
    got = rt.run1(ops.rope(rt.input("x", xd), rt.input("pos", np.zeros(2, np.int32)), 4))
    close(got, xd.astype(np.float64), tol=1e-6)


# ---- soft_max -----------------------------------------------------------------------------

def test_soft_max_without_mask(rt: Runner):
    xd = rt.random(3, 4, 9, scale=4.0)
    got = rt.run1(ops.soft_max(rt.input("x", xd)))
    close(got, ref_softmax(xd.astype(np.float64)))


def test_soft_max_scale(rt: Runner):
    xd = rt.random(5, 7, scale=4.0)
    got = rt.run1(ops.soft_max(rt.input("x", xd), scale=0.125))
    close(got, ref_softmax(xd.astype(np.float64), scale=0.125))


@pytest.mark.parametrize("mask_dtype", FLOATS)
def test_soft_max_causal_mask_with_more_rows_than_input(rt: Runner, mask_dtype: DType):
    """The mask is padded to 8 rows for 5 query rows; it broadcasts over 3 heads."""
    n_q, n_kv = 5, 6
    mask = np.triu(np.full((8, n_kv), -np.inf, dtype=np.float32), k=1 + n_kv - n_q)
    mask[n_q:] = -7.0  # padding rows the kernel must not read
    mask[:, 0] += -0.5  # a finite, non-trivial value
    mask_stored = f32_to_bf16(mask) if mask_dtype is BF16 else mask.astype(mask_dtype.np_dtype)
    xd = rt.random(3, n_q, n_kv, scale=3.0)
    got = rt.run1(ops.soft_max(rt.input("kq", xd), rt.input("mask", mask_stored), scale=0.3))
    close(got, ref_softmax(xd.astype(np.float64), as_f64(mask_stored, mask_dtype), scale=0.3))
    assert np.all(got[:, 0, 2:] == 0)


def test_soft_max_with_sinks(rt: Runner):
    """gpt-oss's attention sinks: each head's rows normalised with one more logit, sinks[head], left out."""
    n_q, n_kv = 4, 6
    mask = np.triu(np.full((n_q, n_kv), -np.inf, dtype=np.float32), k=1 + n_kv - n_q)
    xd = rt.random(3, n_q, n_kv, scale=3.0)
    sinks = np.array([0.5, -2.0, 4.0], dtype=np.float32)
    got = rt.run1(ops.soft_max(rt.input("kq", xd), rt.input("mask", mask), scale=0.5, sinks=rt.input("sinks", sinks)))
    logits = np.concatenate([xd.astype(np.float64) * 0.5 + mask, np.broadcast_to(sinks[:, None, None], (3, n_q, 1))], -1)
    close(got, ref_softmax(logits)[..., :n_kv])
    assert np.all(got.sum(axis=-1) < 1)


def test_swiglu_oai(rt: Runner):
    """gpt-oss's gated unit: x = min(gate, 7), x sigmoid(1.702 x) (clamp(up, -7, 7) + 1)."""
    gd, ud = rt.random(5, 11, scale=6.0), rt.random(5, 11, scale=6.0)
    got = rt.run1(ops.swiglu_oai(rt.input("gate", gd), rt.input("up", ud), 1.702, 7.0))
    x = np.minimum(gd.astype(np.float64), 7.0)
    close(got, x / (1 + np.exp(-1.702 * x)) * (np.clip(ud.astype(np.float64), -7, 7) + 1))


@pytest.mark.parametrize("n", [1, 5, 64])
def test_flash_attn_with_sinks(rt: Runner, n: int):
    """The fused attention with gpt-oss's sinks: head h's rows normalised with one more logit, sinks[h], whose
    share is dropped, as soft_max's sinks; grouped heads, a causal mask, one token, a few, a tiled prompt."""
    hq, hk, n_kv, d, scale = 4, 2, 70, 16, 0.25
    mask = np.triu(np.full((n, n_kv), -np.inf, dtype=np.float32), k=1 + n_kv - n)
    qd, kd, vd = rt.random(hq, n, d, scale=2.0), rt.random(n_kv, hk, d), rt.random(n_kv, hk, d)
    sinks = np.array([0.5, -2.0, 4.0, 30.0], dtype=np.float32)  # the last outweighs every cell
    keys, vals = (ops.permute(rt.input(name, x), (1, 0, 2)) for name, x in (("k", kd), ("v", vd)))
    got = rt.run1(ops.flash_attn(rt.input("q", qd), keys, vals, rt.input("mask", mask.astype(np.float16)), scale,
                                 sinks=rt.weight("sinks", sinks)))
    kh, vh = (np.repeat(x.transpose(1, 0, 2).astype(np.float64), hq // hk, axis=0) for x in (kd, vd))
    scores = np.einsum("htd,hcd->htc", qd.astype(np.float64), kh) * scale + mask
    logits = np.concatenate([scores, np.broadcast_to(sinks[:, None, None], (hq, n, 1))], -1)
    want = np.einsum("htc,hcd->thd", ref_softmax(logits)[..., :n_kv], vh)
    close(got, want, tol=1e-4)
    assert np.abs(got[:, 3]).max() < 1e-6  # the sink takes all but exp(-20)-ish of the last head's weight


def test_soft_max_of_f16_input(rt: Runner):
    xd = rt.random(2, 10, dtype=F16)
    got = rt.run1(ops.soft_max(rt.input("x", xd)))
    close(got, ref_softmax(xd.astype(np.float64)))


# ---- bad use of the API -------------------------------------------------------------------

def _leaf(name: str, shape: tuple[int, ...], dtype: DType = F32):
    return new_tensor(name, dtype, shape, is_input=True)


def _raises_naming(*names: str):
    """Context manager: a GraphError whose message names every one of `names`."""
    class _Check:
        def __enter__(self):
            self.ctx = pytest.raises(GraphError)
            self.info = self.ctx.__enter__()

        def __exit__(self, *exc):
            handled = self.ctx.__exit__(*exc)
            for n in names:
                assert n in str(self.info.value), f"{n!r} not named in: {self.info.value}"
            return handled
    return _Check()


def test_add_shape_mismatch_names_both_tensors():
    with _raises_naming("lhs_t", "rhs_t", "[3, 4]", "[5]"):
        ops.add(_leaf("lhs_t", (3, 4)), _leaf("rhs_t", (5,)))


def test_mul_whose_second_operand_is_bigger_is_refused():
    with _raises_naming("small", "big"):
        ops.mul(_leaf("small", (4,)), _leaf("big", (3, 4)))


def test_mul_mat_inner_dimension_mismatch_names_both_tensors():
    with _raises_naming("w_q", "cur"):
        ops.mul_mat(_leaf("w_q", (8, 16)), _leaf("cur", (3, 15)))


def test_mul_mat_heads_that_do_not_divide_are_refused():
    with _raises_naming("kv", "q"):
        ops.mul_mat(_leaf("kv", (3, 5, 8)), _leaf("q", (4, 2, 8)))


def test_silu_of_i32_names_the_tensor():
    with _raises_naming("tokens", "i32"):
        ops.silu(_leaf("tokens", (4,), I32))


def test_get_rows_with_f32_ids_names_the_ids():
    with _raises_naming("ids_f"):
        ops.get_rows(_leaf("table", (10, 4)), _leaf("ids_f", (3,)))


def test_rope_with_f32_positions_is_refused():
    with _raises_naming("q_cur", "pos_f"):
        ops.rope(_leaf("q_cur", (3, 2, 4)), _leaf("pos_f", (3,)), 4)


def test_rope_with_odd_n_dims_is_refused():
    with _raises_naming("q_cur"):
        ops.rope(_leaf("q_cur", (3, 2, 4)), _leaf("pos", (3,), I32), 3)


def test_soft_max_mask_with_too_few_rows_is_refused():
    with _raises_naming("scores", "kq_mask"):
        ops.soft_max(_leaf("scores", (2, 5, 6)), _leaf("kq_mask", (4, 6)))


def test_flash_attn_sinks_of_the_wrong_shape_are_refused():
    q, kv = _leaf("q_heads", (4, 3, 16)), _leaf("kv", (2, 8, 16))
    with _raises_naming("q_heads", "sinks_2", "[2]"):
        ops.flash_attn(q, kv, kv, _leaf("mask", (3, 8), F16), 0.25, sinks=_leaf("sinks_2", (2,)))
    with _raises_naming("sinks_f16"):
        ops.flash_attn(q, kv, kv, _leaf("mask", (3, 8), F16), 0.25, sinks=_leaf("sinks_f16", (4,), F16))


def test_swiglu_shape_mismatch_is_refused():
    with _raises_naming("gate", "up"):
        ops.swiglu(_leaf("gate", (2, 6)), _leaf("up", (2, 5)))


def test_concat_of_different_dtypes_is_refused():
    with _raises_naming("a16", "a32"):
        ops.concat(_leaf("a16", (2, 3), F16), _leaf("a32", (2, 3)), 0)


def test_reshape_of_a_non_contiguous_view_is_refused():
    with _raises_naming("mat"):
        ops.reshape(ops.transpose(_leaf("mat", (2, 3))), (6,))


def test_reshape_to_a_different_element_count_is_refused():
    with _raises_naming("mat"):
        ops.reshape(_leaf("mat", (2, 3)), (4, 2))


def test_view_past_the_end_is_refused():
    with _raises_naming("mat"):
        ops.view(_leaf("mat", (2, 3)), (2, 3), offset=4)


def test_permute_with_repeated_axes_is_refused():
    with _raises_naming("mat"):
        ops.permute(_leaf("mat", (2, 3)), (0, 0))


def test_cpy_with_different_element_counts_is_refused():
    with _raises_naming("src6", "dst4"):
        ops.cpy(_leaf("src6", (6,)), _leaf("dst4", (4,)))


def test_set_rows_with_f32_indices_is_refused():
    with _raises_naming("idx_f"):
        ops.set_rows(_leaf("cache", (8, 4)), _leaf("rows", (2, 4)), _leaf("idx_f", (2,)))


def test_gelu_f16_table_is_ggmls_lookup(rt: Runner):
    """With f16_table (llama numerics) gelu and geglu give ggml's table values, within f16 precision
    of the exact function."""
    x = np.linspace(-12, 12, 2001, dtype=np.float32).reshape(1, -1)
    up = np.linspace(0.5, 1.5, 2001, dtype=np.float32).reshape(1, -1)
    got = rt.run1(ops.gelu(rt.input("x", x), f16_table=True))
    close(got, ref_gelu(x), tol=1e-3)  # within one f16 step of the table value
    np.testing.assert_allclose(got, ref_gelu_exact(x.astype(np.float64)), rtol=2e-3, atol=2e-3)
    got = rt.run1(ops.geglu(rt.input("g", x), rt.input("u", up), f16_table=True))
    close(got, ref_gelu(x) * up, tol=1e-5)


# ---- fused ops: the reference kernels and the CPU's compiled ones against the formulas ------------

@pytest.fixture(params=["reference", "cpu"])
def both(request) -> Runner:
    """A runner on the reference array kernels, then on the CPU backend (compiled kernels)."""
    from ggrun.core.backends.op_harness import ReferenceBackend

    return Runner(seed=99, backend=ReferenceBackend() if request.param == "reference" else None)


def test_rms_norm_mul_is_the_norm_times_its_weight(both: Runner):
    xd, wd = both.random(5, 3, 12, scale=3.0), both.random(12)
    got = both.run1(ops.rms_norm_mul(both.input("x", xd), both.weight("w", wd), 1e-5))
    close(got, ref_rms_norm(xd.astype(np.float64), 1e-5) * wd)


@pytest.mark.parametrize("post", [False, True])
def test_add_rms_norm_gives_the_stream_and_its_norm(both: Runner, post: bool):
    """[0] = x + h (x + rms_norm(h) * post with post), [1] = rms_norm([0]) * w."""
    xd, hd, wd, pd = both.random(4, 10), both.random(4, 10, scale=2.0), both.random(10), both.random(10)
    p = both.weight("p", pd) if post else None
    got = both.run1(ops.add_rms_norm(both.input("x", xd), both.input("h", hd), both.weight("w", wd), 1e-6, post=p))
    x, h = xd.astype(np.float64), hd.astype(np.float64)
    stream = x + (ref_rms_norm(h, 1e-6) * pd if post else h)
    assert got.shape == (2, 4, 10)
    close(got[0], stream)
    close(got[1], ref_rms_norm(stream, 1e-6) * wd)


def test_rope_with_norm_and_out_scale(both: Runner):
    """norm, then rotation, then out_scale: gemma3's queries in one node."""
    xd, wd = both.random(3, 2, 8, scale=2.0), both.random(8)
    pos = np.array([0, 5, 900], dtype=np.int32)
    got = both.run1(ops.rope(both.input("x", xd), both.input("pos", pos), 8, ops.ROPE_NEOX, 10000.0, out_scale=0.5,
                             norm=both.weight("w", wd), eps=1e-6))
    normed = ref_rms_norm(xd.astype(np.float64), 1e-6) * wd
    close(got, 0.5 * ref_rope(normed, pos.astype(np.float64), 8, True, 10000.0, 1.0), tol=1e-4)


@pytest.mark.parametrize("dtype", [F32, F16])
def test_rope_set_rows_writes_rotated_rows(both: Runner, dtype: DType):
    """Each token's rotated heads land side by side in its cache row; other rows keep their values."""
    xd = both.random(3, 2, 6)
    pos, idx = np.array([4, 1, 30], dtype=np.int32), np.array([7, 0, 3], dtype=np.int32)
    cache = both.random(8, 12, dtype=dtype)
    got = both.run1(ops.rope_set_rows(both.weight("cache", cache), both.input("x", xd), both.input("idx", idx),
                                      both.input("pos", pos), 6, ops.ROPE_NORMAL))
    want = cache.astype(np.float64)
    rotated = ref_rope(xd.astype(np.float64), pos.astype(np.float64), 6, False, 10000.0, 1.0)
    want[idx] = rotated.reshape(3, 12)
    close(got, want, tol=1e-3 if dtype is F16 else 1e-5)
    untouched = np.setdiff1d(np.arange(8), idx)
    assert np.array_equal(got[untouched], cache[untouched])


def test_rope_set_rows_is_refused_with_rows_of_the_wrong_width():
    with _raises_naming("cache", "k"):
        ops.rope_set_rows(_leaf("cache", (8, 10)), _leaf("k", (2, 2, 4)), _leaf("idx", (2,), I32),
                          _leaf("pos", (2,), I32), 4)


def test_add_rms_norm_of_different_shapes_is_refused():
    with _raises_naming("x", "h"):
        ops.add_rms_norm(_leaf("x", (2, 8)), _leaf("h", (3, 8)), _leaf("w", (8,)), 1e-5)


def test_a_norm_weight_that_does_not_span_the_last_axis_is_refused():
    with _raises_naming("x", "w"):
        ops.rms_norm_mul(_leaf("x", (2, 8)), _leaf("w", (4,)), 1e-5)
