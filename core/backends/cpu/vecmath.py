"""Scalar building blocks the compiled kernels inline: f16 conversions (numba has no float16 on the
CPU, so f16 data travels as uint16 bits), fused multiply-add, and an exp, SiLU and GELU that LLVM
can vectorize. They are the CPU's arithmetic only; the reference formulas stay in kernels.py.

Every function here is branch-free over its operands, so a loop calling it compiles to SIMD code.
"""
from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from ggrun.core.backends.cpu.jit import kernel

_F32 = ir.FloatType()


@intrinsic
def f16_to_f32(typingctx, h):
    """The f32 value of f16 bits (exact; one vcvtph2ps with F16C)."""
    if not isinstance(h, types.Integer) or h.bitwidth != 16:
        return None

    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), _F32)
    return types.float32(h), codegen


@intrinsic
def f32_to_f16(typingctx, x):
    """f16 bits of x rounded to nearest even, as ggml's FP32_TO_FP16 (vcvtps2ph)."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
    return types.uint16(x), codegen


def as_f32(v):
    """A stored element as f32: f16 bits (uint16) are converted, f32 passes through."""
    raise NotImplementedError("only inside compiled kernels")


@overload(as_f32, inline="always")
def _as_f32(v):
    if v == types.uint16:
        return lambda v: f16_to_f32(v)
    if v == types.float32:
        return lambda v: v
    return None


def to_stored(v, like):
    """f32 value v in the storage type of array `like`: f16 bits (uint16) rounded to nearest even,
    or f32 as it is."""
    raise NotImplementedError("only inside compiled kernels")


@overload(to_stored, inline="always")
def _to_stored(v, like):
    if like.dtype == types.uint16:
        return lambda v, like: f32_to_f16(v)
    if like.dtype == types.float32:
        return lambda v, like: v
    return None


@intrinsic
def fma(typingctx, a, b, c):
    """a * b + c with one rounding."""
    if not (a == b == c == types.float32):
        return None

    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_F32, [_F32] * 3), "llvm.fma.f32")
        return builder.call(fn, args)
    return types.float32(a, b, c), codegen


@intrinsic
def _bits_to_f32(typingctx, i):
    if not isinstance(i, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        v = args[0]
        if i.bitwidth > 32:
            v = builder.trunc(v, ir.IntType(32))
        return builder.bitcast(v, _F32)
    return types.float32(i), codegen


def _hex(s: str) -> np.float32:
    return np.float32(float.fromhex(s))


# exp(x) = 2^n * e^b with n = round(x / ln 2) and |b| <= ln2 / 2 (the constants of ggml's ggml_v_expf)
_SHIFT = _hex("0x1.8p23")
_LOG2E = _hex("0x1.715476p+0")
_LN2_HI = _hex("0x1.62e4p-1")
_LN2_LO = _hex("0x1.7f7d1cp-20")
_C5, _C4, _C3, _C2, _C1 = (_hex("0x1.0e4020p-7"), _hex("0x1.573e2ep-5"), _hex("0x1.555e66p-3"),
                           _hex("0x1.fffdb6p-2"), _hex("0x1.ffffecp-1"))
_X_MIN, _X_MAX = np.float32(-110.0), np.float32(89.0)  # exp rounds to 0 below, to inf above, in f32


@kernel(inline="always")
def expf(x):
    """e^x in f32 within about 4 ulp; 0 for -inf, inf for inf."""
    x = min(max(x, _X_MIN), _X_MAX)
    n = fma(x, _LOG2E, _SHIFT) - _SHIFT
    b = fma(-n, _LN2_LO, fma(-n, _LN2_HI, x))
    u = b * b
    j = fma(fma(fma(_C5, b, _C4), u, fma(_C3, b, _C2)), u, fma(_C1, b, np.float32(1.0)))
    k = np.int32(n)
    k1 = k >> 1  # 2^k as two normal factors, so that results down to the denormals are right
    return j * _bits_to_f32((k1 + 127) << 23) * _bits_to_f32((k - k1 + 127) << 23)


@kernel(inline="always")
def silu(x):
    return x / (np.float32(1.0) + expf(-x))


_GELU_C = np.float32(math.sqrt(2.0 / math.pi))
_GELU_A = np.float32(0.044715)


@kernel(inline="always")
def gelu(x):
    """GELU (tanh form) in f32, in the reference kernel's order of operations."""
    t = np.float32(math.tanh(((x * x) * _GELU_A + np.float32(1.0)) * x * _GELU_C))
    return (t + np.float32(1.0)) * x * np.float32(0.5)


@kernel(inline="always")
def gelu_table(x, table):
    """ggml's CPU GELU: the table's value at the f16-rounded input; x or 0 where |x| >= 10."""
    if x >= np.float32(10.0):
        return x
    if x <= np.float32(-10.0):
        return np.float32(0.0)
    return table[f32_to_f16(x)]


# A gated feed-forward's GLU of its two products (the product kernels apply it to rows as they come).
GLU_SWIGLU, GLU_GEGLU, GLU_GEGLU_TABLE = 0, 1, 2


@kernel(inline="always")
def glu_row(kind, table, g, u, out):
    """out[i] = silu(g[i]) * u[i], gelu(g[i]) * u[i] or ggml's table GELU of g[i] times u[i] (the
    elementwise kernels' formulas; out may be g): a loop per kind, so each compiles to SIMD code
    where it can."""
    if kind == GLU_SWIGLU:
        for i in range(out.shape[0]):
            out[i] = silu(g[i]) * u[i]
    elif kind == GLU_GEGLU_TABLE:
        for i in range(out.shape[0]):
            out[i] = gelu_table(g[i], table) * u[i]
    else:
        for i in range(out.shape[0]):
            out[i] = gelu(g[i]) * u[i]


@kernel(_nrt=False)
def glu_span(kind, table, out, up, r0, r1):
    """out[:, r0:r1] = glu(out[:, r0:r1], up[:, 0:r1 - r0])."""
    for n in range(out.shape[0]):
        row = out[n, r0:r1]
        glu_row(kind, table, row, up[n, :r1 - r0], row)


def gelu_f16_table() -> np.ndarray:
    """f32 [65536]: the reference GELU of every f16 value, rounded to f16 (ggml's table), by f16 bits."""
    from ggrun.core.backends.kernels import _gelu_exact_into

    x = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
    y = np.empty_like(x)
    with np.errstate(all="ignore"):
        _gelu_exact_into(np, x, y)
    return y.astype(np.float16).astype(np.float32)
