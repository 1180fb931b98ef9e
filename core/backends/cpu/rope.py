"""Compiled RoPE: rope (queries, optionally scaled after) and rope_set_rows (keys rotated and
written straight into the KV cache rows, f16, f32, or Q8_0 / Q4_0 blocks); either may first
RMS-normalise each head by a weight (gemma3's q/k norms). rope_shift re-rotates the rows of a
quantized K cache in place (the K-shift after a context shift).

Angles are computed in f32 inside the kernel as ggml's rope cache does: theta starts at the
position and is multiplied by theta_scale = base^(-2/n_dims) for each next pair; each pair
rotates by cos/sin(freq_scale * theta). rope also takes frequency factors (Llama 3's rope_freqs,
Phi-3's LongRoPE: theta / ff[i]) and a scale of cos and sin (LongRoPE's attention factor).
"""
from __future__ import annotations

import math

import numpy as np

from ggrun.core.backends.cpu.dispatch import binds
from ggrun.core.backends.cpu.jit import kernel
from ggrun.core.backends.cpu.kv_quant import CACHE_TYPES, code_of, hadamard, load_row, store_row
from ggrun.core.backends.cpu.norm import inv_rms
from ggrun.core.backends.cpu.vecmath import to_stored
from ggrun.core.backends.cpu.warmup import ROPE_FACTORS, kv, readonly, warms
from ggrun.core.backends.kernels import yarn_ramp
from ggrun.core.dtypes import DType
from ggrun.core.ops import ROPE_NEOX


@kernel(inline="always")
def _angles(p, n_dims, theta_scale, freq_scale, cos, sin):
    theta = np.float32(p)
    for i in range(n_dims // 2):
        a = freq_scale * theta
        cos[i] = math.cos(a)
        sin[i] = math.sin(a)
        theta *= theta_scale


@kernel(inline="always")
def _angles_ff(p, n_dims, theta_scale, freq_scale, ff, mix, mscale, cos, sin):
    """_angles with each pair's theta divided by its frequency factor ff[i] first, then (YaRN's ramp, ggml's
    rope_yarn) mix[i] of the original angle and the rest of the interpolated one, cos and sin times mscale.
    Zeros in mix give the interpolated angle's bits."""
    theta = np.float32(p)
    for i in range(n_dims // 2):
        extrap = theta / ff[i]
        a = freq_scale * extrap * (np.float32(1.0) - mix[i]) + extrap * mix[i]
        cos[i] = math.cos(a) * mscale
        sin[i] = math.sin(a) * mscale
        theta *= theta_scale


@kernel(inline="always")
def _rotate(x, cos, sin, n_dims, neox, scale, y):
    """y = x with its first n_dims rotated, times scale (y may alias x)."""
    half = n_dims // 2
    for i in range(half):
        j0 = i if neox else 2 * i
        j1 = j0 + half if neox else j0 + 1
        x0 = x[j0]
        x1 = x[j1]
        y[j0] = (x0 * cos[i] - x1 * sin[i]) * scale
        y[j1] = (x0 * sin[i] + x1 * cos[i]) * scale
    for j in range(n_dims, x.shape[0]):
        y[j] = x[j] * scale


@kernel(inline="always")
def _source(x, w, eps, use_norm, row):
    """x, or x rms_norm'ed and times w written into row (a head's fused q/k norm)."""
    if not use_norm:
        return x
    s = inv_rms(x, eps)
    for j in range(x.shape[0]):
        row[j] = x[j] * s * w[j]
    return row


@kernel
def rope_rows(x, pos, n_dims, neox, theta_scale, freq_scale, ff, mix, mscale, scale, w, eps, use_norm, out):
    """out[t, h] = x[t, h] (normalised times w when use_norm) rotated at position pos[t], times scale; each
    pair's angle divided by its frequency factor ff[i] (ones without factors: the same bits) and mixed by YaRN's
    ramp mix[i] (zeros without one), cos and sin times mscale (_angles_ff)."""
    cos = np.empty(n_dims // 2, dtype=np.float32)
    sin = np.empty(n_dims // 2, dtype=np.float32)
    row = np.empty(x.shape[2], dtype=np.float32)
    for t in range(x.shape[0]):
        _angles_ff(pos[t], n_dims, theta_scale, freq_scale, ff, mix, mscale, cos, sin)
        for h in range(x.shape[1]):
            _rotate(_source(x[t, h], w, eps, use_norm, row), cos, sin, n_dims, neox, scale, out[t, h])


@kernel
def rope_store(x, pos, idx, n_dims, neox, theta_scale, freq_scale, w, eps, use_norm, cache):
    """cache[idx[t]] = x[t] (normalised when use_norm) rotated at pos[t], heads side by side, in
    the cache's storage type (f16 bits as uint16, or f32)."""
    cos = np.empty(n_dims // 2, dtype=np.float32)
    sin = np.empty(n_dims // 2, dtype=np.float32)
    d = x.shape[2]
    row = np.empty(d, dtype=np.float32)
    for t in range(x.shape[0]):
        _angles(pos[t], n_dims, theta_scale, freq_scale, cos, sin)
        if idx[t] < 0 or idx[t] >= cache.shape[0]:
            raise IndexError("rope_set_rows: row index out of range")
        dst = cache[idx[t]]
        for h in range(x.shape[1]):
            _rotate(_source(x[t, h], w, eps, use_norm, row), cos, sin, n_dims, neox, np.float32(1.0), row)
            for j in range(d):
                dst[h * d + j] = to_stored(row[j], cache)


@kernel
def rope_store_blocks(x, pos, idx, n_dims, neox, theta_scale, freq_scale, w, eps, use_norm, code, rot, cache):
    """rope_store into a block-quantized cache (bytes of type `code`): each token's row of heads,
    rotated, is turned by the cache's Walsh-Hadamard rotation (rot, 0: none) and quantized."""
    cos = np.empty(n_dims // 2, dtype=np.float32)
    sin = np.empty(n_dims // 2, dtype=np.float32)
    d = x.shape[2]
    head = np.empty(d, dtype=np.float32)
    row = np.empty(x.shape[1] * d, dtype=np.float32)
    for t in range(x.shape[0]):
        _angles(pos[t], n_dims, theta_scale, freq_scale, cos, sin)
        if idx[t] < 0 or idx[t] >= cache.shape[0]:
            raise IndexError("rope_set_rows: row index out of range")
        for h in range(x.shape[1]):
            _rotate(_source(x[t, h], w, eps, use_norm, head), cos, sin, n_dims, neox, np.float32(1.0),
                    row[h * d:(h + 1) * d])
        if rot:
            hadamard(row, rot)
        store_row(code, row, cache[idx[t]])


@kernel
def rope_shift_rows(cache, shift, code, n_embd, head_dim, n_dims, neox, theta_scale, freq_scale, rot):
    """Every row of a block-quantized K cache decoded, turned back from its rotation (rot, 0:
    none), rotated by its shift, turned again and quantized back in place."""
    cos = np.empty(n_dims // 2, dtype=np.float32)
    sin = np.empty(n_dims // 2, dtype=np.float32)
    row = np.empty(n_embd, dtype=np.float32)
    for r in range(cache.shape[0]):
        load_row(code, cache[r], 0, row)
        if rot:
            hadamard(row, rot)
        _angles(shift[r], n_dims, theta_scale, freq_scale, cos, sin)
        for h in range(n_embd // head_dim):
            head = row[h * head_dim:(h + 1) * head_dim]
            _rotate(head, cos, sin, n_dims, neox, np.float32(1.0), head)
        if rot:
            hadamard(row, rot)
        store_row(code, row, cache[r])


def _params(node) -> tuple:
    p = node.params
    n_dims = int(p["n_dims"])
    theta_scale = np.float32(p["freq_base"]) ** (np.float32(-2.0) / np.float32(n_dims))  # powf, as ggml
    return n_dims, p["mode"] == ROPE_NEOX, np.float32(theta_scale), np.float32(p["freq_scale"])


def _norm(node, srcs: list, first: int, d: int) -> tuple | None:
    """(weight, eps, use) of the fused per-head norm, when the node has one (its last source)."""
    if len(srcs) == first:
        return _NO_NORM.setdefault(d, np.ones(d, dtype=np.float32)), np.float32(0.0), False
    w = srcs[first]
    if node.srcs[first].dtype is not DType.F32 or w.size != d or not w.flags.c_contiguous:
        return None
    return w.reshape(d), np.float32(node.params["eps"]), True


_NO_NORM: dict[int, np.ndarray] = {}
_NO_FACTORS: dict[int, np.ndarray] = {}


def _f32_rows(node, i: int, a: np.ndarray) -> bool:
    return node.srcs[i].dtype is DType.F32 and a.flags.c_contiguous


@binds("rope")
def bind_rope(node, out, srcs, scratch):
    """rope_rows, with the node's frequency factors (its last source) where it has them and YaRN's ramp
    (kernels.yarn_ramp, in f32) where it has one."""
    n_dims, neox, theta_scale, freq_scale = _params(node)
    has_factors = "factors" in node.params
    base = srcs[:-1] if has_factors else srcs
    ff = srcs[-1] if has_factors else _NO_FACTORS.setdefault(n_dims // 2, np.ones(n_dims // 2, dtype=np.float32))
    x, pos = base[:2]
    norm = _norm(node, base, 2, x.shape[-1])
    if not (_f32_rows(node, 0, x) and out.flags.c_contiguous and ff.flags.c_contiguous) or norm is None:
        return None
    mix, mscale = yarn_ramp(np, node.params.get("yarn"), n_dims, node.params["freq_base"], freq_scale, np.float32)
    scale = np.float32(node.params.get("out_scale", 1.0))
    return lambda: rope_rows(x, pos, n_dims, neox, theta_scale, freq_scale, ff, mix, mscale, scale, *norm, out)


@binds("rope_set_rows")
def bind_rope_set_rows(node, out, srcs, scratch):
    if "yarn" in node.params:
        return None
    x, idx, pos = srcs[1:4]
    norm = _norm(node, srcs, 4, x.shape[-1])
    if not (_f32_rows(node, 1, x) and out.flags.c_contiguous) or norm is None:
        return None
    n_dims, neox, theta_scale, freq_scale = _params(node)
    if node.dtype.is_quantized and node.dtype in CACHE_TYPES:
        code, rot = code_of(node.dtype), int(node.srcs[0].root.params.get("hadamard", 0))
        return lambda: rope_store_blocks(x, pos, idx, n_dims, neox, theta_scale, freq_scale, *norm, code, rot, out)
    if node.dtype not in (DType.F16, DType.F32):
        return None
    cache = out.view(np.uint16) if node.dtype is DType.F16 else out
    return lambda: rope_store(x, pos, idx, n_dims, neox, theta_scale, freq_scale, *norm, cache)


@binds("rope_shift")
def bind_rope_shift(node, out, srcs, scratch):
    if "yarn" in node.params or "factors" in node.params:
        return None
    cache = node.srcs[0]
    if cache.dtype not in CACHE_TYPES or not out.flags.c_contiguous:
        return None
    shift = srcs[1]
    n_dims, neox, theta_scale, freq_scale = _params(node)
    args = (code_of(cache.dtype), cache.shape[1], int(node.params["head_dim"]), n_dims, neox, theta_scale,
            freq_scale, int(cache.root.params.get("hadamard", 0)))
    return lambda: rope_shift_rows(out, shift, *args)


# ---- first-run compilation: the signatures a model's graphs meet ---------------------------------

def _warm_rope(lf, cache_dtype: DType, norm: bool):
    from ggrun.core import ops

    x = lf.input("x", np.ones((2, 2, 8), np.float32))
    pos = lf.input("pos", np.arange(2, dtype=np.int32))
    w = readonly(lf, "w", DType.F32, np.ones(8, np.float32)) if norm else None
    cache = lf.ctx.new_tensor("cache", cache_dtype, (4, 16))
    lf.ctx.backend.set_tensor(cache, np.zeros((4, 16), cache_dtype.np_dtype))
    q = ops.rope(x, pos, 8, ROPE_NEOX, norm=w, eps=1e-6)
    return ops.rope_set_rows(cache, q, pos, pos, 8, norm=w, eps=1e-6)


def _warm_rope_blocks(lf, norm: bool):
    """Keys rotated into a quantized cache (one signature serves Q8_0 and Q4_0), then its K-shift."""
    from ggrun.core import ops

    x = lf.input("x", np.ones((2, 2, 32), np.float32))
    pos = lf.input("pos", np.arange(2, dtype=np.int32))
    w = readonly(lf, "w", DType.F32, np.ones(32, np.float32)) if norm else None
    cache = lf.ctx.new_tensor("cache", DType.Q8_0, (4, 64))
    lf.ctx.backend.set_tensor(cache, np.zeros((4, DType.Q8_0.row_bytes(64)), np.uint8))
    cache.params["hadamard"] = 64
    stored = ops.rope_set_rows(cache, x, pos, pos, 32, norm=w, eps=1e-6)
    return ops.rope_shift(stored, lf.input("shift", np.zeros(4, np.int32)), 32, 32, ROPE_NEOX)


@warms(needs={ROPE_FACTORS})
def _warm_rope_factors(lf):
    """Queries or keys rotated with frequency factors, read-only as a model file's are (rope_rows' signature)."""
    from ggrun.core import ops

    x = lf.input("x", np.ones((2, 2, 8), np.float32))
    pos = lf.input("pos", np.arange(2, dtype=np.int32))
    return ops.rope(x, pos, 8, ROPE_NEOX, factors=readonly(lf, "ff", DType.F32, np.ones(4, np.float32)))


for _cache_dtype in (DType.F16, DType.F32):
    for _with_norm in (False, True):
        warms(lambda lf, d=_cache_dtype, n=_with_norm: _warm_rope(lf, d, n), needs={kv(_cache_dtype)})
for _with_norm in (False, True):
    warms(lambda lf, n=_with_norm: _warm_rope_blocks(lf, n), needs={kv(DType.Q8_0)})
