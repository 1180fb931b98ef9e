"""The block types' codes and the pieces of their layouts every kernel file reads: numba dispatches on a
small int per type (F32 .. MXFP4), the activation formats a weight type's integer dot product reads
(Q8_0, Q8_1, Q8_K: ggml's vec_dot_type) and their planned arrays, the instruction-set level (SIMD), and
the scalar helpers that decode a block's f16/bf16 fields and packed scales.

The f16 fields of ggml's blocks are kept as the f32 values they hold (exactly equal). Listed in
jit.SHARED_SOURCES: the kernels of the other files compile these helpers in.
"""
from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from ggrun.core.backends.cpu import isa
from ggrun.core.backends.cpu.jit import kernel
from ggrun.core.dtypes import DType


_I8, _I16, _I32, _I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)

# ---------------------------------------------------------------------------------------------
# Type codes (numba dispatches on a small int) and activation formats
# ---------------------------------------------------------------------------------------------

F32, F16, BF16 = 0, 1, 2
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 3, 4, 5, 6, 7
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = 8, 9, 10, 11, 12
IQ4_NL, IQ4_XS, MXFP4 = 13, 14, 15  # the lookup-table types: their kernels are lut4.py's

CODES: dict[DType, int] = {
    DType.F32: F32, DType.F16: F16, DType.BF16: BF16,
    DType.Q4_0: Q4_0, DType.Q4_1: Q4_1, DType.Q5_0: Q5_0, DType.Q5_1: Q5_1, DType.Q8_0: Q8_0,
    DType.Q2_K: Q2_K, DType.Q3_K: Q3_K, DType.Q4_K: Q4_K, DType.Q5_K: Q5_K, DType.Q6_K: Q6_K,
    DType.IQ4_NL: IQ4_NL, DType.IQ4_XS: IQ4_XS, DType.MXFP4: MXFP4,
}

# Activation formats: the 8-bit blocks a weight type's integer dot product reads (ggml's vec_dot_type).
ACT_Q8_0, ACT_Q8_1, ACT_Q8_K = 0, 1, 2
ACT_OF: dict[DType, int] = {
    DType.Q4_0: ACT_Q8_0, DType.Q5_0: ACT_Q8_0, DType.Q8_0: ACT_Q8_0,
    DType.Q4_1: ACT_Q8_1, DType.Q5_1: ACT_Q8_1,
    DType.Q2_K: ACT_Q8_K, DType.Q3_K: ACT_Q8_K, DType.Q4_K: ACT_Q8_K, DType.Q5_K: ACT_Q8_K, DType.Q6_K: ACT_Q8_K,
    DType.IQ4_NL: ACT_Q8_0, DType.MXFP4: ACT_Q8_0, DType.IQ4_XS: ACT_Q8_K,
}
ACT_BLOCK = {ACT_Q8_0: 32, ACT_Q8_1: 32, ACT_Q8_K: 256}


def act_arrays_bytes(n_rows: int, k: int) -> int:
    """Bytes of one set of quantized activation rows (see `act_arrays`), 64-byte aligned parts."""
    return sum(round64(n_rows * size) for size in _act_sizes(k))


def _act_sizes(k: int) -> tuple[int, int, int, int]:
    # qs int8 [K], d f32 [K/32] (one per block: Q8_K uses the first K/256), s f32 [K/32], sums i32 [K/16]
    return k, 4 * (k // 32), 4 * (k // 32), 4 * (k // 16)


def act_arrays(scratch: np.ndarray, n_rows: int, k: int) -> tuple[np.ndarray, ...]:
    """Views of scratch (uint8) as quantized activation rows: qs int8 [N, K], per-block scales
    d f32 [N, K/32], Q8_1's s = f16(d * sum(qs)) f32 [N, K/32], sums of 16 quants i32 [N, K/16].

    The f16 fields of ggml's blocks are kept as the f32 values they hold (exactly equal)."""
    views, at = [], 0
    for size, dt in zip(_act_sizes(k), (np.int8, np.float32, np.float32, np.int32)):
        nbytes = n_rows * size
        views.append(scratch[at:at + nbytes].view(dt).reshape(n_rows, size // np.dtype(dt).itemsize))
        at += round64(nbytes)
    return tuple(views)


def round64(n: int) -> int:
    """n rounded up to a multiple of 64 (work arrays in planned scratch start on a cache line)."""
    return (n + 63) // 64 * 64


# The instruction-set level (isa.py): "avx512" and "avx2" run the AVX2 kernels (avx2.py, avx2_r8.py;
# AVX-512 adds its own in avx512.py), "generic" the portable ones. Read at call binding, so tests may set it lower.
SIMD = isa.LEVEL

# ---------------------------------------------------------------------------------------------
# Portable scalar helpers
# ---------------------------------------------------------------------------------------------

_RINT_MAGIC = 6755399441055744.0  # 2^52 + 2^51: adding and subtracting it rounds a float64 half-to-even


@kernel(inline="always")
def _rint(v):
    """Round to the nearest integer, ties to even (as _mm256_round_ps and ggml's nearest_int)."""
    return int((np.float64(v) + _RINT_MAGIC) - _RINT_MAGIC)


@intrinsic
def _bits_f32(typingctx, bits):
    """The float32 whose IEEE bits are the low 32 bits of an integer."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.trunc(args[0], _I32), ir.FloatType())
    return types.float32(types.int64), codegen


@kernel(inline="always")
def _f16(w, at):
    """The IEEE half stored little-endian at w[at], w[at + 1], as float32."""
    h = np.int64(w[at]) | (np.int64(w[at + 1]) << 8)
    e = (h >> 10) & 31
    f = h & 1023
    sign = (h & 0x8000) << 16
    if e == 0:  # zero or subnormal: f * 2^-24, exact in f32
        v = np.float32(f) * np.float32(5.960464477539063e-08)
        return -v if sign else v
    if e == 31:
        return _bits_f32(sign | 0x7F800000 | (f << 13))
    return _bits_f32(sign | ((e + 112) << 23) | (f << 13))


@kernel(inline="always")
def _bf16(w, at):
    """The bfloat16 stored little-endian at w[at], w[at + 1], as float32."""
    return _bits_f32((np.int64(w[at]) | (np.int64(w[at + 1]) << 8)) << 16)


@kernel(inline="always")
def _to_f16(x):
    """x rounded to the nearest f16 value (ties to even), as float32: what GGML_FP32_TO_FP16 stores."""
    a = abs(np.float64(x))
    if a != a or a == math.inf:
        return np.float32(x)
    if a >= 65520.0:
        r = math.inf
    elif a < 6.103515625e-05:  # below 2^-14 the f16 step is 2^-24
        r = math.ldexp(np.float64(_rint(math.ldexp(a, 24))), -24)
    else:
        e = math.frexp(a)[1]
        r = math.ldexp(np.float64(_rint(math.ldexp(a, 11 - e))), e - 11)
    return np.float32(-r if x < 0 else r)


@kernel(inline="always")
def _s8(v):
    """A stored byte as a signed int8 value."""
    return (np.int64(v) ^ 128) - 128


# ---------------------------------------------------------------------------------------------
# The k-quants' packed scales: from a 12-byte array (sc) or from a stored row at byte `at` (w)
# ---------------------------------------------------------------------------------------------

@kernel(inline="always")
def _k4_scale_min(sc, j):
    """Q4_K/Q5_K: six-bit scale and min of sub-block j from the 12 packed bytes at sc[0..11]."""
    if j < 4:
        return sc[j] & 63, sc[j + 4] & 63
    return (sc[j + 4] & 15) | ((sc[j - 4] >> 6) << 4), (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4)


@kernel(inline="always")
def _q3_scale(sc, g):
    """Q3_K: signed six-bit scale of group g (0..15) from the 12 packed bytes at sc[0..11]."""
    low = (sc[g % 8] >> (4 * (g // 8))) & 15
    high = (sc[8 + g % 4] >> (2 * (g // 4))) & 3
    return np.int64(low | (high << 4)) - 32


@kernel(inline="always")
def _k4_sm(w, at, j):
    """Q4_K/Q5_K: six-bit scale and min of sub-block j from the 12 bytes at w[at..]."""
    if j < 4:
        return np.int64(w[at + j] & 63), np.int64(w[at + j + 4] & 63)
    return (np.int64(w[at + j + 4] & 15) | (np.int64(w[at + j - 4] >> 6) << 4),
            np.int64(w[at + j + 4] >> 4) | (np.int64(w[at + j] >> 6) << 4))


@kernel(inline="always")
def _q3_sc(w, at, g):
    low = (w[at + g % 8] >> (4 * (g // 8))) & 15
    high = (w[at + 8 + g % 4] >> (2 * (g // 4))) & 3
    return np.int64(low | (high << 4)) - 32
