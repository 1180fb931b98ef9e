"""Array kernels for every op, written against the numpy API so that cupy runs them too.

Each kernel writes a node's result into `out`, the array over its planned memory; it may
use temporaries of its own but never returns a new array as a node's result. Kernels of
in-place-capable ops must be correct when `out` aliases their first source.
"""
from __future__ import annotations

import math
from typing import Any, Callable

from ggrun.core.dtypes import DType
from ggrun.core.ops import ROPE_NEOX
from ggrun.core.tensor import Tensor

Kernel = Callable[[Any, Tensor, Any, list], None]
KERNELS: dict[str, Kernel] = {}


def kernel(op: str):
    def register(fn: Kernel) -> Kernel:
        KERNELS[op] = fn
        return fn
    return register


def widen(xp, a, dtype: DType):
    """Float view of stored values: bf16 (uint16 storage) becomes f32; others pass through."""
    if dtype is DType.BF16:
        return (a.astype(xp.uint32) << 16).view(xp.float32)
    return a


def narrow_into(xp, out, values, dtype: DType) -> None:
    """Store float values into `out` of storage type dtype (bf16 rounds to nearest even)."""
    if dtype is DType.BF16:
        bits = xp.asarray(values, dtype=xp.float32).view(xp.uint32)
        out[...] = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(xp.uint16)
    else:
        out[...] = values


def _f(xp, node: Tensor, i: int, a):
    return widen(xp, a, node.srcs[i].dtype)


@kernel("cont")
def _cont(xp, node, out, srcs):
    out[...] = srcs[0]


@kernel("copy")
def _copy(xp, node, out, srcs):
    out[...] = srcs[0]


@kernel("cast")
def _cast(xp, node, out, srcs):
    narrow_into(xp, out, _f(xp, node, 0, srcs[0]), node.dtype)


@kernel("cpy")
def _cpy(xp, node, out, srcs):
    src = _f(xp, node, 0, srcs[0])
    narrow_into(xp, out, src.reshape(out.shape), node.dtype)


@kernel("set_rows")
def _set_rows(xp, node, out, srcs):
    _, rows, idx = srcs
    rows = _f(xp, node, 1, rows)
    if node.dtype.is_quantized:
        out[idx] = cache_blocks(xp, node.srcs[0], rows)
        return
    if node.dtype is DType.BF16:
        tmp = xp.empty(rows.shape, dtype=xp.uint16)
        narrow_into(xp, tmp, rows, node.dtype)
        rows = tmp
    out[idx] = rows


def dequantized(xp, a, dtype: DType):
    """Rows of GGUF blocks [rows, row bytes] decoded to f32 [rows, elements] (numpy only: a backend
    without block-format kernels is given its weights as f32)."""
    from ggrun.core.quants import dequantize

    rows = a.reshape(-1, a.shape[-1])
    return dequantize(xp.ascontiguousarray(rows).reshape(-1), dtype.name,
                      (rows.shape[0], rows.shape[1] // dtype.type_size * dtype.block_size))


def block_rows(xp, t: Tensor, a):
    """A block-quantized tensor's stored bytes as an array [..., bytes of one row] with t's strides,
    from the array a backend gives for it (flat bytes for a view that is not contiguous, such as
    the heads of a quantized KV cache)."""
    flat = a.reshape(-1)
    shape = t.shape[:-1] + (t.dtype.row_bytes(t.shape[-1]),)
    strides = t.strides[:-1] + (1,)
    if sum((n - 1) * s for n, s in zip(shape, strides)) >= flat.size:
        raise ValueError(f"{t.describe()}: its strides reach past its bytes")
    return xp.lib.stride_tricks.as_strided(flat, shape, strides)


def cache_values(xp, t: Tensor, a):
    """A (view of a) KV cache as f32 values: blocks decoded, f16 and bf16 widened."""
    if t.dtype.is_quantized:
        return dequantized(xp, block_rows(xp, t, a), t.dtype).reshape(t.shape)
    return widen(xp, a, t.dtype).astype(xp.float32)


def walsh_hadamard(xp, x, n: int):
    """x's last axis, in chunks of n (a power of two), turned by the orthonormal Walsh-Hadamard
    transform, as ggml's CPU computes llama.cpp's rotation of quantized KV caches (attn_rot,
    ggml_compute_forward_fwht): scaled by 1/sqrt(n) first, then butterflies (u + v, u - v) of
    width 1, 2, 4, ... n/2. Returns a new f32 array; the transform is its own inverse."""
    y = xp.ascontiguousarray(x, dtype=xp.float32) * (xp.float32(1) / xp.sqrt(xp.float32(n)))
    width = 1
    while width < n:
        pairs = y.reshape(-1, n // (2 * width), 2, width)
        u, v = pairs[:, :, 0] + pairs[:, :, 1], pairs[:, :, 0] - pairs[:, :, 1]
        pairs[:, :, 0], pairs[:, :, 1] = u, v
        width *= 2
    return y


def cache_blocks(xp, cache: Tensor, rows):
    """f32 rows [k, n] as a block-quantized cache stores them: turned by the cache's Walsh-Hadamard
    rotation when it has one (param `hadamard`: its size), then quantized as ggml's CPU does."""
    from ggrun.core.quants import quantize

    n = cache.root.params.get("hadamard")
    if n:
        rows = walsh_hadamard(xp, rows, n)
    return quantize(rows, cache.dtype.name)


@kernel("get_rows")
def _get_rows(xp, node, out, srcs):
    a, ids = srcs
    dtype = node.srcs[0].dtype
    if dtype.is_quantized:
        out[...] = dequantized(xp, a[ids], dtype)
    elif dtype is DType.F32:
        xp.take(a, ids, axis=0, out=out)
    else:
        out[...] = widen(xp, a[ids], node.srcs[0].dtype)


@kernel("concat")
def _concat(xp, node, out, srcs):
    # both sources and the result share one dtype: move the stored values (bf16 bits too) unwidened
    xp.concatenate([srcs[0], srcs[1]], axis=node.params["axis"], out=out)


@kernel("add")
def _add(xp, node, out, srcs):
    xp.add(_f(xp, node, 0, srcs[0]), _f(xp, node, 1, srcs[1]), out=out)


@kernel("mul")
def _mul(xp, node, out, srcs):
    xp.multiply(_f(xp, node, 0, srcs[0]), _f(xp, node, 1, srcs[1]), out=out)


@kernel("scale")
def _scale(xp, node, out, srcs):
    xp.multiply(_f(xp, node, 0, srcs[0]), xp.float32(node.params["s"]), out=out)


@kernel("softcap")
def _softcap(xp, node, out, srcs):
    cap = xp.float32(node.params["cap"])
    xp.multiply(xp.tanh(xp.multiply(_f(xp, node, 0, srcs[0]), xp.float32(1.0) / cap)), cap, out=out)


def _silu_into(xp, a, out) -> None:
    t = xp.negative(a, dtype=xp.float32)
    xp.exp(t, out=t)
    t += 1
    xp.divide(a, t, out=out)


_GELU_C = math.sqrt(2.0 / math.pi)


def _gelu_into(xp, a, out) -> None:
    """GELU (tanh form) as ggml's CPU computes it: looked up for the f16-rounded input, the
    result rounded to f16 (its table), and x or 0 for |x| >= 10 where the table ends."""
    x = a.astype(xp.float32)  # a copy: out may alias a
    _gelu_exact_into(xp, x.astype(xp.float16).astype(xp.float32), out)
    out[...] = out.astype(xp.float16)
    out[...] = xp.where(xp.abs(x) >= 10, xp.where(x > 0, x, 0), out)


def _gelu_exact_into(xp, a, out) -> None:
    t = xp.multiply(a, a, dtype=xp.float32)
    t *= 0.044715
    t += 1
    t *= a
    t *= _GELU_C
    xp.tanh(t, out=t)
    t += 1
    t *= a
    xp.multiply(t, 0.5, out=out)


@kernel("silu")
def _silu(xp, node, out, srcs):
    _silu_into(xp, _f(xp, node, 0, srcs[0]), out)


def _gelu_for(node):
    return _gelu_into if node.params.get("f16_table") else _gelu_exact_into


@kernel("gelu")
def _gelu(xp, node, out, srcs):
    _gelu_for(node)(xp, _f(xp, node, 0, srcs[0]), out)


def _glu_into(xp, act, gate, up, out) -> None:
    """out = act(gate) * up (out may alias gate)."""
    act(xp, gate, out)
    xp.multiply(out, up, out=out)


@kernel("swiglu")
def _swiglu(xp, node, out, srcs):
    _glu_into(xp, _silu_into, _f(xp, node, 0, srcs[0]), _f(xp, node, 1, srcs[1]), out)


@kernel("swiglu_oai")
def _swiglu_oai(xp, node, out, srcs):
    """ggml's swiglu_oai: x = min(gate, limit), x / (1 + exp(-alpha x)) * (clamp(up, -limit, limit) + 1)."""
    alpha, limit = xp.float32(node.params["alpha"]), xp.float32(node.params["limit"])
    x = xp.minimum(_f(xp, node, 0, srcs[0]), limit)
    y = xp.clip(_f(xp, node, 1, srcs[1]), -limit, limit)
    out[...] = x / (xp.float32(1) + xp.exp(-alpha * x)) * (y + xp.float32(1))


@kernel("geglu")
def _geglu(xp, node, out, srcs):
    _glu_into(xp, _gelu_for(node), _f(xp, node, 0, srcs[0]), _f(xp, node, 1, srcs[1]), out)


def _rms_norm_into(xp, a, eps: float, out) -> None:
    ms = xp.mean(xp.square(a, dtype=xp.float32), axis=-1, keepdims=True)
    ms += eps
    xp.sqrt(ms, out=ms)
    xp.divide(a, ms, out=out)


@kernel("rms_norm")
def _rms_norm(xp, node, out, srcs):
    _rms_norm_into(xp, _f(xp, node, 0, srcs[0]), node.params["eps"], out)


@kernel("rms_norm_mul")
def _rms_norm_mul(xp, node, out, srcs):
    _rms_norm_into(xp, _f(xp, node, 0, srcs[0]), node.params["eps"], out)
    out *= _f(xp, node, 1, srcs[1])


@kernel("add_rms_norm")
def _add_rms_norm(xp, node, out, srcs):
    x, h, w = (_f(xp, node, i, s) for i, s in enumerate(srcs[:3]))
    eps = node.params["eps"]
    stream, normed = out[0], out[1]
    if len(srcs) > 3:  # h normalised by its own weight before the add
        _rms_norm_into(xp, h, eps, stream)
        stream *= _f(xp, node, 3, srcs[3])
        stream += x
    else:
        xp.add(x, h, out=stream)
    _rms_norm_into(xp, stream, eps, normed)
    normed *= w


@kernel("norm")
def _norm(xp, node, out, srcs):
    a = _f(xp, node, 0, srcs[0])
    mean = xp.mean(a, axis=-1, keepdims=True, dtype=xp.float32)
    xp.subtract(a, mean, out=out)
    var = xp.mean(xp.square(out), axis=-1, keepdims=True)
    var += node.params["eps"]
    xp.sqrt(var, out=var)
    out /= var


def _batch_split(a_batch: tuple, b_batch: tuple) -> tuple[tuple, tuple, tuple]:
    """Shapes that let a's batch broadcast over b's when a's sizes divide b's (GQA).

    b's axis of size r*k (a's size k) splits into (k, r); a gets (k, 1) there.
    """
    a_batch = (1,) * (len(b_batch) - len(a_batch)) + tuple(a_batch)
    a_shape, b_shape = [], []
    for x, y in zip(a_batch, b_batch):
        if x == y or x == 1:
            a_shape.append(x)
            b_shape.append(y)
        else:
            a_shape += [x, 1]
            b_shape += [x, y // x]
    return tuple(a_shape), tuple(b_shape), tuple(b_batch)


ACT_QUANT_BLOCKS = {"q8_0": (32, True), "q8_k": (256, False)}  # block size, scale stored as f16


def round_q8_blocks(xp, x, block: int = 32, f16_scale: bool = True):
    """x as llama.cpp's 8-bit activation blocks hold it: each block of `block` values shares the
    scale d = amax/127, stored as f16 (Q8_0, Q8_1) or f32 (Q8_K); values round to integers of d."""
    blocks = xp.ascontiguousarray(x, dtype=xp.float32).reshape(-1, block)
    d = xp.abs(blocks).max(axis=-1, keepdims=True) / 127
    if f16_scale:
        d = d.astype(xp.float16).astype(xp.float32)
    q = xp.rint(blocks * ((d > 0) / xp.where(d > 0, d, 1)))
    q *= d
    return q.reshape(x.shape)


def _mul_mat_operand_b(xp, a_t: Tensor, b):
    """The activations as llama.cpp's CPU kernels see them: rounded to 8-bit blocks against a
    block-quantized weight (`act_quant`: q8_0 blocks for the legacy types, q8_k for k-quants),
    to f16 against the f16 KV cache (`act_quant` f16), and first turned as a rotated quantized K
    cache's rows were (`hadamard`). Without `act_quant`, plain f32."""
    act_quant = a_t.root.params.get("act_quant")
    rotation = a_t.root.params.get("hadamard")
    if rotation:
        b = walsh_hadamard(xp, b, rotation)
    quant = ACT_QUANT_BLOCKS.get(act_quant)
    if quant is not None and b.shape[-1] % quant[0] == 0:
        return round_q8_blocks(xp, b, *quant)
    if act_quant == "f16":
        return b.astype(xp.float16).astype(xp.float32)
    return b if b.dtype == xp.float32 else b.astype(xp.float32)


@kernel("mul_mat")
def _mul_mat(xp, node, out, srcs):
    _product(xp, node.srcs[0], srcs[0], _f(xp, node, 1, srcs[1]), out)


@kernel("mul_mat_multi")
def _mul_mat_multi(xp, node, out, srcs):
    """Each weight's product with the last source, one after another in out."""
    b = _f(xp, node, len(srcs) - 1, srcs[-1])
    at = 0
    for w_t, w in zip(node.srcs[:-1], srcs[:-1]):
        size = b.shape[0] * w_t.shape[0]
        _product(xp, w_t, w, b, out[at:at + size].reshape(b.shape[0], w_t.shape[0]))
        at += size


@kernel("mul_mat_glu")
def _mul_mat_glu(xp, node, out, srcs):
    """The gate's product into out, the up's into a temporary, then swiglu or geglu of the two:
    mul_mat_multi's products and the swiglu/geglu kernel, computed as those nodes compute them."""
    gate_t, up_t, _ = node.srcs
    b = _f(xp, node, 2, srcs[2])
    up = xp.empty(out.shape, dtype=xp.float32)
    _product(xp, gate_t, srcs[0], b, out)
    _product(xp, up_t, srcs[1], b, up)
    act = _silu_into if node.params["glu"] == "swiglu" else _gelu_for(node)
    _glu_into(xp, act, out, up, out)


def _product(xp, a_t: Tensor, a, b, out) -> None:
    """out = b @ a^T as mul_mat computes it: a_t (a weight or the KV cache) stored as array a,
    b the f32 activations."""
    if a_t.dtype.is_quantized:
        a = cache_values(xp, a_t, a)
    elif a.dtype != xp.float32:
        a = widen(xp, a, a_t.dtype).astype(xp.float32)
    b = _mul_mat_operand_b(xp, a_t, b)
    a_batch, b_batch = a.shape[:-2], b.shape[:-2]
    if all(x == y or x == 1 for x, y in zip(reversed(a_batch), reversed(b_batch))):
        xp.matmul(b, xp.swapaxes(a, -1, -2), out=out)
        return
    a_shape, b_shape, _ = _batch_split(a_batch, b_batch)
    a2 = a.reshape(a_shape + a.shape[-2:])
    b2 = b.reshape(b_shape + b.shape[-2:])
    o2 = out.reshape(b_shape + out.shape[-2:])
    xp.matmul(b2, xp.swapaxes(a2, -1, -2), out=o2)


@kernel("moe_topk")
def _moe_topk(xp, node, out, srcs):
    out[...] = xp.argsort(-srcs[0], axis=-1, kind="stable")[:, :node.params["k"]]


@kernel("moe_weights")
def _moe_weights(xp, node, out, srcs):
    probs, ids = srcs
    w = xp.take_along_axis(probs, ids.astype(xp.int64), axis=-1)
    if node.params["norm"]:
        total = w.sum(axis=-1, keepdims=True, dtype=xp.float64).astype(xp.float32)  # ggml sums rows in double
        w = w / xp.maximum(total, xp.float32(6.103515625e-5))
    out[...] = w


@kernel("mul_mat_id")
def _mul_mat_id(xp, node, out, srcs):
    """Expert by expert among those chosen (only their matrices are read): the rows routed to it through
    its matrix, with the activation rounding mul_mat applies against it."""
    w_t = node.srcs[0]
    w, b, ids = srcs[0], _f(xp, node, 1, srcs[1]), srcs[2]
    stored = block_rows(xp, w_t, w) if w_t.dtype.is_quantized else w
    for e in sorted(set(ids.reshape(-1).tolist())):
        tok, slot = xp.nonzero(ids == e)
        rows = b[tok, slot if b.shape[1] > 1 else 0]
        if w_t.dtype.is_quantized:
            a = dequantized(xp, stored[e], w_t.dtype)
        else:
            a = widen(xp, stored[e], w_t.dtype).astype(xp.float32)
        out[tok, slot] = _mul_mat_operand_b(xp, w_t, rows) @ a.T


def rope_angles(xp, pos, n_dims: int, freq_base: float, freq_scale: float, yarn=None, factors=None):
    """cos and sin [tokens, 1, n_dims/2] of each position's rotation angles (with YaRN's, ops.Yarn, when given:
    ggml's rope_yarn, each pair's angle a ramp between the interpolated and the original one, both scaled),
    each pair's angle first divided by its frequency factor where `factors` [n_dims/2] is given."""
    inv = freq_base ** (-xp.arange(0, n_dims, 2, dtype=xp.float64) / n_dims)
    if factors is not None:
        inv = inv / factors.astype(xp.float64)
    mix, mscale = yarn_ramp(xp, yarn, n_dims, freq_base, freq_scale, xp.float64)
    theta = pos.astype(xp.float64)[:, None] * (inv * (freq_scale * (1 - mix) + mix))[None, :]
    return ((xp.cos(theta) * mscale).astype(xp.float32)[:, None, :],
            (xp.sin(theta) * mscale).astype(xp.float32)[:, None, :])


def yarn_ramp(xp, yarn, n_dims: int, freq_base: float, freq_scale: float, dtype):
    """YaRN's share of each pair's original angle [n_dims / 2] (ggml's rope_yarn_ramp times ext_factor; zeros
    without a ramp) and the scale of cos and sin (attn_factor, times 1 + 0.1 ln(1 / freq_scale) with a ramp), in
    `dtype` (float32 as ggml computes them, float64 for the reference)."""
    one = dtype(1.0)
    if yarn is None or yarn.ext_factor == 0:
        return xp.zeros(n_dims // 2, dtype=dtype), dtype(1.0 if yarn is None else yarn.attn_factor)
    low, high = (dtype(c) for c in yarn_corr_dims(n_dims, yarn.n_ctx_orig, freq_base, yarn.beta_fast,
                                                   yarn.beta_slow))
    ramp = (xp.arange(n_dims // 2, dtype=dtype) - low) / max(dtype(0.001), high - low)
    mix = (one - xp.clip(ramp, dtype(0.0), one)) * dtype(yarn.ext_factor)
    return mix.astype(dtype), dtype(yarn.attn_factor) * (one + dtype(0.1) * dtype(math.log(one / dtype(freq_scale))))


def yarn_corr_dims(n_dims: int, n_ctx_orig: int, freq_base: float, beta_fast: float, beta_slow: float):
    """ggml_rope_yarn_corr_dims: the pairs (as i0 / 2) where YaRN's ramp starts and ends."""
    def corr(n_rot: float) -> float:
        return n_dims * math.log(n_ctx_orig / (n_rot * 2 * math.pi)) / (2 * math.log(freq_base))
    return max(0.0, math.floor(corr(beta_fast))), min(n_dims - 1.0, math.ceil(corr(beta_slow)))


def _rope_into(xp, a, pos, p: dict, out, factors=None) -> None:
    """out = a rotated at positions pos (out may alias a), with frequency factors where given."""
    n = p["n_dims"]
    cos, sin = rope_angles(xp, pos, n, p["freq_base"], p["freq_scale"], p.get("yarn"), factors)
    if p["mode"] == ROPE_NEOX:
        lo, hi = slice(0, n // 2), slice(n // 2, n)
    else:
        lo, hi = slice(0, n, 2), slice(1, n, 2)
    x0 = a[..., lo].copy()
    x1 = a[..., hi].copy()
    out[..., lo] = x0 * cos - x1 * sin
    out[..., hi] = x0 * sin + x1 * cos
    if n < a.shape[-1]:
        out[..., n:] = a[..., n:]


def _rope_input(xp, node, srcs, i: int, norm_at: int):
    """The rope's input srcs[i]: as it is, or its heads rms_norm'ed times the norm weight srcs[norm_at] when the
    node fuses one."""
    a = _f(xp, node, i, srcs[i])
    if "eps" not in node.params:
        return a
    normed = xp.empty(a.shape, dtype=xp.float32)
    _rms_norm_into(xp, a, node.params["eps"], normed)
    normed *= _f(xp, node, norm_at, srcs[norm_at])
    return normed


def _rope_factors_of(node, srcs):
    """A RoPE's frequency factors (its last source), or None."""
    return srcs[-1] if node.params.get("factors") else None


@kernel("rope")
def _rope(xp, node, out, srcs):
    a = _rope_input(xp, node, srcs, 0, 2)
    _rope_into(xp, a, srcs[1], node.params, out, _rope_factors_of(node, srcs))
    s = node.params.get("out_scale", 1.0)
    if s != 1.0:
        out *= xp.float32(s)


@kernel("rope_set_rows")
def _rope_set_rows(xp, node, out, srcs):
    _, a, idx, pos = srcs[:4]
    a = _rope_input(xp, node, srcs, 1, 4)
    rows = xp.empty(a.shape, dtype=xp.float32)
    _rope_into(xp, a, pos, node.params, rows)
    if node.dtype.is_quantized:
        out[idx] = cache_blocks(xp, node.srcs[0], rows.reshape(a.shape[0], -1))
        return
    stored = xp.empty((a.shape[0], out.shape[1]), dtype=out.dtype)
    narrow_into(xp, stored, rows.reshape(stored.shape), node.dtype)
    out[idx] = stored


@kernel("rope_shift")
def _rope_shift(xp, node, out, srcs):
    """Every row of a quantized K cache decoded, turned back from its rotation, RoPE'd by its
    row's shift, turned again and quantized (llama.cpp's K-shift: cast, rope, cpy)."""
    cache, shift = node.srcs[0], srcs[1]
    p = node.params
    rows = dequantized(xp, out, cache.dtype)
    n = cache.root.params.get("hadamard")
    if n:
        rows = walsh_hadamard(xp, rows, n)
    heads = rows.reshape(rows.shape[0], -1, p["head_dim"])
    _rope_into(xp, heads, shift, p, heads, _rope_factors_of(node, srcs))
    out[...] = cache_blocks(xp, cache, rows)


@kernel("soft_max")
def _soft_max(xp, node, out, srcs):
    a = _f(xp, node, 0, srcs[0])
    xp.multiply(a, xp.float32(node.params["scale"]), out=out)
    if len(srcs) > 1:
        rows = out.shape[-2]
        out += _f(xp, node, 1, srcs[1][:rows])
    m = xp.max(out, axis=-1, keepdims=True)
    sinks = srcs[2].reshape(-1, 1, 1) if node.params.get("sinks") else None  # one more logit per head
    if sinks is not None:
        m = xp.maximum(m, sinks)
    out -= m
    xp.exp(out, out=out)
    s = xp.sum(out, axis=-1, keepdims=True)
    if sinks is not None:
        s += xp.exp(sinks - m)
    out /= s


@kernel("kq_mask")
def _kq_mask(xp, node, out, srcs):
    """The KQ mask from the cells' positions and sequence bits (ops.kq_mask)."""
    cell_pos, cell_seqs, tok_pos, tok_seq = srcs
    seq = xp.maximum(tok_seq, 0).astype(xp.int64)
    words = cell_seqs.view(xp.uint32)[:, seq // 32].T  # [tokens, cells]
    held = (words >> (seq % 32).astype(xp.uint32)[:, None]) & xp.uint32(1)
    visible = (held != 0) & (cell_pos[None, :] >= 0) & (cell_pos[None, :] <= tok_pos[:, None])
    if node.params["window"]:
        visible &= tok_pos[:, None] - cell_pos[None, :] < node.params["window"]
    pad = tok_seq < 0
    visible[pad] = False
    visible[pad, 0] = True
    out[...] = xp.where(visible, xp.float16(0), xp.float16(-xp.inf))


@kernel("argmax")
def _argmax(xp, node, out, srcs):
    """Each row's first largest value's index, -1 for a row holding NaN or infinity (ops.argmax)."""
    a = srcs[0]
    out[...] = xp.where(xp.isfinite(a).all(axis=-1), xp.argmax(a, axis=-1), -1)


@kernel("sample")
def _sample(xp, node, out, srcs):
    """Each row's token by llama.cpp's sampler chain (ops.sample), row by row as core/llm/sampling.py's
    Sampler computes it: f32 steps, the candidates' probabilities as float64 for the draw (searchsorted is given
    Python floats, which cupy's takes too)."""
    logits, params, draws, recent, bias_ids, bias_vals = srcs
    u = draws.view(xp.float64)[:, 0] if draws.flags.c_contiguous else xp.ascontiguousarray(draws).view(xp.float64)[:, 0]
    for r in range(logits.shape[0]):
        out[r] = _sample_row(xp, logits[r], params[r], float(u[r]), recent[r], bias_ids[r], bias_vals[r])


def top_k_ids(xp, x, k: int):
    """The ids of x's k largest values, largest first, equal values in order of ids (as the CPU and CUDA kernels
    rank them): argpartition's pick among values equal to the k-th is its own, so those are taken again from the
    lowest ids."""
    if k >= len(x):
        return xp.argsort(-x, kind="stable")
    ids = xp.argpartition(-x, k - 1)[:k]
    kth = x[ids].min()
    at_kth = x[ids] == kth
    n_above = k - int(xp.count_nonzero(at_kth))  # every value above the k-th is among ids
    if int(xp.count_nonzero(x == kth)) > k - n_above:
        ids = xp.concatenate([ids[~at_kth], xp.flatnonzero(x == kth)[:k - n_above]])
    ids = xp.sort(ids)
    return ids[xp.argsort(-x[ids], kind="stable")]


def _sample_row(xp, logits, params, u: float, recent, bias_ids, bias_vals) -> int:
    x = logits.astype(xp.float32, copy=True)
    if not bool(xp.isfinite(x).all()):
        return -1
    temp, top_k, top_p, min_p, rp, fp, pp = (xp.float32(v) for v in params.tolist())
    has = bias_ids >= 0
    xp.add.at(x, bias_ids[has], bias_vals[has])
    rec = recent[recent >= 0]
    if (rp != 1 or fp != 0 or pp != 0) and len(rec):
        ids, n = xp.unique(rec, return_counts=True)
        v = x[ids]
        v = xp.where(v <= 0, v * rp, v / rp)
        x[ids] = v - n.astype(xp.float32) * fp - pp
    if temp <= 0:
        return int(xp.argmax(x))
    k = int(top_k) if 0 < int(top_k) < len(x) else len(x)
    ids = top_k_ids(xp, x, k)
    vals = x[ids]
    probs = xp.exp(vals - vals[0])
    probs /= probs.sum()
    keep = len(ids)
    if top_p < 1:
        keep = min(keep, int(xp.searchsorted(xp.cumsum(probs), float(top_p))) + 1)
    if min_p > 0:
        keep = min(keep, max(1, int(xp.count_nonzero(probs >= min_p * probs[0]))))
    vals = vals[:keep]
    probs = xp.exp((vals - vals.max()) / temp)
    probs /= probs.sum()
    cdf = xp.cumsum(probs.astype(xp.float64))
    cdf /= cdf[-1]
    return int(ids[int(xp.searchsorted(cdf, u, side="right"))])


@kernel("sample_logprobs")
def _sample_logprobs(xp, node, out, srcs):
    """ops.sample_logprobs with array operations (no loop over rows): the log-softmax in f32 after the row's
    maximum, log(sum(exp)) summed in f64; the top n_probs by a stable sort of the negated logits."""
    logits, ids = srcs
    n = node.params["n_probs"]
    x = logits.astype(xp.float32, copy=False)
    shifted = x - x.max(axis=1, keepdims=True)
    lse = xp.log(xp.exp(shifted).sum(axis=1, dtype=xp.float64, keepdims=True)).astype(xp.float32)
    rows = xp.arange(x.shape[0])
    own = xp.asarray(ids).astype(xp.int64)
    out[:, 0] = xp.where(own >= 0, shifted[rows, xp.clip(own, 0, x.shape[1] - 1)] - lse[:, 0], xp.nan)
    if n:
        top = xp.argsort(-x, axis=1, kind="stable")[:, :n]
        out[:, 1::2] = top.astype(xp.float32)
        out[:, 2::2] = xp.take_along_axis(shifted, top, axis=1) - lse


FLASH_CHUNK_BYTES = 16 << 20  # bound on the score temporaries of one chunk of query rows


@kernel("flash_attn")
def _flash_attn(xp, node, out, srcs):
    """Attention over chunks of query rows, so the scores of all rows never exist at once.

    As llama.cpp's CPU path does, q meets an f16 cache as f16-rounded values, and a quantized K
    cache as Q8_0 blocks (its vec_dot type; `act_quant` on the cache), after the rotation the
    cache's rows were given (`hadamard`); the result is turned back by V's rotation. With sinks, each
    head's rows count one more logit, its sink, in the softmax's maximum and sum (soft_max's sinks).
    """
    from ggrun.core.quants import quantize

    q, k, v, mask = srcs[:4]
    hq, t, d = q.shape
    hk, n_kv, _ = node.srcs[1].shape
    r = hq // hk
    kf = cache_values(xp, node.srcs[1], k)[:, None]  # [hk, 1, n_kv, d]
    vf = cache_values(xp, node.srcs[2], v)[:, None]
    k_root, v_root = node.srcs[1].root.params, node.srcs[2].root.params
    q_round = k_root.get("act_quant")
    scale = xp.float32(node.params["scale"])
    rows = max(1, FLASH_CHUNK_BYTES // (4 * hq * max(n_kv, 1)))
    sinks = srcs[4].reshape(hk, r, 1, 1) if node.params.get("sinks") else None  # [hk, r]: head g * r + i's
    for i in range(0, t, rows):
        qc = widen(xp, q[:, i:i + rows], node.srcs[0].dtype).astype(xp.float32)
        if k_root.get("hadamard"):
            qc = walsh_hadamard(xp, qc, k_root["hadamard"])
        if q_round == "f16":
            qc = qc.astype(xp.float16).astype(xp.float32)
        elif q_round == "q8_0":
            qc = dequantized(xp, quantize(qc, "Q8_0"), DType.Q8_0).reshape(qc.shape)
        n = qc.shape[1]
        s = xp.matmul(qc.reshape(hk, r, n, d), xp.swapaxes(kf, -1, -2))  # [hk, r, n, n_kv]
        s *= scale
        s += mask[i:i + n]
        m = s.max(axis=-1, keepdims=True)
        if sinks is not None:
            m = xp.maximum(m, sinks)
        s -= m
        xp.exp(s, out=s)
        total = s.sum(axis=-1, keepdims=True)
        if sinks is not None:
            total += xp.exp(sinks - m)
        s /= total
        o = xp.swapaxes(xp.matmul(s, vf).reshape(hq, n, d), 0, 1)  # [n, hq, d]
        out[i:i + n] = walsh_hadamard(xp, o, v_root["hadamard"]) if v_root.get("hadamard") else o
