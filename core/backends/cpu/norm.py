"""Compiled RMS norms: rms_norm, rms_norm times its weight, and the residual add fused with the
next norm (add_rms_norm). Rows are the last axis; f32 throughout, as ggml's CPU norm.

The sum of squares is accumulated in f64 (ggml's ggml_float), in 8 partial sums so that it
vectorizes; the result row is x * (1 / sqrt(mean + eps)) * w.
"""
from __future__ import annotations

import numpy as np

from ggrun.core.backends.cpu.dispatch import binds
from ggrun.core.backends.cpu.jit import kernel
from ggrun.core.backends.cpu.warmup import readonly, warms
from ggrun.core.dtypes import DType

@kernel(inline="always")
def inv_rms(x, eps):
    n = x.shape[0]
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = 0.0
    m = n - n % 8
    for i in range(0, m, 8):
        a0 += np.float64(x[i] * x[i])
        a1 += np.float64(x[i + 1] * x[i + 1])
        a2 += np.float64(x[i + 2] * x[i + 2])
        a3 += np.float64(x[i + 3] * x[i + 3])
        a4 += np.float64(x[i + 4] * x[i + 4])
        a5 += np.float64(x[i + 5] * x[i + 5])
        a6 += np.float64(x[i + 6] * x[i + 6])
        a7 += np.float64(x[i + 7] * x[i + 7])
    total = ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7))
    for i in range(m, n):
        total += np.float64(x[i] * x[i])
    mean = np.float32(total / n)
    return np.float32(1.0) / np.float32(np.sqrt(mean + eps))


@kernel
def rms_norm_rows(x, w, eps, out):
    """out[r] = x[r] / rms(x[r]) * w (w of ones for a plain norm); out may alias x."""
    for r in range(x.shape[0]):
        s = inv_rms(x[r], eps)
        for i in range(x.shape[1]):
            out[r, i] = x[r, i] * s * w[i]


@kernel
def add_rms_norm_rows(x, h, w, post, eps, use_post, out):
    """out[0] = x + h (or x + h / rms(h) * post), out[1] = out[0] / rms(out[0]) * w, row by row."""
    stream, normed = out[0], out[1]
    for r in range(x.shape[0]):
        if use_post:
            s = inv_rms(h[r], eps)
            for i in range(x.shape[1]):
                stream[r, i] = h[r, i] * s * post[i] + x[r, i]
        else:
            for i in range(x.shape[1]):
                stream[r, i] = x[r, i] + h[r, i]
        s = inv_rms(stream[r], eps)
        for i in range(x.shape[1]):
            normed[r, i] = stream[r, i] * s * w[i]


def _rows(a: np.ndarray, n: int) -> np.ndarray | None:
    """a as C-contiguous f32 rows of n, or None."""
    if a.dtype != np.float32 or not a.flags.c_contiguous or a.size % n:
        return None
    return a.reshape(-1, n)


def _weight(node, i: int, a: np.ndarray, n: int) -> np.ndarray | None:
    """A norm weight spanning the last axis only (the same for every row), as a vector."""
    if node.srcs[i].dtype is not DType.F32 or a.size != n or not a.flags.c_contiguous:
        return None
    return a.reshape(n)


_ONES: dict[int, np.ndarray] = {}


@binds("rms_norm")
def bind_rms_norm(node, out, srcs, scratch):
    n = node.shape[-1]
    x, o = _rows(srcs[0], n), _rows(out, n)
    if x is None or o is None or node.srcs[0].dtype is not DType.F32:
        return None
    ones = _ONES.setdefault(n, np.ones(n, dtype=np.float32))
    eps = np.float32(node.params["eps"])
    return lambda: rms_norm_rows(x, ones, eps, o)


@binds("rms_norm_mul")
def bind_rms_norm_mul(node, out, srcs, scratch):
    n = node.shape[-1]
    x, o, w = _rows(srcs[0], n), _rows(out, n), _weight(node, 1, srcs[1], n)
    if x is None or o is None or w is None or node.srcs[0].dtype is not DType.F32:
        return None
    eps = np.float32(node.params["eps"])
    return lambda: rms_norm_rows(x, w, eps, o)


@binds("add_rms_norm")
def bind_add_rms_norm(node, out, srcs, scratch):
    n = node.shape[-1]
    x, h, o = _rows(srcs[0], n), _rows(srcs[1], n), _rows(out, n)
    w = _weight(node, 2, srcs[2], n)
    use_post = len(srcs) > 3
    post = _weight(node, 3, srcs[3], n) if use_post else w
    if any(a is None for a in (x, h, o, w, post)) or any(s.dtype is not DType.F32 for s in node.srcs[:2]):
        return None
    o = o.reshape(2, -1, n)
    eps = np.float32(node.params["eps"])
    return lambda: add_rms_norm_rows(x, h, w, post, eps, use_post, o)


# ---- first-run compilation: the signatures a model's graphs meet (read-only weights) ------------

@warms
def _warm_norms(lf):
    from ggrun.core import ops

    x = lf.input("x", np.ones((2, 64), np.float32))
    h = lf.input("h", np.ones((2, 64), np.float32))
    w = readonly(lf, "w", DType.F32, np.ones(64, np.float32))
    post = readonly(lf, "post", DType.F32, np.ones(64, np.float32))
    both = ops.add_rms_norm(ops.rms_norm_mul(x, w, 1e-5), h, w, 1e-5)
    both = ops.add_rms_norm(ops.view(both, (2, 64)), h, w, 1e-5, post=post)
    return ops.rms_norm(ops.view(both, (2, 64)), 1e-5)
