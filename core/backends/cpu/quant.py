"""Compiled kernels for GGUF block-quantized weights on the CPU: activation rows quantized to
8-bit blocks (Q8_0, Q8_1, Q8_K), ggml's integer dot products of each weight type against them,
f32 dot products for F16/BF16/F32 weights, rows of every type decoded to f32, and the gated
feed-forward's GLU applied to its two products as they come (mul_mat_glu).

Everything compiled lives in this one file, because numba's disk cache only notices changes to
the file of the function it compiled, not to the files of the functions that it inlined.
Kernels never allocate: callers hand them views of planned memory (a node's result and scratch).

The arithmetic follows ggml's CPU backend on x86 (ggml-cpu/arch/x86/quants.c): the same
activation rounding (Q8_0/Q8_1: d = amax/127 stored as f16, q = round-half-even(x * 127/amax);
Q8_K: d = max/-127 as f32) and exact integer block sums scaled once per block. Two
implementations of every dot product: portable numba (any CPU), and AVX2 through a handful of
LLVM intrinsics on a 256-bit vector type (`vec`), chosen once from the CPU's level (SIMD, isa.py).
Decode steps read weights fastest in a layout repacked once at load: "r8" for AVX2, "ri64" for
the portable kernels (see those sections), "r16" for AVX-512 (avx512.py); all read the same
activation blocks.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from llvmlite import ir
from numba import prange, types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model

from ggrun.core.backends.cpu import isa
from ggrun.core.backends.cpu.jit import kernel
from ggrun.core.backends.cpu.lut4 import TYPES as LUT4_TYPES
from ggrun.core.backends.cpu.vecmath import GLU_GEGLU, GLU_GEGLU_TABLE, GLU_SWIGLU, glu_span  # noqa: F401
from ggrun.core.dtypes import DType

_I8, _I16, _I32, _I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)

# ---------------------------------------------------------------------------------------------
# Type codes (numba dispatches on a small int) and activation formats
# ---------------------------------------------------------------------------------------------

F32, F16, BF16 = 0, 1, 2
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 3, 4, 5, 6, 7
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = 8, 9, 10, 11, 12

CODES: dict[DType, int] = {
    DType.F32: F32, DType.F16: F16, DType.BF16: BF16,
    DType.Q4_0: Q4_0, DType.Q4_1: Q4_1, DType.Q5_0: Q5_0, DType.Q5_1: Q5_1, DType.Q8_0: Q8_0,
    DType.Q2_K: Q2_K, DType.Q3_K: Q3_K, DType.Q4_K: Q4_K, DType.Q5_K: Q5_K, DType.Q6_K: Q6_K,
    **LUT4_TYPES,  # IQ4_NL, IQ4_XS, MXFP4: their kernels are lut4.py's, which matmul.py calls for them
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
    return sum(_round64(n_rows * size) for size in _act_sizes(k))


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
        at += _round64(nbytes)
    return tuple(views)


def _round64(n: int) -> int:
    return (n + 63) // 64 * 64


# The instruction-set level (isa.py): "avx512" and "avx2" run the AVX2 kernels here (AVX-512 adds its
# own in avx512.py), "generic" the portable ones. Read at call binding, so tests may set it lower.
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
# Activation rows to 8-bit blocks
# ---------------------------------------------------------------------------------------------

@kernel
def quantize_rows(act, x, qs, d, s, sums):
    """Rows of x (f32 [N, K]) to ggml's Q8_0/Q8_1/Q8_K blocks (views from `act_arrays`)."""
    n_rows, k = x.shape
    for n in range(n_rows):
        if act == ACT_Q8_K:
            _quantize_q8_k(x[n], qs[n], d[n], sums[n])
        else:
            _quantize_q8_0(x[n], qs[n], d[n], s[n], sums[n], act == ACT_Q8_1)


@kernel(inline="always")
def _quantize_q8_0(x, qs, d, s, sums, with_s):
    for b in range(x.shape[0] // 32):
        o = 32 * b
        amax = np.float32(0.0)
        for j in range(32):
            amax = max(amax, abs(x[o + j]))
        scale = amax / np.float32(127.0)
        inv = np.float32(127.0) / amax if amax != 0 else np.float32(0.0)
        lo = 0
        hi = 0
        for j in range(16):
            q = _rint(x[o + j] * inv)
            qs[o + j] = q
            lo += q
        for j in range(16, 32):
            q = _rint(x[o + j] * inv)
            qs[o + j] = q
            hi += q
        d[b] = _to_f16(scale)
        sums[2 * b] = lo
        sums[2 * b + 1] = hi
        if with_s:
            s[b] = _to_f16(scale * np.float32(lo + hi))


@kernel(inline="always")
def _quantize_q8_k(x, qs, d, sums):
    for b in range(x.shape[0] // 256):
        o = 256 * b
        amax = np.float32(0.0)
        vmax = np.float32(0.0)
        for j in range(256):
            a = abs(x[o + j])
            if a > amax:
                amax = a
                vmax = x[o + j]
        if amax == 0:
            d[b] = 0.0
            for j in range(256):
                qs[o + j] = 0
            for g in range(16):
                sums[16 * b + g] = 0
            continue
        iscale = np.float32(-127.0) / vmax
        for g in range(16):
            t = 0
            for j in range(16 * g, 16 * g + 16):
                q = min(127, _rint(iscale * x[o + j]))
                qs[o + j] = q
                t += q
            sums[16 * b + g] = t
        d[b] = np.float32(1.0) / iscale


@kernel
def round_rows(act, x, qs, d, s, sums, out):
    """x's rows as the q8 path sees them: quantized to `act` blocks, then the f32 values held."""
    quantize_rows(act, x, qs, d, s, sums)
    expand_rows(act, qs, d, out)


@kernel
def round_rows_s(x, qs, d, s, sums, out):
    """`round_rows` for the Q4_1/Q5_1 weights' BLAS path: x's Q8_1 values in out[:, :K] and, in
    out[:, K + b], s - d * sum(q): how much ggml's f16 s (which their vec_dot multiplies by the
    weight's min) exceeds the block's exact sum. Weight tiles carry the mins in those columns, so
    sgemm adds min * s per block as the integer kernel does."""
    quantize_rows(ACT_Q8_1, x, qs, d, s, sums)
    k = qs.shape[1]
    for n in range(qs.shape[0]):
        for b in range(k // 32):
            scale = d[n, b]
            for j in range(32 * b, 32 * b + 32):
                out[n, j] = np.float32(qs[n, j]) * scale
            exact = np.float64(scale) * np.float64(sums[n, 2 * b] + sums[n, 2 * b + 1])
            out[n, k + b] = np.float32(np.float64(s[n, b]) - exact)


@kernel
def block_mins(code, w, m0, m1, out):
    """out[r, b] = the f16 min of block b of row m0 + r (Q4_1, Q5_1)."""
    ts = 20 if code == Q4_1 else 24
    for m in range(m0, m1):
        for b in range(out.shape[1]):
            out[m - m0, b] = _f16(w[m], ts * b + 2)


@kernel
def expand_rows(act, qs, d, out):
    """Quantized activation rows back to the f32 values they hold (q * d), for the BLAS path."""
    n_rows, k = qs.shape
    block = 256 if act == ACT_Q8_K else 32
    for n in range(n_rows):
        for b in range(k // block):
            scale = d[n, b]
            for j in range(block * b, block * b + block):
                out[n, j] = np.float32(qs[n, j]) * scale


# ---------------------------------------------------------------------------------------------
# Rows decoded to f32 (get_rows, and the weight tiles of the BLAS path): the same values, bit
# for bit, as core.quants' numpy decoders
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


@kernel
def dequantize_row(code, w, out):
    """Decode one stored row (its uint8 bytes; any type but F32) into out (f32 [K])."""
    k = out.shape[0]
    if code == F16:
        for j in range(k):
            out[j] = _f16(w, 2 * j)
    elif code == BF16:
        for j in range(k):
            out[j] = _bf16(w, 2 * j)
    elif code == Q4_0 or code == Q4_1:
        ts = 18 if code == Q4_0 else 20
        for b in range(k // 32):
            o = ts * b
            d = _f16(w, o)
            if code == Q4_0:
                for j in range(16):
                    v = w[o + 2 + j]
                    out[32 * b + j] = np.float32((v & 15) - 8) * d
                    out[32 * b + 16 + j] = np.float32((v >> 4) - 8) * d
            else:
                m = _f16(w, o + 2)
                for j in range(16):
                    v = w[o + 4 + j]
                    out[32 * b + j] = np.float32(v & 15) * d + m
                    out[32 * b + 16 + j] = np.float32(v >> 4) * d + m
    elif code == Q5_0 or code == Q5_1:
        ts = 22 if code == Q5_0 else 24
        for b in range(k // 32):
            o = ts * b
            d = _f16(w, o)
            hq = 2 if code == Q5_0 else 4
            qh = np.int64(w[o + hq]) | (np.int64(w[o + hq + 1]) << 8) | (np.int64(w[o + hq + 2]) << 16) \
                | (np.int64(w[o + hq + 3]) << 24)
            for j in range(16):
                v = w[o + hq + 4 + j]
                lo = (v & 15) | (((qh >> j) & 1) << 4)
                hi = (v >> 4) | (((qh >> (j + 16)) & 1) << 4)
                if code == Q5_0:
                    out[32 * b + j] = np.float32(lo - 16) * d
                    out[32 * b + 16 + j] = np.float32(hi - 16) * d
                else:
                    m = _f16(w, o + 2)
                    out[32 * b + j] = np.float32(lo) * d + m
                    out[32 * b + 16 + j] = np.float32(hi) * d + m
    elif code == Q8_0:
        for b in range(k // 32):
            o = 34 * b
            d = _f16(w, o)
            for j in range(32):
                out[32 * b + j] = np.float32(_s8(w[o + 2 + j])) * d
    elif code == Q2_K:
        for b in range(k // 256):
            o = 84 * b
            d = _f16(w, o + 80)
            dmin = _f16(w, o + 82)
            for g in range(16):  # element 128h + 32j + l: bits 2j of byte 32h + l; group 8h + 2j + l // 16
                h, j, half = g // 8, (g // 2) % 4, g % 2
                sc = w[o + g]
                scale = d * np.float32(sc & 15)
                offset = dmin * np.float32(sc >> 4)
                for l in range(16 * half, 16 * half + 16):
                    q = (w[o + 16 + 32 * h + l] >> (2 * j)) & 3
                    out[256 * b + 16 * g + l - 16 * half] = np.float32(q) * scale - offset
    elif code == Q3_K:
        for b in range(k // 256):
            o = 110 * b
            d = _f16(w, o + 108)
            for g in range(16):
                h, j, half = g // 8, (g // 2) % 4, g % 2
                scale = d * np.float32(_q3_scale(w[o + 96:o + 108], g))
                for l in range(16 * half, 16 * half + 16):
                    q = np.int64((w[o + 32 + 32 * h + l] >> (2 * j)) & 3)
                    if not (w[o + l] >> (4 * h + j)) & 1:
                        q -= 4
                    out[256 * b + 16 * g + l - 16 * half] = np.float32(q) * scale
    elif code == Q4_K or code == Q5_K:
        ts = 144 if code == Q4_K else 176
        qs_at = 16 if code == Q4_K else 48
        for b in range(k // 256):
            o = ts * b
            d = _f16(w, o)
            dmin = _f16(w, o + 2)
            for sub in range(8):  # sub-block 2i: low nibbles of bytes 32i.., 2i + 1: their high nibbles
                sc, mn = _k4_scale_min(w[o + 4:o + 16], sub)
                scale = d * np.float32(sc)
                offset = dmin * np.float32(mn)
                shift = 4 * (sub % 2)
                for l in range(32):
                    q = (w[o + qs_at + 32 * (sub // 2) + l] >> shift) & 15
                    if code == Q5_K:
                        q |= ((w[o + 16 + l] >> sub) & 1) << 4
                    out[256 * b + 32 * sub + l] = np.float32(q) * scale - offset
    elif code == Q6_K:
        for b in range(k // 256):
            o = 210 * b
            d = _f16(w, o + 208)
            for e in range(256):  # element 128h + 32i + l
                h, i, l = e // 128, (e // 32) % 4, e % 32
                low = (w[o + 64 * h + 32 * (i % 2) + l] >> (4 * (i // 2))) & 15
                high = (w[o + 128 + 32 * h + l] >> (2 * i)) & 3
                scale = d * np.float32(_s8(w[o + 192 + e // 16]))
                out[256 * b + e] = np.float32(np.int64(low | (high << 4)) - 32) * scale


@kernel
def dequantize_rows(code, w, m0, m1, out):
    """Rows m0..m1 of a stored weight decoded into out[0 : m1 - m0]."""
    for m in range(m0, m1):
        dequantize_row(code, w[m], out[m - m0])


@kernel(parallel=True)
def dequantize_rows_par(code, w, m0, m1, out, n_chunks):
    step = (m1 - m0 + n_chunks - 1) // n_chunks
    for c in prange(n_chunks):
        lo = m0 + c * step
        hi = min(m1, lo + step)
        for m in range(lo, hi):
            dequantize_row(code, w[m], out[m - m0])


@kernel
def get_rows(code, w, ids, out):
    """out[i] = row ids[i] of a stored weight, decoded."""
    for i in range(ids.shape[0]):
        r = ids[i]
        if r < 0 or r >= w.shape[0]:
            raise IndexError("get_rows: row id out of range")
        dequantize_row(code, w[r], out[i])


# ---------------------------------------------------------------------------------------------
# Portable integer dot products: one stored row against one quantized activation row
# ---------------------------------------------------------------------------------------------

@kernel(_nrt=False)
def dot_portable(code, w, qs, d, s, sums):
    """ggml's vec_dot of a stored row against activation blocks (its vec_dot_type), as f32."""
    acc = np.float32(0.0)
    if code == Q4_0 or code == Q4_1:
        ts = 18 if code == Q4_0 else 20
        at = 2 if code == Q4_0 else 4
        for b in range(qs.shape[0] // 32):
            o = ts * b
            isum = 0
            for j in range(16):
                v = w[o + at + j]
                isum += np.int64(v & 15) * qs[32 * b + j] + np.int64(v >> 4) * qs[32 * b + 16 + j]
            if code == Q4_0:  # q - 8: subtract 8 * the block's activation sum
                isum -= 8 * (sums[2 * b] + sums[2 * b + 1])
                acc += np.float32(isum) * (_f16(w, o) * d[b])
            else:
                acc += np.float32(isum) * (_f16(w, o) * d[b]) + _f16(w, o + 2) * s[b]
    elif code == Q5_0 or code == Q5_1:
        ts = 22 if code == Q5_0 else 24
        hq = 2 if code == Q5_0 else 4
        for b in range(qs.shape[0] // 32):
            o = ts * b
            qh = np.int64(w[o + hq]) | (np.int64(w[o + hq + 1]) << 8) | (np.int64(w[o + hq + 2]) << 16) \
                | (np.int64(w[o + hq + 3]) << 24)
            isum = 0
            for j in range(16):
                v = w[o + hq + 4 + j]
                lo = (v & 15) | (((qh >> j) & 1) << 4)
                hi = (v >> 4) | (((qh >> (j + 16)) & 1) << 4)
                isum += lo * qs[32 * b + j] + hi * qs[32 * b + 16 + j]
            if code == Q5_0:
                isum -= 16 * (sums[2 * b] + sums[2 * b + 1])
                acc += np.float32(isum) * (_f16(w, o) * d[b])
            else:
                acc += np.float32(isum) * (_f16(w, o) * d[b]) + _f16(w, o + 2) * s[b]
    elif code == Q8_0:
        for b in range(qs.shape[0] // 32):
            o = 34 * b
            isum = 0
            for j in range(32):
                isum += _s8(w[o + 2 + j]) * qs[32 * b + j]
            acc += np.float32(isum) * (_f16(w, o) * d[b])
    elif code == Q2_K:
        for b in range(qs.shape[0] // 256):
            o = 84 * b
            isum = 0
            mins = 0
            for g in range(16):
                h, j, half = g // 8, (g // 2) % 4, g % 2
                sc = w[o + g]
                t = 0
                for l in range(16 * half, 16 * half + 16):
                    t += np.int64((w[o + 16 + 32 * h + l] >> (2 * j)) & 3) * qs[256 * b + 16 * g + l - 16 * half]
                isum += np.int64(sc & 15) * t
                mins += np.int64(sc >> 4) * sums[16 * b + g]
            acc += (d[b] * _f16(w, o + 80)) * np.float32(isum) - (d[b] * _f16(w, o + 82)) * np.float32(mins)
    elif code == Q3_K:
        for b in range(qs.shape[0] // 256):
            o = 110 * b
            isum = 0
            for g in range(16):
                h, j, half = g // 8, (g // 2) % 4, g % 2
                t = 0
                for l in range(16 * half, 16 * half + 16):
                    q = np.int64((w[o + 32 + 32 * h + l] >> (2 * j)) & 3) + 4 * ((w[o + l] >> (4 * h + j)) & 1)
                    t += q * qs[256 * b + 16 * g + l - 16 * half]
                isum += _q3_scale(w[o + 96:o + 108], g) * (t - 4 * sums[16 * b + g])
            acc += (_f16(w, o + 108) * d[b]) * np.float32(isum)
    elif code == Q4_K or code == Q5_K:
        ts = 144 if code == Q4_K else 176
        qs_at = 16 if code == Q4_K else 48
        for b in range(qs.shape[0] // 256):
            o = ts * b
            isum = 0
            mins = 0
            for sub in range(8):
                sc, mn = _k4_scale_min(w[o + 4:o + 16], sub)
                shift = 4 * (sub % 2)
                t = 0
                for l in range(32):
                    q = np.int64((w[o + qs_at + 32 * (sub // 2) + l] >> shift) & 15)
                    if code == Q5_K:
                        q |= ((w[o + 16 + l] >> sub) & 1) << 4
                    t += q * qs[256 * b + 32 * sub + l]
                isum += np.int64(sc) * t
                mins += np.int64(mn) * (sums[16 * b + 2 * sub] + sums[16 * b + 2 * sub + 1])
            acc += (_f16(w, o) * d[b]) * np.float32(isum) - (_f16(w, o + 2) * d[b]) * np.float32(mins)
    elif code == Q6_K:
        for b in range(qs.shape[0] // 256):
            o = 210 * b
            isum = 0
            for g in range(16):
                t = 0
                for e in range(16 * g, 16 * g + 16):
                    h, i, l = e // 128, (e // 32) % 4, e % 32
                    low = (w[o + 64 * h + 32 * (i % 2) + l] >> (4 * (i // 2))) & 15
                    high = (w[o + 128 + 32 * h + l] >> (2 * i)) & 3
                    t += np.int64(low | (high << 4)) * qs[256 * b + e]
                isum += _s8(w[o + 192 + g]) * (t - 32 * sums[16 * b + g])
            acc += (_f16(w, o + 208) * d[b]) * np.float32(isum)
    return acc


@kernel(inline="always")
def _dotf_portable(row, x):
    """f32 row . f32 x with eight partial sums (no single long dependency chain)."""
    k = x.shape[0]
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0.0)
    k8 = k - k % 8
    for j in range(0, k8, 8):
        a0 += row[j] * x[j]
        a1 += row[j + 1] * x[j + 1]
        a2 += row[j + 2] * x[j + 2]
        a3 += row[j + 3] * x[j + 3]
        a4 += row[j + 4] * x[j + 4]
        a5 += row[j + 5] * x[j + 5]
        a6 += row[j + 6] * x[j + 6]
        a7 += row[j + 7] * x[j + 7]
    tail = np.float32(0.0)
    for j in range(k8, k):
        tail += row[j] * x[j]
    return (((a0 + a4) + (a1 + a5)) + ((a2 + a6) + (a3 + a7))) + tail


# ---------------------------------------------------------------------------------------------
# AVX2: a 256-bit vector type and the few intrinsics the dot products need. Compiled only where
# SIMD is "avx2" or above (an x86 intrinsic on a CPU without it stops LLVM, so nothing else calls these).
# ---------------------------------------------------------------------------------------------

class _VecType(types.Type):
    def __init__(self) -> None:
        super().__init__(name="vec256")


vec = _VecType()
_V = ir.VectorType(_I64, 4)
_B32 = ir.VectorType(_I8, 32)
_W16 = ir.VectorType(_I16, 16)
_D8 = ir.VectorType(_I32, 8)
_F8 = ir.VectorType(ir.FloatType(), 8)


@register_model(_VecType)
class _VecModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type) -> None:
        super().__init__(dmm, fe_type, _V)


def _addr(context, builder, aryty, ary, off, ptr_type):
    """ptr_type pointer to byte `off` of an array's data."""
    data = context.make_array(aryty)(context, builder, ary).data
    p = builder.gep(builder.bitcast(data, _I8.as_pointer()), [off])
    return builder.bitcast(p, ptr_type.as_pointer())


def _llvm_call(builder, name, ret, args):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, args)


def _splat(builder, value, vtype):
    v = builder.insert_element(ir.Constant(vtype, None), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vtype, None), ir.Constant(ir.VectorType(_I32, vtype.count), [0] * vtype.count))


def _as(builder, v, vtype):
    return builder.bitcast(v, vtype)


def _vec_op(n_args, body, arg_types=None):
    """An intrinsic (vec, ...) -> vec of n_args arguments whose LLVM body is body(builder, *args)."""
    sig = vec(*(arg_types or (vec,) * n_args))

    def codegen(context, builder, signature, llargs):
        return body(builder, *llargs)
    # numba reads an intrinsic's arity from its typing function, so each arity has its own
    typing = {
        0: lambda typingctx: (sig, codegen),
        1: lambda typingctx, a: (sig, codegen),
        2: lambda typingctx, a, b: (sig, codegen),
        3: lambda typingctx, a, b, c: (sig, codegen),
    }[n_args]
    return intrinsic(typing)


vand = _vec_op(2, lambda b, x, y: b.and_(x, y))
vor = _vec_op(2, lambda b, x, y: b.or_(x, y))
vadd32 = _vec_op(2, lambda b, x, y: _as(b, b.add(_as(b, x, _D8), _as(b, y, _D8)), _V))
vsub32 = _vec_op(2, lambda b, x, y: _as(b, b.sub(_as(b, x, _D8), _as(b, y, _D8)), _V))
vmaddubs = _vec_op(2, lambda b, u, s: _as(b, _llvm_call(b, "llvm.x86.avx2.pmadd.ub.sw", _W16,
                                                         [_as(b, u, _B32), _as(b, s, _B32)]), _V))
vmadd = _vec_op(2, lambda b, x, y: _as(b, _llvm_call(b, "llvm.x86.avx2.pmadd.wd", _D8,
                                                      [_as(b, x, _W16), _as(b, y, _W16)]), _V))
vsign8 = _vec_op(2, lambda b, x, y: _as(b, _llvm_call(b, "llvm.x86.avx2.psign.b", _B32,
                                                       [_as(b, x, _B32), _as(b, y, _B32)]), _V))
vabs8 = _vec_op(1, lambda b, x: _as(b, _llvm_call(b, "llvm.abs.v32i8", _B32,
                                                  [_as(b, x, _B32), ir.Constant(ir.IntType(1), 0)]), _V))
vcvt = _vec_op(1, lambda b, x: _as(b, b.sitofp(_as(b, x, _D8), _F8), _V))
vfma = _vec_op(3, lambda b, x, y, z: _as(b, _llvm_call(b, "llvm.fma.v8f32", _F8,
                                                       [_as(b, x, _F8), _as(b, y, _F8), _as(b, z, _F8)]), _V))
vsubf = _vec_op(2, lambda b, x, y: _as(b, b.fsub(_as(b, x, _F8), _as(b, y, _F8)), _V))
vaddf = _vec_op(2, lambda b, x, y: _as(b, b.fadd(_as(b, x, _F8), _as(b, y, _F8)), _V))
vsrl16 = _vec_op(2, lambda b, x, n: _as(b, b.lshr(_as(b, x, _W16), _splat(b, b.trunc(n, _I16), _W16)), _V),
                 (vec, types.int64))
vsll16 = _vec_op(2, lambda b, x, n: _as(b, b.shl(_as(b, x, _W16), _splat(b, b.trunc(n, _I16), _W16)), _V),
                 (vec, types.int64))
vset8 = _vec_op(1, lambda b, x: _as(b, _splat(b, b.trunc(x, _I8), _B32), _V), (types.int64,))
vset32 = _vec_op(1, lambda b, x: _as(b, _splat(b, b.trunc(x, _I32), _D8), _V), (types.int64,))
vsetf = _vec_op(1, lambda b, x: _as(b, _splat(b, x, _F8), _V), (types.float32,))
vzero = _vec_op(0, lambda b: ir.Constant(_V, [0, 0, 0, 0]))
vsll32 = _vec_op(2, lambda b, x, n: _as(b, b.shl(_as(b, x, _D8), _splat(b, b.trunc(n, _I32), _D8)), _V),
                 (vec, types.int64))
vadd16 = _vec_op(2, lambda b, x, y: _as(b, b.add(_as(b, x, _W16), _as(b, y, _W16)), _V))
vmulf = _vec_op(2, lambda b, x, y: _as(b, b.fmul(_as(b, x, _F8), _as(b, y, _F8)), _V))


def _lane0(b, x):
    return _as(b, b.insert_element(ir.Constant(_D8, [0] * 8), b.trunc(x, _I32), ir.Constant(_I32, 0)), _V)


vlane0 = _vec_op(1, _lane0, (types.int64,))  # x in 32-bit lane 0, zeros elsewhere


def _set16x2(b, x, y):
    lo = _splat(b, b.trunc(x, _I16), ir.VectorType(_I16, 8))
    hi = _splat(b, b.trunc(y, _I16), ir.VectorType(_I16, 8))
    return _as(b, b.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_I32, 16), list(range(16)))), _V)


vset16x2 = _vec_op(2, _set16x2, (types.int64, types.int64))  # 16-bit lanes 0..7 = x, 8..15 = y


def _load_op(body):
    """An intrinsic (array, byte offset) -> value whose body reads from that address."""
    @intrinsic
    def load(typingctx, ary, off):
        ret, fn = body

        def codegen(context, builder, signature, args):
            return fn(builder, context, signature.args[0], args[0], args[1])
        return ret(ary, types.intp), codegen
    return load


def _vload(b, ctx, aryty, ary, off):
    return b.load(_addr(ctx, b, aryty, ary, off, _V), align=1)


def _vnib(b, ctx, aryty, ary, off):
    # 16 bytes of nibble pairs -> 32 bytes: the low nibbles, then the high ones (ggml's order)
    x = b.load(_addr(ctx, b, aryty, ary, off, ir.VectorType(_I8, 16)), align=1)
    lo = b.and_(x, ir.Constant(ir.VectorType(_I8, 16), [15] * 16))
    hi = b.lshr(x, ir.Constant(ir.VectorType(_I8, 16), [4] * 16))
    return _as(b, b.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_I32, 32), list(range(32)))), _V)


def _vbits(b, ctx, aryty, ary, off):
    # 4 bytes, little-endian bit j -> byte j = 0xFF if set else 0 (Q5's fifth bits)
    x = b.load(_addr(ctx, b, aryty, ary, off, _I32), align=1)
    bytes4 = _as(b, _splat(b, x, _D8), _B32)
    spread = b.shuffle_vector(bytes4, ir.Constant(_B32, None),
                              ir.Constant(ir.VectorType(_I32, 32), [j // 8 for j in range(32)]))
    bit = b.and_(spread, ir.Constant(_B32, [1 << (j % 8) for j in range(32)]))
    return _as(b, b.sext(b.icmp_unsigned("!=", bit, ir.Constant(_B32, [0] * 32)), _B32), _V)


def _vf16x8(b, ctx, aryty, ary, off):
    h = b.load(_addr(ctx, b, aryty, ary, off, ir.VectorType(ir.HalfType(), 8)), align=1)
    return _as(b, b.fpext(h, _F8), _V)


def _vbf16x8(b, ctx, aryty, ary, off):
    h = b.load(_addr(ctx, b, aryty, ary, off, ir.VectorType(_I16, 8)), align=1)
    return _as(b, b.shl(b.zext(h, _D8), ir.Constant(_D8, [16] * 8)), _V)


def _vf32x8(b, ctx, aryty, ary, off):
    return _as(b, b.load(_addr(ctx, b, aryty, ary, off, _F8), align=1), _V)


def _sf16(b, ctx, aryty, ary, off):
    return b.fpext(b.load(_addr(ctx, b, aryty, ary, off, ir.HalfType()), align=1), ir.FloatType())


def _vbcast32(b, ctx, aryty, ary, off):
    return _as(b, _splat(b, b.load(_addr(ctx, b, aryty, ary, off, _I32), align=1), _D8), _V)


def _bytes_to_lanes(signed, pair):
    """8 bytes -> one per 32-bit lane (zero- or sign-extended); `pair`: the 16-bit value in both
    halves of the lane (madd then scales both products of a pair), else in the low half only."""
    def load(b, ctx, aryty, ary, off):
        x = b.load(_addr(ctx, b, aryty, ary, off, ir.VectorType(_I8, 8)), align=1)
        v = b.sext(x, _D8) if signed else b.zext(x, _D8)
        v = b.and_(v, ir.Constant(_D8, [0xFFFF] * 8))
        if pair:
            v = b.or_(v, b.shl(v, ir.Constant(_D8, [16] * 8)))
        return _as(b, v, _V)
    return load


vload = _load_op((vec, _vload))      # 32 bytes
vbcast32 = _load_op((vec, _vbcast32))  # 4 bytes repeated in every 32-bit lane
vu8pair = _load_op((vec, _bytes_to_lanes(False, True)))   # 8 unsigned bytes as (x, x) 16-bit pairs
vu8lo = _load_op((vec, _bytes_to_lanes(False, False)))    # 8 unsigned bytes as (x, 0)
vs8pair = _load_op((vec, _bytes_to_lanes(True, True)))    # 8 signed bytes as (x, x)
vs8lo = _load_op((vec, _bytes_to_lanes(True, False)))     # 8 signed bytes as (x, 0)
vnib = _load_op((vec, _vnib))        # 16 nibble-pair bytes as 32 values 0..15
vbits = _load_op((vec, _vbits))      # 32 bits as 32 bytes of 0 / 0xFF
vf16x8 = _load_op((vec, _vf16x8))    # 8 halves as 8 floats
vbf16x8 = _load_op((vec, _vbf16x8))  # 8 bfloat16 as 8 floats
vf32x8 = _load_op((vec, _vf32x8))    # 8 floats
sf16 = _load_op((types.float32, _sf16))  # one half as a float (F16C)


@intrinsic
def prefetch(typingctx, ary, off):
    """Hint that byte `off` of an array's data is read soon (into all cache levels)."""
    def codegen(context, builder, signature, args):
        p = _addr(context, builder, signature.args[0], args[0], args[1], _I8)
        i32 = lambda v: ir.Constant(_I32, v)  # noqa: E731
        _llvm_call(builder, "llvm.prefetch.p0", ir.VoidType(), [p, i32(0), i32(3), i32(1)])
        return context.get_dummy_value()
    return types.none(ary, types.intp), codegen


def _bytes_f32(part, signed):
    """Bytes 8 * part .. 8 * part + 7 of a vector as 8 floats."""
    def body(b, x):
        v = b.shuffle_vector(_as(b, x, _B32), ir.Constant(_B32, None),
                             ir.Constant(ir.VectorType(_I32, 8), list(range(8 * part, 8 * part + 8))))
        return _as(b, b.sitofp(b.sext(v, _D8) if signed else b.zext(v, _D8), _F8), _V)
    return _vec_op(1, body)


vu8f0, vu8f1, vu8f2, vu8f3 = (_bytes_f32(i, False) for i in range(4))
vs8f0, vs8f1, vs8f2, vs8f3 = (_bytes_f32(i, True) for i in range(4))


@intrinsic
def vabsmax4(typingctx, a, b, c, e):
    """The largest |value| among the 32 floats of four vectors."""
    def codegen(context, builder, signature, args):
        absf = lambda v: _llvm_call(builder, "llvm.fabs.v8f32", _F8, [_as(builder, v, _F8)])  # noqa: E731
        mx = lambda x, y: _llvm_call(builder, "llvm.x86.avx.max.ps.256", _F8, [x, y])  # noqa: E731
        m = mx(mx(absf(args[0]), absf(args[1])), mx(absf(args[2]), absf(args[3])))
        e8 = [builder.extract_element(m, ir.Constant(_I32, i)) for i in range(8)]
        best = e8[0]
        for v in e8[1:]:
            best = builder.select(builder.fcmp_ordered(">", v, best), v, best)
        return best
    return types.float32(vec, vec, vec, vec), codegen


vround32 = _vec_op(1, lambda b, x: _as(b, _llvm_call(b, "llvm.x86.avx.cvt.ps2dq.256", _D8, [_as(b, x, _F8)]), _V))


@intrinsic
def vhsum32(typingctx, x):
    """The sum of a vector's 8 int32 lanes."""
    def codegen(context, builder, signature, args):
        v = _as(builder, args[0], _D8)
        total = ir.Constant(_I64, 0)
        for i in range(8):
            total = builder.add(total, builder.sext(builder.extract_element(v, ir.Constant(_I32, i)), _I64))
        return total
    return types.int64(vec), codegen


@intrinsic
def vstore_i8x32(typingctx, ary, off, a, b, c, e):
    """Four vectors of 8 int32 (each within int8) stored as 32 int8 at byte `off`, in order."""
    def codegen(context, builder, signature, args):
        w = [_as(builder, v, _D8) for v in args[2:]]
        lo = _llvm_call(builder, "llvm.x86.avx2.packssdw", _W16, [w[0], w[1]])  # lanes: 0-3 8-11 | 4-7 12-15
        hi = _llvm_call(builder, "llvm.x86.avx2.packssdw", _W16, [w[2], w[3]])
        q = _llvm_call(builder, "llvm.x86.avx2.packsswb", _B32, [lo, hi])
        order = ir.Constant(_D8, [0, 4, 1, 5, 2, 6, 3, 7])
        q = _llvm_call(builder, "llvm.x86.avx2.permd", _D8, [_as(builder, q, _D8), order])
        builder.store(_as(builder, q, _B32), _addr(context, builder, signature.args[0], args[0], args[1], _B32), align=1)
        return context.get_dummy_value()
    return types.none(ary, types.intp, vec, vec, vec, vec), codegen


@intrinsic
def f16_round(typingctx, x):
    """x rounded to the nearest f16 value, ties to even (F16C), as float32."""
    def codegen(context, builder, signature, args):
        return builder.fpext(builder.fptrunc(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.float32), codegen


@intrinsic
def vlane(typingctx, x, i):
    """Float lane i of a vector."""
    def codegen(context, builder, signature, args):
        return builder.extract_element(_as(builder, args[0], _F8), builder.trunc(args[1], _I32))
    return types.float32(vec, types.intp), codegen


@intrinsic
def vstoref(typingctx, ary, off, x):
    """Store a vector's 8 floats at byte `off` of an array's data."""
    def codegen(context, builder, signature, args):
        builder.store(_as(builder, args[2], _F8), _addr(context, builder, signature.args[0], args[0], args[1], _F8),
                      align=1)
        return context.get_dummy_value()
    return types.none(ary, types.intp, vec), codegen


@intrinsic
def vhsum(typingctx, x):
    """The sum of a vector's 8 floats, pairwise."""
    def codegen(context, builder, signature, args):
        f = _as(builder, args[0], _F8)
        e = [builder.extract_element(f, ir.Constant(_I32, i)) for i in range(8)]
        return builder.fadd(builder.fadd(builder.fadd(e[0], e[4]), builder.fadd(e[1], e[5])),
                            builder.fadd(builder.fadd(e[2], e[6]), builder.fadd(e[3], e[7])))
    return types.float32(vec), codegen


@kernel(inline="always")
def vdot(u, s):
    """8 int32 lanes, each the sum of 4 products of unsigned bytes u and signed bytes s."""
    return vmadd(vmaddubs(u, s), vset16x2(1, 1))


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


# Row kernels: rows m0..m1 of w against every quantized activation row, out[n, m]. The legacy
# types run four weight rows per pass (one activation load and four independent accumulator
# chains per block); the last pass repeats the last row where fewer than four remain.
# Compiled without NRT: they allocate nothing, and array views then cost no reference counting.

@kernel(inline="always")
def _four_rows(w, m, m1):
    rs = w.strides[0]
    return m * rs, min(m + 1, m1 - 1) * rs, min(m + 2, m1 - 1) * rs, min(m + 3, m1 - 1) * rs


@kernel(inline="always")
def _store4(out, n, m, m1, v0, v1, v2, v3):
    out[n, m] = v0
    if m + 1 < m1:
        out[n, m + 1] = v1
    if m + 2 < m1:
        out[n, m + 2] = v2
    if m + 3 < m1:
        out[n, m + 3] = v3


@kernel(inline="always")
def _prefetch4(w, r0, r1, r2, r3, o):
    """Prefetch block offset o of the next four rows (the hardware prefetcher loses four streams)."""
    ahead = 4 * w.strides[0]
    prefetch(w, r0 + ahead + o)
    prefetch(w, r1 + ahead + o)
    prefetch(w, r2 + ahead + o)
    prefetch(w, r3 + ahead + o)


@kernel(inline="always")
def _blk(w, at, da, p, acc):
    """acc + f16 scale at w[at] * da * the block's integer lanes p."""
    return vfma(vsetf(sf16(w, at) * da), vcvt(p), acc)


@kernel(_nrt=False)
def _rows_q4_0_avx2(w, qs, d, s, sums, out, m0, m1):
    k = qs.shape[1]
    for m in range(m0, m1, 4):
        r0, r1, r2, r3 = _four_rows(w, m, m1)
        for n in range(qs.shape[0]):
            a0 = a1 = a2 = a3 = vzero()
            for b in range(k // 32):
                x = vload(qs, n * k + 32 * b)
                off = vset32(sums[n, 2 * b] + sums[n, 2 * b + 1])  # q - 8: 8 * sum(x) over 8 lanes
                da = d[n, b]
                o = 18 * b
                _prefetch4(w, r0, r1, r2, r3, o)
                a0 = _blk(w, r0 + o, da, vsub32(vdot(vnib(w, r0 + o + 2), x), off), a0)
                a1 = _blk(w, r1 + o, da, vsub32(vdot(vnib(w, r1 + o + 2), x), off), a1)
                a2 = _blk(w, r2 + o, da, vsub32(vdot(vnib(w, r2 + o + 2), x), off), a2)
                a3 = _blk(w, r3 + o, da, vsub32(vdot(vnib(w, r3 + o + 2), x), off), a3)
            _store4(out, n, m, m1, vhsum(a0), vhsum(a1), vhsum(a2), vhsum(a3))


@kernel(_nrt=False)
def _rows_q4_1_avx2(w, qs, d, s, sums, out, m0, m1):
    k = qs.shape[1]
    for m in range(m0, m1, 4):
        r0, r1, r2, r3 = _four_rows(w, m, m1)
        for n in range(qs.shape[0]):
            a0 = a1 = a2 = a3 = vzero()
            e0 = e1 = e2 = e3 = np.float32(0.0)  # sum of m * s (ggml's summs)
            for b in range(k // 32):
                x = vload(qs, n * k + 32 * b)
                da = d[n, b]
                sb = s[n, b]
                o = 20 * b
                _prefetch4(w, r0, r1, r2, r3, o)
                a0 = _blk(w, r0 + o, da, vdot(vnib(w, r0 + o + 4), x), a0)
                a1 = _blk(w, r1 + o, da, vdot(vnib(w, r1 + o + 4), x), a1)
                a2 = _blk(w, r2 + o, da, vdot(vnib(w, r2 + o + 4), x), a2)
                a3 = _blk(w, r3 + o, da, vdot(vnib(w, r3 + o + 4), x), a3)
                e0 += sf16(w, r0 + o + 2) * sb
                e1 += sf16(w, r1 + o + 2) * sb
                e2 += sf16(w, r2 + o + 2) * sb
                e3 += sf16(w, r3 + o + 2) * sb
            _store4(out, n, m, m1, vhsum(a0) + e0, vhsum(a1) + e1, vhsum(a2) + e2, vhsum(a3) + e3)


@kernel(inline="always")
def _q5(w, at, hm):
    """Q5 quants at w[at..]: the 4 bytes of fifth bits, then 16 nibble-pair bytes: values 0..31."""
    return vor(vnib(w, at + 4), vand(vbits(w, at), hm))


@kernel(_nrt=False)
def _rows_q5_0_avx2(w, qs, d, s, sums, out, m0, m1):
    k = qs.shape[1]
    hm = vset8(16)
    for m in range(m0, m1, 4):
        r0, r1, r2, r3 = _four_rows(w, m, m1)
        for n in range(qs.shape[0]):
            a0 = a1 = a2 = a3 = vzero()
            for b in range(k // 32):
                x = vload(qs, n * k + 32 * b)
                off = vset32(2 * (sums[n, 2 * b] + sums[n, 2 * b + 1]))  # q - 16
                da = d[n, b]
                o = 22 * b
                _prefetch4(w, r0, r1, r2, r3, o)
                a0 = _blk(w, r0 + o, da, vsub32(vdot(_q5(w, r0 + o + 2, hm), x), off), a0)
                a1 = _blk(w, r1 + o, da, vsub32(vdot(_q5(w, r1 + o + 2, hm), x), off), a1)
                a2 = _blk(w, r2 + o, da, vsub32(vdot(_q5(w, r2 + o + 2, hm), x), off), a2)
                a3 = _blk(w, r3 + o, da, vsub32(vdot(_q5(w, r3 + o + 2, hm), x), off), a3)
            _store4(out, n, m, m1, vhsum(a0), vhsum(a1), vhsum(a2), vhsum(a3))


@kernel(_nrt=False)
def _rows_q5_1_avx2(w, qs, d, s, sums, out, m0, m1):
    k = qs.shape[1]
    hm = vset8(16)
    for m in range(m0, m1, 4):
        r0, r1, r2, r3 = _four_rows(w, m, m1)
        for n in range(qs.shape[0]):
            a0 = a1 = a2 = a3 = vzero()
            e0 = e1 = e2 = e3 = np.float32(0.0)
            for b in range(k // 32):
                x = vload(qs, n * k + 32 * b)
                da = d[n, b]
                sb = s[n, b]
                o = 24 * b
                _prefetch4(w, r0, r1, r2, r3, o)
                a0 = _blk(w, r0 + o, da, vdot(_q5(w, r0 + o + 4, hm), x), a0)
                a1 = _blk(w, r1 + o, da, vdot(_q5(w, r1 + o + 4, hm), x), a1)
                a2 = _blk(w, r2 + o, da, vdot(_q5(w, r2 + o + 4, hm), x), a2)
                a3 = _blk(w, r3 + o, da, vdot(_q5(w, r3 + o + 4, hm), x), a3)
                e0 += sf16(w, r0 + o + 2) * sb
                e1 += sf16(w, r1 + o + 2) * sb
                e2 += sf16(w, r2 + o + 2) * sb
                e3 += sf16(w, r3 + o + 2) * sb
            _store4(out, n, m, m1, vhsum(a0) + e0, vhsum(a1) + e1, vhsum(a2) + e2, vhsum(a3) + e3)


@kernel(inline="always")
def _q8_lanes(w, at, x):
    """Signed weight bytes at w[at..] times signed x: |w| times x carrying w's sign."""
    q = vload(w, at)
    return vdot(vabs8(q), vsign8(x, q))


@kernel(_nrt=False)
def _rows_q8_0_avx2(w, qs, d, s, sums, out, m0, m1):
    k = qs.shape[1]
    for m in range(m0, m1, 4):
        r0, r1, r2, r3 = _four_rows(w, m, m1)
        for n in range(qs.shape[0]):
            a0 = a1 = a2 = a3 = vzero()
            for b in range(k // 32):
                x = vload(qs, n * k + 32 * b)
                da = d[n, b]
                o = 34 * b
                _prefetch4(w, r0, r1, r2, r3, o)
                a0 = _blk(w, r0 + o, da, _q8_lanes(w, r0 + o + 2, x), a0)
                a1 = _blk(w, r1 + o, da, _q8_lanes(w, r1 + o + 2, x), a1)
                a2 = _blk(w, r2 + o, da, _q8_lanes(w, r2 + o + 2, x), a2)
                a3 = _blk(w, r3 + o, da, _q8_lanes(w, r3 + o + 2, x), a3)
            _store4(out, n, m, m1, vhsum(a0), vhsum(a1), vhsum(a2), vhsum(a3))


@kernel(_nrt=False)
def _rows_q2_k_avx2(w, qs, d, s, sums, out, m0, m1):
    k = qs.shape[1]
    m3 = vset8(3)
    rs = w.strides[0]
    for m in range(m0, m1):
        for n in range(qs.shape[0]):
            acc = vzero()
            extra = np.float32(0.0)
            for b in range(k // 256):
                o = m * rs + 84 * b
                isum = vzero()
                mins = 0
                for h in range(2):
                    q = vload(w, o + 16 + 32 * h)
                    for j in range(4):
                        g = 8 * h + 2 * j
                        sc = vset16x2(np.int64(w[m, 84 * b + g] & 15), np.int64(w[m, 84 * b + g + 1] & 15))
                        u = vand(vsrl16(q, 2 * j), m3)
                        isum = vadd32(isum, vmadd(vmaddubs(u, vload(qs, n * k + 256 * b + 128 * h + 32 * j)), sc))
                for g in range(16):
                    mins += np.int64(w[m, 84 * b + g] >> 4) * sums[n, 16 * b + g]
                acc = vfma(vsetf(d[n, b] * sf16(w, o + 80)), vcvt(isum), acc)
                extra -= (d[n, b] * sf16(w, o + 82)) * np.float32(mins)
            out[n, m] = vhsum(acc) + extra


@kernel(_nrt=False)
def _rows_q3_k_avx2(w, qs, d, s, sums, out, m0, m1):
    k = qs.shape[1]
    m3 = vset8(3)
    m1v = vset8(1)
    rs = w.strides[0]
    for m in range(m0, m1):
        for n in range(qs.shape[0]):
            acc = vzero()
            for b in range(k // 256):
                o = m * rs + 110 * b
                ob = 110 * b
                isum = vzero()
                hm = vload(w, o)
                for h in range(2):
                    q = vload(w, o + 32 + 32 * h)
                    for j in range(4):
                        g = 8 * h + 2 * j
                        u = vor(vand(vsrl16(q, 2 * j), m3), vsll16(vand(vsrl16(hm, 4 * h + j), m1v), 2))
                        sc = vset16x2(_q3_sc(w[m], ob + 96, g), _q3_sc(w[m], ob + 96, g + 1))
                        isum = vadd32(isum, vmadd(vmaddubs(u, vload(qs, n * k + 256 * b + 128 * h + 32 * j)), sc))
                corr = 0  # q - 4: 4 * the sum over groups of scale * activation sum
                for g in range(16):
                    corr += _q3_sc(w[m], ob + 96, g) * sums[n, 16 * b + g]
                isum = vsub32(isum, vlane0(4 * corr))
                acc = vfma(vsetf(sf16(w, o + 108) * d[n, b]), vcvt(isum), acc)
            out[n, m] = vhsum(acc)


@kernel(inline="always")
def _rows_q45_k_avx2(five, w, qs, d, sums, out, m0, m1):
    """Q4_K (five False) or Q5_K: 8 sub-blocks of 32 with six-bit scales and mins."""
    k = qs.shape[1]
    ts = 176 if five else 144
    qs_at = 48 if five else 16
    m15 = vset8(15)
    m1v = vset8(1)
    rs = w.strides[0]
    for m in range(m0, m1):
        row = w[m]
        for n in range(qs.shape[0]):
            acc = vzero()
            extra = np.float32(0.0)
            for b in range(k // 256):
                ob = ts * b
                o = m * rs + ob
                isum = vzero()
                mins = 0
                hb = vload(w, o + 16)  # Q5_K's fifth bits
                for i in range(4):
                    sc0, mn0 = _k4_sm(row, ob + 4, 2 * i)
                    sc1, mn1 = _k4_sm(row, ob + 4, 2 * i + 1)
                    x = vload(w, o + qs_at + 32 * i)
                    lo = vand(x, m15)
                    hi = vand(vsrl16(x, 4), m15)
                    if five:
                        lo = vor(lo, vsll16(vand(vsrl16(hb, 2 * i), m1v), 4))
                        hi = vor(hi, vsll16(vand(vsrl16(hb, 2 * i + 1), m1v), 4))
                    a = n * k + 256 * b + 64 * i
                    p0 = vmadd(vmaddubs(lo, vload(qs, a)), vset16x2(sc0, sc0))
                    p1 = vmadd(vmaddubs(hi, vload(qs, a + 32)), vset16x2(sc1, sc1))
                    isum = vadd32(isum, vadd32(p0, p1))
                    t = 16 * b + 4 * i
                    mins += mn0 * (sums[n, t] + sums[n, t + 1]) + mn1 * (sums[n, t + 2] + sums[n, t + 3])
                acc = vfma(vsetf(sf16(w, o) * d[n, b]), vcvt(isum), acc)
                extra -= (sf16(w, o + 2) * d[n, b]) * np.float32(mins)
            out[n, m] = vhsum(acc) + extra


@kernel(_nrt=False)
def _rows_q4_k_avx2(w, qs, d, s, sums, out, m0, m1):
    _rows_q45_k_avx2(False, w, qs, d, sums, out, m0, m1)


@kernel(_nrt=False)
def _rows_q5_k_avx2(w, qs, d, s, sums, out, m0, m1):
    _rows_q45_k_avx2(True, w, qs, d, sums, out, m0, m1)


@kernel(_nrt=False)
def _rows_q6_k_avx2(w, qs, d, s, sums, out, m0, m1):
    k = qs.shape[1]
    m15 = vset8(15)
    m3 = vset8(3)
    rs = w.strides[0]
    for m in range(m0, m1):
        for n in range(qs.shape[0]):
            acc = vzero()
            for b in range(k // 256):
                o = m * rs + 210 * b
                ob = 210 * b
                isum = vzero()
                for h in range(2):
                    hi2 = vload(w, o + 128 + 32 * h)
                    la = vload(w, o + 64 * h)
                    lb = vload(w, o + 64 * h + 32)
                    for i in range(4):
                        low = la if i % 2 == 0 else lb
                        low = vand(low, m15) if i < 2 else vand(vsrl16(low, 4), m15)
                        u = vor(low, vsll16(vand(vsrl16(hi2, 2 * i), m3), 4))
                        g = ob + 192 + 8 * h + 2 * i
                        sc = vset16x2(_s8(w[m, g]), _s8(w[m, g + 1]))
                        isum = vadd32(isum, vmadd(vmaddubs(u, vload(qs, n * k + 256 * b + 128 * h + 32 * i)), sc))
                corr = 0  # q - 32: 32 * the sum over groups of scale * activation sum
                for g in range(16):
                    corr += _s8(w[m, ob + 192 + g]) * sums[n, 16 * b + g]
                isum = vsub32(isum, vlane0(32 * corr))
                acc = vfma(vsetf(sf16(w, o + 208) * d[n, b]), vcvt(isum), acc)
            out[n, m] = vhsum(acc)


@kernel(inline="always")
def _dotf_avx2(code, w, x):
    """A stored F16/BF16 row (bytes), or an f32 row (code F32), against f32 x, in 16 float lanes."""
    k = x.shape[0]
    k16 = k - k % 16
    a0 = vzero()
    a1 = vzero()
    for j in range(0, k16, 16):
        if code == F16:
            a0 = vfma(vf16x8(w, 2 * j), vf32x8(x, 4 * j), a0)
            a1 = vfma(vf16x8(w, 2 * j + 16), vf32x8(x, 4 * j + 32), a1)
        elif code == BF16:
            a0 = vfma(vbf16x8(w, 2 * j), vf32x8(x, 4 * j), a0)
            a1 = vfma(vbf16x8(w, 2 * j + 16), vf32x8(x, 4 * j + 32), a1)
        else:
            a0 = vfma(vf32x8(w, 4 * j), vf32x8(x, 4 * j), a0)
            a1 = vfma(vf32x8(w, 4 * j + 32), vf32x8(x, 4 * j + 32), a1)
    tail = np.float32(0.0)
    for j in range(k16, k):
        if code == F16:
            tail += _f16(w, 2 * j) * x[j]
        elif code == BF16:
            tail += _bf16(w, 2 * j) * x[j]
        else:
            tail += np.float32(w[j]) * x[j]
    return vhsum(vaddf(a0, a1)) + tail


# ---------------------------------------------------------------------------------------------
# AVX2 quantization of activation rows: `quantize_rows` 32 values at a time (the same rounding:
# x * (127 / amax) in f32, to nearest even), for Q8_0/Q8_1; Q8_K stays scalar
# ---------------------------------------------------------------------------------------------

@kernel(_nrt=False)
def quantize_rows_avx2(act, x, qs, d, s, sums):
    n_rows, k = x.shape
    for n in range(n_rows):
        if act == ACT_Q8_K:
            _quantize_q8_k(x[n], qs[n], d[n], sums[n])
            continue
        for b in range(k // 32):
            o = n * x.strides[0] + 128 * b  # bytes into x (rows of unit inner stride)
            v0 = vf32x8(x, o)
            v1 = vf32x8(x, o + 32)
            v2 = vf32x8(x, o + 64)
            v3 = vf32x8(x, o + 96)
            amax = vabsmax4(v0, v1, v2, v3)
            inv = vsetf(np.float32(127.0) / amax if amax != 0 else np.float32(0.0))
            q0 = vround32(vmulf(v0, inv))
            q1 = vround32(vmulf(v1, inv))
            q2 = vround32(vmulf(v2, inv))
            q3 = vround32(vmulf(v3, inv))
            vstore_i8x32(qs, n * k + 32 * b, q0, q1, q2, q3)
            lo = vhsum32(vadd32(q0, q1))
            hi = vhsum32(vadd32(q2, q3))
            scale = amax / np.float32(127.0)
            d[n, b] = f16_round(scale)
            sums[n, 2 * b] = lo
            sums[n, 2 * b + 1] = hi
            if act == ACT_Q8_1:
                s[n, b] = f16_round(scale * np.float32(lo + hi))


# ---------------------------------------------------------------------------------------------
# AVX2 decoding to f32: the same products as `dequantize_row` (no fused multiply-add, so the
# values match core.quants bit for bit), 8 at a time
# ---------------------------------------------------------------------------------------------

@kernel(inline="always")
def _store32(out, at, q, scale, offset, signed):
    """out[at : at + 32] = float(byte j of q) * scale - offset."""
    sv = vsetf(scale)
    ov = vsetf(offset)
    if signed:
        vstoref(out, 4 * at, vsubf(vmulf(vs8f0(q), sv), ov))
        vstoref(out, 4 * at + 32, vsubf(vmulf(vs8f1(q), sv), ov))
        vstoref(out, 4 * at + 64, vsubf(vmulf(vs8f2(q), sv), ov))
        vstoref(out, 4 * at + 96, vsubf(vmulf(vs8f3(q), sv), ov))
    else:
        vstoref(out, 4 * at, vsubf(vmulf(vu8f0(q), sv), ov))
        vstoref(out, 4 * at + 32, vsubf(vmulf(vu8f1(q), sv), ov))
        vstoref(out, 4 * at + 64, vsubf(vmulf(vu8f2(q), sv), ov))
        vstoref(out, 4 * at + 96, vsubf(vmulf(vu8f3(q), sv), ov))


@kernel(inline="always")
def _store32_centered(out, at, q, center, scale):
    """out[at : at + 32] = (float(byte j of q) - center) * scale (exact subtraction first)."""
    sv = vsetf(scale)
    cv = vsetf(np.float32(center))
    vstoref(out, 4 * at, vmulf(vsubf(vu8f0(q), cv), sv))
    vstoref(out, 4 * at + 32, vmulf(vsubf(vu8f1(q), cv), sv))
    vstoref(out, 4 * at + 64, vmulf(vsubf(vu8f2(q), cv), sv))
    vstoref(out, 4 * at + 96, vmulf(vsubf(vu8f3(q), cv), sv))


@kernel(_nrt=False)
def dequantize_row_avx2(code, w, out):
    """`dequantize_row` with AVX2 for the types models use; the scalar code for the rest."""
    k = out.shape[0]
    m15 = vset8(15)
    if code == F16 or code == BF16:
        k8 = k - k % 8
        for j in range(0, k8, 8):
            vstoref(out, 4 * j, vf16x8(w, 2 * j) if code == F16 else vbf16x8(w, 2 * j))
        for j in range(k8, k):
            out[j] = _f16(w, 2 * j) if code == F16 else _bf16(w, 2 * j)
    elif code == Q4_0:
        for b in range(k // 32):
            _store32_centered(out, 32 * b, vnib(w, 18 * b + 2), 8, sf16(w, 18 * b))
    elif code == Q4_1:
        for b in range(k // 32):
            o = 20 * b  # q * d + m: the negated min as offset keeps mul-then-add rounding
            _store32(out, 32 * b, vnib(w, o + 4), sf16(w, o), -sf16(w, o + 2), False)
    elif code == Q5_0:
        m16 = vset8(16)
        for b in range(k // 32):
            o = 22 * b
            _store32_centered(out, 32 * b, vor(vnib(w, o + 6), vand(vbits(w, o + 2), m16)), 16, sf16(w, o))
    elif code == Q5_1:
        m16 = vset8(16)
        for b in range(k // 32):
            o = 24 * b
            _store32(out, 32 * b, vor(vnib(w, o + 8), vand(vbits(w, o + 4), m16)), sf16(w, o), -sf16(w, o + 2), False)
    elif code == Q8_0:
        for b in range(k // 32):
            _store32(out, 32 * b, vload(w, 34 * b + 2), sf16(w, 34 * b), np.float32(0.0), True)
    elif code == Q4_K or code == Q5_K:
        ts = 144 if code == Q4_K else 176
        qs_at = 16 if code == Q4_K else 48
        m1 = vset8(1)
        for b in range(k // 256):
            o = ts * b
            d = sf16(w, o)
            dmin = sf16(w, o + 2)
            hb = vload(w, o + 16)
            for i in range(4):
                x = vload(w, o + qs_at + 32 * i)
                for half in range(2):
                    sub = 2 * i + half
                    sc, mn = _k4_sm(w, o + 4, sub)
                    q = vand(x, m15) if half == 0 else vand(vsrl16(x, 4), m15)
                    if code == Q5_K:
                        q = vor(q, vsll16(vand(vsrl16(hb, sub), m1), 4))
                    _store32(out, 256 * b + 32 * sub, q, d * np.float32(sc), dmin * np.float32(mn), False)
    elif code == Q6_K:
        m3 = vset8(3)
        for b in range(k // 256):
            o = 210 * b
            d = sf16(w, o + 208)
            for h in range(2):
                hi2 = vload(w, o + 128 + 32 * h)
                for i in range(4):
                    low = vload(w, o + 64 * h + 32 * (i % 2))
                    low = vand(low, m15) if i < 2 else vand(vsrl16(low, 4), m15)
                    q = vor(low, vsll16(vand(vsrl16(hi2, 2 * i), m3), 4))
                    g = 8 * h + 2 * i  # two scales of 16 in these 32 values
                    at = 256 * b + 128 * h + 32 * i
                    s0 = vsetf(d * np.float32(_s8(w[o + 192 + g])))
                    s1 = vsetf(d * np.float32(_s8(w[o + 193 + g])))
                    c = vsetf(np.float32(32.0))
                    vstoref(out, 4 * at, vmulf(vsubf(vu8f0(q), c), s0))
                    vstoref(out, 4 * at + 32, vmulf(vsubf(vu8f1(q), c), s0))
                    vstoref(out, 4 * at + 64, vmulf(vsubf(vu8f2(q), c), s1))
                    vstoref(out, 4 * at + 96, vmulf(vsubf(vu8f3(q), c), s1))
    else:
        dequantize_row(code, w, out)


@kernel
def dequantize_rows_avx2(code, w, m0, m1, out):
    for m in range(m0, m1):
        dequantize_row_avx2(code, w[m], out[m - m0])


@kernel(parallel=True)
def dequantize_rows_avx2_par(code, w, m0, m1, out, n_chunks):
    step = (m1 - m0 + n_chunks - 1) // n_chunks
    for c in prange(n_chunks):
        for m in range(m0 + c * step, min(m1, m0 + (c + 1) * step)):
            dequantize_row_avx2(code, w[m], out[m - m0])


@kernel
def get_rows_avx2(code, w, ids, out):
    for i in range(ids.shape[0]):
        r = ids[i]
        if r < 0 or r >= w.shape[0]:
            raise IndexError("get_rows: row id out of range")
        dequantize_row_avx2(code, w[r], out[i])


# ---------------------------------------------------------------------------------------------
# "r8": weights repacked once at load for AVX2 (matmul.repack). Rows in groups of 8; per group
# and 32-block: the 8 rows' f16 scales d, (Q4_1/Q5_1) f16 mins m, (Q5) fifth bits, then the
# quants as 32-bit lanes, one lane per row: vector j holds bytes 4j..4j+3 of every row. One
# maddubs multiplies 4 weights of each of the 8 rows by 4 broadcast activation bytes, so the
# lanes of the accumulator are the 8 rows' results and the scales are applied 8 rows at a time.
# The k-quants (Q4_K, Q5_K, Q6_K) follow the same plan per 256-block (see `_repack_r8_k`).
# ---------------------------------------------------------------------------------------------

R8 = 8
PF_GROUPS = 4  # groups ahead that the r8 kernels prefetch
R8_TYPES = (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)


@kernel(inline="always")
def _r8_block(code):
    """Bytes per group and block, and where the quants start in them."""
    if code == Q4_0:
        return 144, 16
    if code == Q4_1:
        return 160, 32
    if code == Q5_0:
        return 176, 48
    if code == Q5_1:
        return 192, 64
    return 272, 16


def r8_block_bytes(code: int, rows: int = R8) -> int:
    """Bytes of one group of `rows` rows (r8: 8) per block (32 elements, 256 for the k-quants): the
    layout's every part holds a value per row, so it scales with the rows."""
    return ({Q4_K: 1184, Q5_K: 1440, Q6_K: 1680}.get(code) or _r8_block.py_func(code)[0]) * rows // R8


R8_CHUNK_GROUPS = 512  # groups repacked at a time: the temporaries stay small and in cache


def repack_r8(code: int, raw: np.ndarray, rows: int = R8) -> np.ndarray:
    """ggml blocks [M, row bytes] (uint8) -> r8 groups [ceil(M / 8), blocks * group bytes] (uint8);
    with `rows`, groups of that many rows laid out alike (AVX-512's r16, see avx512.py)."""
    one = _repack_r8_k if code in (Q4_K, Q5_K, Q6_K) else _repack_r8_legacy
    m = raw.shape[0]
    groups = (m + rows - 1) // rows
    if groups <= R8_CHUNK_GROUPS:
        return one(code, raw, rows)
    out = None
    for g0 in range(0, groups, R8_CHUNK_GROUPS):
        part = one(code, raw[g0 * rows:(g0 + R8_CHUNK_GROUPS) * rows], rows)
        if out is None:
            out = np.empty((groups, part.shape[1]), dtype=np.uint8)
        out[g0:g0 + part.shape[0]] = part
    return out


def _lanes(q: np.ndarray) -> np.ndarray:
    """[g, b, row, 4 * n bytes] -> [g, b, n vectors * 8 lanes * 4 bytes]: vector j lane r = row r's bytes 4j..4j+3."""
    g, nb, rows, width = q.shape
    return q.reshape(g, nb, rows, width // 4, 4).transpose(0, 1, 3, 2, 4).reshape(g, nb, -1)


def _grouped(raw: np.ndarray, ts: int, rows: int) -> np.ndarray:
    """ggml rows as [groups, blocks, rows, block bytes], zero rows padding the last group."""
    m = raw.shape[0]
    nb = raw.shape[1] // ts
    groups = (m + rows - 1) // rows
    blocks = np.zeros((groups * rows, nb, ts), dtype=np.uint8)
    blocks[:m] = raw.reshape(m, nb, ts)
    return blocks.reshape(groups, rows, nb, ts).transpose(0, 2, 1, 3)


def _repack_r8_k(code: int, raw: np.ndarray, rows: int) -> np.ndarray:
    """Q4_K/Q5_K per group and super-block: d, dmin (8 f16 each), the six-bit scales and mins
    unpacked to bytes [sub-block][row], (Q5_K) the fifth bits as 8 lane vectors of qh, then the
    quants as 32 lane vectors (32 bytes of each row per 64 elements). Q6_K: d, the int8 scales
    [group of 16][row], ql as 32 lane vectors, qh as 16."""
    ts = {Q4_K: 144, Q5_K: 176, Q6_K: 210}[code]
    b = _grouped(raw, ts, rows)
    groups, nb = b.shape[:2]
    if code == Q6_K:
        parts = [b[..., 208:210].reshape(groups, nb, 2 * rows),
                 b[..., 192:208].transpose(0, 1, 3, 2).reshape(groups, nb, 16 * rows),
                 _lanes(b[..., 0:128]), _lanes(b[..., 128:192])]
    else:
        sc = b[..., 4:16]
        lo, hi, mixed = sc[..., 0:4], sc[..., 4:8], sc[..., 8:12]
        scales = np.concatenate([lo & 63, (mixed & 15) | ((lo >> 6) << 4)], axis=-1)  # [g, b, row, sub]
        mins = np.concatenate([hi & 63, (mixed >> 4) | ((hi >> 6) << 4)], axis=-1)
        parts = [b[..., 0:2].reshape(groups, nb, 2 * rows), b[..., 2:4].reshape(groups, nb, 2 * rows),
                 scales.transpose(0, 1, 3, 2).reshape(groups, nb, 8 * rows),
                 mins.transpose(0, 1, 3, 2).reshape(groups, nb, 8 * rows)]
        if code == Q5_K:
            parts.append(_lanes(b[..., 16:48]))
        parts.append(_lanes(b[..., ts - 128:ts]))
    out = np.concatenate(parts, axis=-1)
    assert out.shape[-1] == r8_block_bytes(code, rows)
    return out.reshape(groups, -1)


def _repack_r8_legacy(code: int, raw: np.ndarray, rows: int) -> np.ndarray:
    """The legacy types: per group and block d (8 f16), (Q4_1/Q5_1) m, (Q5) qh, then the quants.

    The last group is padded with zero rows (scale 0). Q5's fifth bits are reordered so that
    bit 2j + h of byte t of a row's 32 bits is the bit of element 16h + 4j + t: the bit that
    joins the nibble in lane byte t of vector j (h = 0: low nibbles, h = 1: high nibbles).
    """
    ts = {Q4_0: 18, Q4_1: 20, Q5_0: 22, Q5_1: 24, Q8_0: 34}[code]
    blocks = _grouped(raw, ts, rows)  # [g, b, row, bytes]
    groups, nb = blocks.shape[:2]
    size, q_at = (v * rows // R8 for v in _r8_block.py_func(code))
    h = 2 * rows  # bytes of one f16 per row
    out = np.empty((groups, nb, size), dtype=np.uint8)
    out[:, :, 0:h] = blocks[:, :, :, 0:2].reshape(groups, nb, h)  # d
    at = 2
    if code in (Q4_1, Q5_1):
        out[:, :, h:2 * h] = blocks[:, :, :, 2:4].reshape(groups, nb, h)  # m
        at = 4
    if code in (Q5_0, Q5_1):
        bits = np.unpackbits(blocks[:, :, :, at:at + 4], axis=-1, bitorder="little")  # element e -> bits[e]
        e = np.array([16 * (i % 2) + 4 * ((i % 8) // 2) + i // 8 for i in range(32)])  # new bit i = 8t + 2j + h
        out[:, :, q_at - 4 * rows:q_at] = np.packbits(bits[..., e], axis=-1, bitorder="little").reshape(groups, nb, -1)
        at += 4
    qs = blocks[:, :, :, at:]  # [g, b, row, 16 or 32 bytes]
    lanes = qs.reshape(groups, nb, rows, -1, 4).transpose(0, 1, 3, 2, 4)  # [g, b, j, row, 4]
    out[:, :, q_at:] = lanes.reshape(groups, nb, -1)
    return out.reshape(groups, nb * size)


@kernel(inline="always")
def _r8_store(out, n, g, m, acc):
    r = R8 * g
    if r + R8 <= m:
        vstoref(out, 4 * (n * out.shape[1] + r), acc)
    else:
        for i in range(m - r):
            out[n, r + i] = vlane(acc, i)


@kernel(inline="always")
def _prefetch_rows(p, g0, g1):
    """Start reading groups g0..g1 (each kernel prefetches PF_GROUPS ahead of where it reads)."""
    for at in range(g0 * p.strides[0], min(g1, p.shape[0]) * p.strides[0], 64):
        prefetch(p, at)


@kernel(_nrt=False)
def _rows_r8_avx2(code, p, qs, d, s, sums, out, g0, g1, n0, n1):
    """Groups g0..g1 of an r8 weight against quantized activation rows n0..n1, one at a time."""
    k = qs.shape[1]
    m = out.shape[1]
    size, q_at = _r8_block(code)
    gs = p.strides[0]
    m15 = vset8(15)
    m16 = vset8(16)
    ones = vset16x2(1, 1)
    for g in range(g0, g1):
        for n in range(n0, n1):
            acc = vzero()
            acc_m = vzero()
            for b in range(k // 32):
                o = g * gs + size * b
                for line in range(0, size, 64):
                    prefetch(p, o + PF_GROUPS * gs + line)
                x = n * k + 32 * b
                if code == Q8_0:
                    lanes = vzero()
                    for j in range(8):
                        q = vload(p, o + q_at + 32 * j)
                        lanes = vadd32(lanes, vmadd(vmaddubs(vabs8(q), vsign8(vbcast32(qs, x + 4 * j), q)), ones))
                elif code == Q4_0 or code == Q4_1:
                    t = vzero()
                    for j in range(4):
                        q = vload(p, o + q_at + 32 * j)
                        t = vadd16(t, vmaddubs(vand(q, m15), vbcast32(qs, x + 4 * j)))
                        t = vadd16(t, vmaddubs(vand(vsrl16(q, 4), m15), vbcast32(qs, x + 16 + 4 * j)))
                    lanes = vmadd(t, ones)  # 8 products of at most 2 * 15 * 127 each fit in 16 bits
                    if code == Q4_0:
                        lanes = vsub32(lanes, vset32(8 * (sums[n, 2 * b] + sums[n, 2 * b + 1])))
                else:
                    hb = vload(p, o + q_at - 32)
                    lanes = vzero()
                    for half in range(2):
                        t = vzero()
                        for j in range(2 * half, 2 * half + 2):
                            q = vload(p, o + q_at + 32 * j)
                            # bit 2j (low nibbles) / 2j + 1 (high) of each byte moved to bit 4
                            h_lo = vsll16(hb, 4 - 2 * j) if 2 * j < 4 else vsrl16(hb, 2 * j - 4)
                            h_hi = vsll16(hb, 3 - 2 * j) if 2 * j + 1 < 4 else vsrl16(hb, 2 * j - 3)
                            lo = vor(vand(q, m15), vand(h_lo, m16))
                            hi = vor(vand(vsrl16(q, 4), m15), vand(h_hi, m16))
                            t = vadd16(t, vmaddubs(lo, vbcast32(qs, x + 4 * j)))
                            t = vadd16(t, vmaddubs(hi, vbcast32(qs, x + 16 + 4 * j)))
                        lanes = vadd32(lanes, vmadd(t, ones))  # 4 products of at most 2 * 31 * 127
                    if code == Q5_0:
                        lanes = vsub32(lanes, vset32(16 * (sums[n, 2 * b] + sums[n, 2 * b + 1])))
                acc = vfma(vmulf(vf16x8(p, o), vsetf(d[n, b])), vcvt(lanes), acc)
                if code == Q4_1 or code == Q5_1:
                    acc_m = vfma(vf16x8(p, o + 16), vsetf(s[n, b]), acc_m)
            _r8_store(out, n, g, m, vaddf(acc, acc_m))


@kernel(inline="always")
def _fifth_bit(hb, bit):
    """Bit `bit` of every byte of hb moved to bit 4 (16-bit shifts; the mask drops what crosses bytes)."""
    return vsll16(hb, 4 - bit) if bit < 4 else vsrl16(hb, bit - 4)


@kernel(_nrt=False)
def _rows_r8_q45_k_avx2(five, p, qs, d, sums, out, g0, g1, n0, n1):
    k = qs.shape[1]
    m = out.shape[1]
    size = 1440 if five else 1184
    q_at = 416 if five else 160
    gs = p.strides[0]
    m15 = vset8(15)
    m16 = vset8(16)
    for g in range(g0, g1):
        for n in range(n0, n1):
            acc = vzero()
            acc_min = vzero()
            for b in range(k // 256):
                o = g * gs + size * b
                for line in range(0, size, 64):
                    prefetch(p, o + PF_GROUPS * gs + line)
                x = n * k + 256 * b
                isum = vzero()
                msum = vzero()
                for i in range(4):
                    for half in range(2):  # four products per 16-bit lane at most (Q5_K: 4 * 2 * 31 * 127)
                        t_lo = vzero()
                        t_hi = vzero()
                        for j in range(4 * half, 4 * half + 4):
                            q = vload(p, o + q_at + 32 * (8 * i + j))
                            lo = vand(q, m15)
                            hi = vand(vsrl16(q, 4), m15)
                            if five:
                                hb = vload(p, o + 160 + 32 * j)
                                lo = vor(lo, vand(_fifth_bit(hb, 2 * i), m16))
                                hi = vor(hi, vand(_fifth_bit(hb, 2 * i + 1), m16))
                            t_lo = vadd16(t_lo, vmaddubs(lo, vbcast32(qs, x + 64 * i + 4 * j)))
                            t_hi = vadd16(t_hi, vmaddubs(hi, vbcast32(qs, x + 64 * i + 32 + 4 * j)))
                        isum = vadd32(isum, vmadd(t_lo, vu8pair(p, o + 32 + 16 * i)))
                        isum = vadd32(isum, vmadd(t_hi, vu8pair(p, o + 40 + 16 * i)))
                for sub in range(8):
                    a_sum = sums[n, 16 * b + 2 * sub] + sums[n, 16 * b + 2 * sub + 1]
                    msum = vadd32(msum, vmadd(vu8lo(p, o + 96 + 8 * sub), vset16x2(a_sum, a_sum)))
                da = vsetf(d[n, b])
                acc = vfma(vmulf(vf16x8(p, o), da), vcvt(isum), acc)
                acc_min = vfma(vmulf(vf16x8(p, o + 16), da), vcvt(msum), acc_min)
            _r8_store(out, n, g, m, vsubf(acc, acc_min))


@kernel(_nrt=False)
def _rows_r8_q6_k_avx2(p, qs, d, sums, out, g0, g1, n0, n1):
    k = qs.shape[1]
    m = out.shape[1]
    size = 1680
    gs = p.strides[0]
    m15 = vset8(15)
    m48 = vset8(48)
    for g in range(g0, g1):
        for n in range(n0, n1):
            acc = vzero()
            for b in range(k // 256):
                o = g * gs + size * b
                for line in range(0, size, 64):
                    prefetch(p, o + PF_GROUPS * gs + line)
                x = n * k + 256 * b
                isum = vzero()
                osum = vzero()  # sum over groups of scale * activation sum (the -32 offset)
                for h in range(2):
                    for c in range(2):
                        for jj in range(0, 8, 2):  # two products per 16-bit lane at most (2 * 63 * 127 * 2)
                            t_lo = vzero()
                            t_hi = vzero()
                            for j in range(jj, jj + 2):
                                q = vload(p, o + 144 + 32 * (16 * h + 8 * c + j))
                                hq = vload(p, o + 1168 + 32 * (8 * h + j))
                                lo = vor(vand(q, m15), vand(_fifth_bit(hq, 2 * c), m48))
                                hi = vor(vand(vsrl16(q, 4), m15), vand(_fifth_bit(hq, 2 * c + 4), m48))
                                t_lo = vadd16(t_lo, vmaddubs(lo, vbcast32(qs, x + 128 * h + 32 * c + 4 * j)))
                                t_hi = vadd16(t_hi, vmaddubs(hi, vbcast32(qs, x + 128 * h + 32 * c + 64 + 4 * j)))
                            grp = 8 * h + 2 * c + jj // 4  # 16 elements per scale
                            isum = vadd32(isum, vmadd(t_lo, vs8pair(p, o + 16 + 8 * grp)))
                            isum = vadd32(isum, vmadd(t_hi, vs8pair(p, o + 16 + 8 * (grp + 4))))
                for grp in range(16):
                    a_sum = sums[n, 16 * b + grp]
                    osum = vadd32(osum, vmadd(vs8lo(p, o + 16 + 8 * grp), vset16x2(a_sum, a_sum)))
                isum = vsub32(isum, vsll32(osum, 5))
                acc = vfma(vmulf(vf16x8(p, o), vsetf(d[n, b])), vcvt(isum), acc)
            _r8_store(out, n, g, m, acc)


# Four activation rows at a time (prompt batches): each weight vector is loaded and unpacked once
# for four rows, and the group's blocks stay in L1 while every row meets them. Per row and lane the
# float steps are those of the one-row kernels above, in the same order, so a row's results do not
# depend on the batch it came in (the integer block sums are exact in any order).
TOKENS = 4  # activation rows per pass of the tiled kernels


@kernel(inline="always")
def _nib_pair(lo, hi, qs, x, j, t):
    """t plus the products of 8 rows' 4 low and 4 high nibbles (lane vector j) with a row's bytes at x."""
    t = vadd16(t, vmaddubs(lo, vbcast32(qs, x + 4 * j)))
    return vadd16(t, vmaddubs(hi, vbcast32(qs, x + 16 + 4 * j)))


@kernel(inline="always")
def _q8_step(a, q, qs, x, j, ones, lanes):
    """lanes plus the products of 8 rows' signed bytes (lane vector j: q, its magnitudes a) with a row's bytes at x."""
    return vadd32(lanes, vmadd(vmaddubs(a, vsign8(vbcast32(qs, x + 4 * j), q)), ones))


@kernel(inline="always")
def _scaled(wd, d, n, b, lanes, acc):
    """acc plus integer lanes times the 8 rows' scales wd and activation row n's block-b scale
    (the one-row kernels' float step, in their order)."""
    return vfma(vmulf(wd, vsetf(d[n, b])), vcvt(lanes), acc)


@kernel(_nrt=False)
def _rows_r8_x4_avx2(code, p, qs, d, s, sums, out, g0, g1, n0, n1):
    """Groups g0..g1 of an r8 weight (legacy types) against activation rows n0..n1 (a multiple of 4 rows)."""
    k = qs.shape[1]
    m = out.shape[1]
    size, q_at = _r8_block(code)
    gs = p.strides[0]
    m15 = vset8(15)
    m16 = vset8(16)
    ones = vset16x2(1, 1)
    for g in range(g0, g1):
        _prefetch_rows(p, g + 1, g + 2)
        for n in range(n0, n1, TOKENS):
            acc0 = vzero()
            acc1 = vzero()
            acc2 = vzero()
            acc3 = vzero()
            for b in range(k // 32):
                o = g * gs + size * b
                x0 = n * k + 32 * b
                x1 = x0 + k
                x2 = x1 + k
                x3 = x2 + k
                if code == Q8_0:
                    l0 = vzero()
                    l1 = vzero()
                    l2 = vzero()
                    l3 = vzero()
                    for j in range(8):
                        q = vload(p, o + q_at + 32 * j)
                        a = vabs8(q)
                        l0 = _q8_step(a, q, qs, x0, j, ones, l0)
                        l1 = _q8_step(a, q, qs, x1, j, ones, l1)
                        l2 = _q8_step(a, q, qs, x2, j, ones, l2)
                        l3 = _q8_step(a, q, qs, x3, j, ones, l3)
                elif code == Q4_0 or code == Q4_1:
                    t0 = vzero()
                    t1 = vzero()
                    t2 = vzero()
                    t3 = vzero()
                    for j in range(4):
                        q = vload(p, o + q_at + 32 * j)
                        lo = vand(q, m15)
                        hi = vand(vsrl16(q, 4), m15)
                        t0 = _nib_pair(lo, hi, qs, x0, j, t0)
                        t1 = _nib_pair(lo, hi, qs, x1, j, t1)
                        t2 = _nib_pair(lo, hi, qs, x2, j, t2)
                        t3 = _nib_pair(lo, hi, qs, x3, j, t3)
                    l0 = vmadd(t0, ones)
                    l1 = vmadd(t1, ones)
                    l2 = vmadd(t2, ones)
                    l3 = vmadd(t3, ones)
                else:
                    hb = vload(p, o + q_at - 32)
                    l0 = vzero()
                    l1 = vzero()
                    l2 = vzero()
                    l3 = vzero()
                    for half in range(2):
                        t0 = vzero()
                        t1 = vzero()
                        t2 = vzero()
                        t3 = vzero()
                        for j in range(2 * half, 2 * half + 2):
                            q = vload(p, o + q_at + 32 * j)
                            lo = vor(vand(q, m15), vand(_fifth_bit(hb, 2 * j), m16))
                            hi = vor(vand(vsrl16(q, 4), m15), vand(_fifth_bit(hb, 2 * j + 1), m16))
                            t0 = _nib_pair(lo, hi, qs, x0, j, t0)
                            t1 = _nib_pair(lo, hi, qs, x1, j, t1)
                            t2 = _nib_pair(lo, hi, qs, x2, j, t2)
                            t3 = _nib_pair(lo, hi, qs, x3, j, t3)
                        l0 = vadd32(l0, vmadd(t0, ones))
                        l1 = vadd32(l1, vmadd(t1, ones))
                        l2 = vadd32(l2, vmadd(t2, ones))
                        l3 = vadd32(l3, vmadd(t3, ones))
                if code == Q4_0 or code == Q5_0:
                    off = 8 if code == Q4_0 else 16
                    l0 = vsub32(l0, vset32(off * (sums[n, 2 * b] + sums[n, 2 * b + 1])))
                    l1 = vsub32(l1, vset32(off * (sums[n + 1, 2 * b] + sums[n + 1, 2 * b + 1])))
                    l2 = vsub32(l2, vset32(off * (sums[n + 2, 2 * b] + sums[n + 2, 2 * b + 1])))
                    l3 = vsub32(l3, vset32(off * (sums[n + 3, 2 * b] + sums[n + 3, 2 * b + 1])))
                wd = vf16x8(p, o)
                acc0 = _scaled(wd, d, n, b, l0, acc0)
                acc1 = _scaled(wd, d, n + 1, b, l1, acc1)
                acc2 = _scaled(wd, d, n + 2, b, l2, acc2)
                acc3 = _scaled(wd, d, n + 3, b, l3, acc3)
            if code == Q4_1 or code == Q5_1:  # the mins' chain, as the one-row kernel keeps it apart
                m0 = vzero()
                m1 = vzero()
                m2 = vzero()
                m3 = vzero()
                for b in range(k // 32):
                    wm = vf16x8(p, g * gs + size * b + 16)
                    m0 = vfma(wm, vsetf(s[n, b]), m0)
                    m1 = vfma(wm, vsetf(s[n + 1, b]), m1)
                    m2 = vfma(wm, vsetf(s[n + 2, b]), m2)
                    m3 = vfma(wm, vsetf(s[n + 3, b]), m3)
                acc0 = vaddf(acc0, m0)
                acc1 = vaddf(acc1, m1)
                acc2 = vaddf(acc2, m2)
                acc3 = vaddf(acc3, m3)
            _r8_store(out, n, g, m, acc0)
            _r8_store(out, n + 1, g, m, acc1)
            _r8_store(out, n + 2, g, m, acc2)
            _r8_store(out, n + 3, g, m, acc3)


@kernel(inline="always")
def _two_products(lo, hi, qs, x_lo, x_hi, t_lo, t_hi):
    """(t_lo, t_hi) plus the products of 8 rows' values lo and hi with a row's bytes at x_lo, x_hi."""
    return vadd16(t_lo, vmaddubs(lo, vbcast32(qs, x_lo))), vadd16(t_hi, vmaddubs(hi, vbcast32(qs, x_hi)))


@kernel(inline="always")
def _pair_sum(sums, n, at):
    a = sums[n, at] + sums[n, at + 1]
    return vset16x2(a, a)


@kernel(inline="always")
def _one_sum(sums, n, at):
    a = sums[n, at]
    return vset16x2(a, a)


@kernel(_nrt=False)
def _rows_r8_x4_q45_k_avx2(five, p, qs, d, sums, out, g0, g1, n0, n1):
    """Q4_K / Q5_K groups g0..g1 against activation rows n0..n1 (a multiple of 4 rows), as
    `_rows_r8_q45_k_avx2` computes each row."""
    k = qs.shape[1]
    m = out.shape[1]
    size = 1440 if five else 1184
    q_at = 416 if five else 160
    gs = p.strides[0]
    m15 = vset8(15)
    m16 = vset8(16)
    for g in range(g0, g1):
        _prefetch_rows(p, g + 1, g + 2)
        for n in range(n0, n1, TOKENS):
            acc0 = vzero()
            acc1 = vzero()
            acc2 = vzero()
            acc3 = vzero()
            for b in range(k // 256):
                o = g * gs + size * b
                x0 = n * k + 256 * b
                x1 = x0 + k
                x2 = x1 + k
                x3 = x2 + k
                i0 = vzero()
                i1 = vzero()
                i2 = vzero()
                i3 = vzero()
                for i in range(4):
                    for half in range(2):
                        lo0 = vzero()
                        hi0 = vzero()
                        lo1 = vzero()
                        hi1 = vzero()
                        lo2 = vzero()
                        hi2 = vzero()
                        lo3 = vzero()
                        hi3 = vzero()
                        for jj in range(4):  # a constant trip count: LLVM unrolls it
                            j = 4 * half + jj
                            q = vload(p, o + q_at + 32 * (8 * i + j))
                            lo = vand(q, m15)
                            hi = vand(vsrl16(q, 4), m15)
                            if five:
                                hb = vload(p, o + 160 + 32 * j)
                                lo = vor(lo, vand(_fifth_bit(hb, 2 * i), m16))
                                hi = vor(hi, vand(_fifth_bit(hb, 2 * i + 1), m16))
                            at = 64 * i + 4 * j
                            lo0, hi0 = _two_products(lo, hi, qs, x0 + at, x0 + at + 32, lo0, hi0)
                            lo1, hi1 = _two_products(lo, hi, qs, x1 + at, x1 + at + 32, lo1, hi1)
                            lo2, hi2 = _two_products(lo, hi, qs, x2 + at, x2 + at + 32, lo2, hi2)
                            lo3, hi3 = _two_products(lo, hi, qs, x3 + at, x3 + at + 32, lo3, hi3)
                        sc_lo = vu8pair(p, o + 32 + 16 * i)
                        sc_hi = vu8pair(p, o + 40 + 16 * i)
                        i0 = vadd32(vadd32(i0, vmadd(lo0, sc_lo)), vmadd(hi0, sc_hi))
                        i1 = vadd32(vadd32(i1, vmadd(lo1, sc_lo)), vmadd(hi1, sc_hi))
                        i2 = vadd32(vadd32(i2, vmadd(lo2, sc_lo)), vmadd(hi2, sc_hi))
                        i3 = vadd32(vadd32(i3, vmadd(lo3, sc_lo)), vmadd(hi3, sc_hi))
                wd = vf16x8(p, o)
                acc0 = _scaled(wd, d, n, b, i0, acc0)
                acc1 = _scaled(wd, d, n + 1, b, i1, acc1)
                acc2 = _scaled(wd, d, n + 2, b, i2, acc2)
                acc3 = _scaled(wd, d, n + 3, b, i3, acc3)
            # the mins' chain, apart as in the one-row kernel
            a0 = vzero()
            a1 = vzero()
            a2 = vzero()
            a3 = vzero()
            for b in range(k // 256):
                o = g * gs + size * b
                m0 = vzero()
                m1 = vzero()
                m2 = vzero()
                m3 = vzero()
                for sub in range(8):
                    mins = vu8lo(p, o + 96 + 8 * sub)
                    m0 = vadd32(m0, vmadd(mins, _pair_sum(sums, n, 16 * b + 2 * sub)))
                    m1 = vadd32(m1, vmadd(mins, _pair_sum(sums, n + 1, 16 * b + 2 * sub)))
                    m2 = vadd32(m2, vmadd(mins, _pair_sum(sums, n + 2, 16 * b + 2 * sub)))
                    m3 = vadd32(m3, vmadd(mins, _pair_sum(sums, n + 3, 16 * b + 2 * sub)))
                wmin = vf16x8(p, o + 16)
                a0 = _scaled(wmin, d, n, b, m0, a0)
                a1 = _scaled(wmin, d, n + 1, b, m1, a1)
                a2 = _scaled(wmin, d, n + 2, b, m2, a2)
                a3 = _scaled(wmin, d, n + 3, b, m3, a3)
            _r8_store(out, n, g, m, vsubf(acc0, a0))
            _r8_store(out, n + 1, g, m, vsubf(acc1, a1))
            _r8_store(out, n + 2, g, m, vsubf(acc2, a2))
            _r8_store(out, n + 3, g, m, vsubf(acc3, a3))


@kernel(_nrt=False)
def _rows_r8_x4_q6_k_avx2(p, qs, d, sums, out, g0, g1, n0, n1):
    """Q6_K groups g0..g1 against activation rows n0..n1 (a multiple of 4 rows), as `_rows_r8_q6_k_avx2`
    computes each row."""
    k = qs.shape[1]
    m = out.shape[1]
    size = 1680
    gs = p.strides[0]
    m15 = vset8(15)
    m48 = vset8(48)
    for g in range(g0, g1):
        _prefetch_rows(p, g + 1, g + 2)
        for n in range(n0, n1, TOKENS):
            acc0 = vzero()
            acc1 = vzero()
            acc2 = vzero()
            acc3 = vzero()
            for b in range(k // 256):
                o = g * gs + size * b
                x0 = n * k + 256 * b
                x1 = x0 + k
                x2 = x1 + k
                x3 = x2 + k
                i0 = vzero()
                i1 = vzero()
                i2 = vzero()
                i3 = vzero()
                for h in range(2):
                    for c in range(2):
                        for jj in range(0, 8, 2):
                            lo0 = vzero()
                            hi0 = vzero()
                            lo1 = vzero()
                            hi1 = vzero()
                            lo2 = vzero()
                            hi2 = vzero()
                            lo3 = vzero()
                            hi3 = vzero()
                            for j in range(jj, jj + 2):
                                q = vload(p, o + 144 + 32 * (16 * h + 8 * c + j))
                                hq = vload(p, o + 1168 + 32 * (8 * h + j))
                                lo = vor(vand(q, m15), vand(_fifth_bit(hq, 2 * c), m48))
                                hi = vor(vand(vsrl16(q, 4), m15), vand(_fifth_bit(hq, 2 * c + 4), m48))
                                at = 128 * h + 32 * c + 4 * j
                                lo0, hi0 = _two_products(lo, hi, qs, x0 + at, x0 + at + 64, lo0, hi0)
                                lo1, hi1 = _two_products(lo, hi, qs, x1 + at, x1 + at + 64, lo1, hi1)
                                lo2, hi2 = _two_products(lo, hi, qs, x2 + at, x2 + at + 64, lo2, hi2)
                                lo3, hi3 = _two_products(lo, hi, qs, x3 + at, x3 + at + 64, lo3, hi3)
                            grp = 8 * h + 2 * c + jj // 4
                            sc_lo = vs8pair(p, o + 16 + 8 * grp)
                            sc_hi = vs8pair(p, o + 16 + 8 * (grp + 4))
                            i0 = vadd32(vadd32(i0, vmadd(lo0, sc_lo)), vmadd(hi0, sc_hi))
                            i1 = vadd32(vadd32(i1, vmadd(lo1, sc_lo)), vmadd(hi1, sc_hi))
                            i2 = vadd32(vadd32(i2, vmadd(lo2, sc_lo)), vmadd(hi2, sc_hi))
                            i3 = vadd32(vadd32(i3, vmadd(lo3, sc_lo)), vmadd(hi3, sc_hi))
                o0 = vzero()
                o1 = vzero()
                o2 = vzero()
                o3 = vzero()
                for grp in range(16):  # the -32 offset: scale times the activations' sum, per group
                    sc = vs8lo(p, o + 16 + 8 * grp)
                    o0 = vadd32(o0, vmadd(sc, _one_sum(sums, n, 16 * b + grp)))
                    o1 = vadd32(o1, vmadd(sc, _one_sum(sums, n + 1, 16 * b + grp)))
                    o2 = vadd32(o2, vmadd(sc, _one_sum(sums, n + 2, 16 * b + grp)))
                    o3 = vadd32(o3, vmadd(sc, _one_sum(sums, n + 3, 16 * b + grp)))
                wd = vf16x8(p, o)
                acc0 = _scaled(wd, d, n, b, vsub32(i0, vsll32(o0, 5)), acc0)
                acc1 = _scaled(wd, d, n + 1, b, vsub32(i1, vsll32(o1, 5)), acc1)
                acc2 = _scaled(wd, d, n + 2, b, vsub32(i2, vsll32(o2, 5)), acc2)
                acc3 = _scaled(wd, d, n + 3, b, vsub32(i3, vsll32(o3, 5)), acc3)
            _r8_store(out, n, g, m, acc0)
            _r8_store(out, n + 1, g, m, acc1)
            _r8_store(out, n + 2, g, m, acc2)
            _r8_store(out, n + 3, g, m, acc3)


@kernel(_nrt=False)
def _rows_r8_any_avx2(code, p, qs, d, s, sums, out, g0, g1, n0, n1):
    """Groups g0..g1 of an r8 weight against activation rows n0..n1: four at a time, the last
    (n1 - n0) % 4 one at a time."""
    n4 = n0 + (n1 - n0) // TOKENS * TOKENS
    if n4 > n0:  # (the tiled kernels prefetch each next group: not for nothing)
        if code == Q4_K or code == Q5_K:
            _rows_r8_x4_q45_k_avx2(code == Q5_K, p, qs, d, sums, out, g0, g1, n0, n4)
        elif code == Q6_K:
            _rows_r8_x4_q6_k_avx2(p, qs, d, sums, out, g0, g1, n0, n4)
        else:
            _rows_r8_x4_avx2(code, p, qs, d, s, sums, out, g0, g1, n0, n4)
    if n1 > n4:
        if code == Q4_K or code == Q5_K:
            _rows_r8_q45_k_avx2(code == Q5_K, p, qs, d, sums, out, g0, g1, n4, n1)
        elif code == Q6_K:
            _rows_r8_q6_k_avx2(p, qs, d, sums, out, g0, g1, n4, n1)
        else:
            _rows_r8_avx2(code, p, qs, d, s, sums, out, g0, g1, n4, n1)


# Several weights read with the same activation blocks (a fused mul_mat_multi) run in one call:
# the activation rows are quantized once and the weights' groups are counted one after another.
# The call always takes MAX_PARTS weights (one compiled signature for one, two or three): slots
# past n_parts repeat a real weight and are never read.
MAX_PARTS = 3


@kernel(_nrt=False)
def _r8_parts(codes, packs, n_parts, qs, d, s, sums, outs, g0, g1):
    """Groups g0..g1 of the first n_parts weights, part i's groups following part i - 1's, against
    every activation row: part i's rows go to outs[i]."""
    base = 0
    for i in range(n_parts):
        p = packs[i]
        lo = max(g0 - base, 0)
        hi = min(g1 - base, p.shape[0])
        if lo < hi:
            _prefetch_rows(p, lo, lo + PF_GROUPS)
            _rows_r8_any_avx2(codes[i], p, qs, d, s, sums, outs[i], lo, hi, 0, qs.shape[0])
        base += p.shape[0]


@kernel(inline="always")
def _groups(packs, n_parts):
    total = 0
    for i in range(n_parts):
        total += packs[i].shape[0]
    return total


@kernel
def mul_mat_r8_avx2(codes, act, packs, n_parts, x, qs, d, s, sums, outs):
    """outs[i] = x @ w_i^T for the r8 weights packs[i] of types codes[i], i < n_parts (MAX_PARTS
    slots each), x quantized once to the `act` blocks they all read."""
    _prefetch_rows(packs[0], 0, PF_GROUPS)  # the first rows arrive while x is quantized
    quantize_rows_avx2(act, x, qs, d, s, sums)
    _r8_parts(codes, packs, n_parts, qs, d, s, sums, outs, 0, _groups(packs, n_parts))


@kernel(parallel=True)
def mul_mat_r8_avx2_par(codes, act, packs, n_parts, x, qs, d, s, sums, outs, n_chunks):
    quantize_rows_avx2(act, x, qs, d, s, sums)
    total = _groups(packs, n_parts)
    step = (total + n_chunks - 1) // n_chunks
    for c in prange(n_chunks):
        _r8_parts(codes, packs, n_parts, qs, d, s, sums, outs, c * step, min(total, (c + 1) * step))


# A gated feed-forward's first half (mul_mat_glu): the gate's and the up's rows of one chunk of
# groups, then the GLU of the two while they are in cache. The gate's rows go to the result, the
# up's to a tile of the caller's scratch, `step` groups at a time; threads split the groups.
@kernel
def glu_rows(kind, table, out, up):
    """out = glu(out, up) for [N, M] arrays (kind: GLU_SWIGLU, GLU_GEGLU or GLU_GEGLU_TABLE)."""
    glu_span(kind, table, out, up, 0, out.shape[1])


@kernel(_nrt=False)
def _r8_glu_groups(codes, pg, pu, kind, table, qs, d, s, sums, out, tile, g0, g1, step):
    """Groups g0..g1 of the r8 gate pg and up pu, `step` groups at a time: the gate's rows into out,
    the up's into tile (f32, at least N * 8 * step), then out = glu(gate, up) over those rows."""
    n = qs.shape[0]
    m = out.shape[1]
    for a in range(g0, g1, step):
        b = min(a + step, g1)
        r0, r1 = R8 * a, min(R8 * b, m)
        _rows_r8_any_avx2(codes[0], pg, qs, d, s, sums, out, a, b, 0, n)
        up = tile[:n * (r1 - r0)].reshape((n, r1 - r0))
        _rows_r8_any_avx2(codes[1], pu[a:b], qs, d, s, sums, up, 0, b - a, 0, n)
        glu_span(kind, table, out, up, r0, r1)


@kernel
def mul_mat_glu_r8_avx2(codes, act, pg, pu, kind, table, x, qs, d, s, sums, out, tiles, step):
    """out = glu(x @ gate^T, x @ up^T) for r8 weights pg and pu of types codes[0], codes[1] that
    read the same `act` blocks: x quantized once, tiles[0] holding the up's rows of each step."""
    _prefetch_rows(pg, 0, PF_GROUPS)
    quantize_rows_avx2(act, x, qs, d, s, sums)
    _r8_glu_groups(codes, pg, pu, kind, table, qs, d, s, sums, out, tiles[0], 0, pg.shape[0], step)


@kernel(parallel=True)
def mul_mat_glu_r8_avx2_par(codes, act, pg, pu, kind, table, x, qs, d, s, sums, out, tiles, step, n_chunks):
    quantize_rows_avx2(act, x, qs, d, s, sums)
    total = pg.shape[0]
    per = (total + n_chunks - 1) // n_chunks
    for c in prange(n_chunks):
        _r8_glu_groups(codes, pg, pu, kind, table, qs, d, s, sums, out, tiles[c], c * per,
                       min(total, (c + 1) * per), step)


# ---------------------------------------------------------------------------------------------
# "ri64": the legacy types repacked for the portable kernels (CPUs without AVX2). Rows in groups
# of 64; per group and block, byte t of all 64 rows is contiguous (q [groups, blocks, bytes, 64]),
# so the innermost loop runs across rows with a broadcast activation value: LLVM vectorizes it
# (no horizontal sum). Scales and mins are f32 [groups, blocks, 64]; Q5's values are whole bytes.
# ---------------------------------------------------------------------------------------------

RI = 64


class RI64(NamedTuple):
    """A weight in the ri64 layout (see above)."""

    q: np.ndarray
    d: np.ndarray
    m: np.ndarray


def repack_ri64(code: int, raw: np.ndarray) -> RI64:
    """ggml blocks [M, row bytes] (uint8) of a legacy type -> RI64, zero rows padding the last group."""
    from ggrun.core.quants import dequantize

    ts = {Q4_0: 18, Q4_1: 20, Q5_0: 22, Q5_1: 24, Q8_0: 34}[code]
    m = raw.shape[0]
    nb = raw.shape[1] // ts
    groups = (m + RI - 1) // RI
    blocks = np.zeros((groups * RI, nb, ts), dtype=np.uint8)
    blocks[:m] = raw.reshape(m, nb, ts)
    by_row = blocks.reshape(groups, RI, nb, ts)
    d = by_row[..., 0:2].copy().view("<f2")[..., 0].astype(np.float32).transpose(0, 2, 1)
    mins = np.zeros_like(d)
    if code in (Q4_1, Q5_1):
        mins = by_row[..., 2:4].copy().view("<f2")[..., 0].astype(np.float32).transpose(0, 2, 1)
    if code in (Q4_0, Q4_1):
        q = by_row[..., ts - 16:]
    elif code == Q8_0:
        q = by_row[..., 2:]
    else:  # Q5: the values 0..31 as bytes (the decoded value is d * (q - 16) or d * q + m)
        name = "Q5_0" if code == Q5_0 else "Q5_1"
        one = blocks.copy()
        one[..., 0:2] = np.array([1.0], "<f2").view(np.uint8)  # d = 1, m = 0: the integers
        if code == Q5_1:
            one[..., 2:4] = 0
        values = dequantize(one.reshape(-1), name, (groups * RI, nb * 32)) + (16 if code == Q5_0 else 0)
        q = values.astype(np.uint8).reshape(groups, RI, nb, 32)
    return RI64(np.ascontiguousarray(q.transpose(0, 2, 3, 1)), np.ascontiguousarray(d), np.ascontiguousarray(mins))


@kernel(_nrt=False)
def _rows_ri_portable(code, q, dv, mv, qs, d, s, sums, out, work, g0, g1):
    """Groups g0..g1 of an ri64 weight against every quantized activation row; work: f32 [2, 64]."""
    nb = q.shape[1]
    m = out.shape[1]
    acc_i = work[0].view(np.int32)
    acc_f = work[1]
    for g in range(g0, g1):
        for n in range(qs.shape[0]):
            x = qs[n]
            for r in range(RI):
                acc_f[r] = 0.0
            for b in range(nb):
                for r in range(RI):
                    acc_i[r] = 0
                if code == Q4_0 or code == Q4_1:
                    for t in range(16):
                        xl = np.int32(x[32 * b + t])
                        xh = np.int32(x[32 * b + 16 + t])
                        qq = q[g, b, t]
                        for r in range(RI):
                            v = np.int32(qq[r])
                            acc_i[r] += (v & 15) * xl + (v >> 4) * xh
                elif code == Q8_0:
                    for t in range(32):
                        xv = np.int32(x[32 * b + t])
                        qq = q[g, b, t]
                        for r in range(RI):
                            acc_i[r] += ((np.int32(qq[r]) ^ 128) - 128) * xv
                else:
                    for t in range(32):
                        xv = np.int32(x[32 * b + t])
                        qq = q[g, b, t]
                        for r in range(RI):
                            acc_i[r] += np.int32(qq[r]) * xv
                if code == Q4_0 or code == Q5_0:  # q - 8 or q - 16
                    off = (8 if code == Q4_0 else 16) * (sums[n, 2 * b] + sums[n, 2 * b + 1])
                    for r in range(RI):
                        acc_i[r] -= off
                da = d[n, b]
                if code == Q4_1 or code == Q5_1:
                    sb = s[n, b]
                    for r in range(RI):
                        acc_f[r] += np.float32(acc_i[r]) * (dv[g, b, r] * da) + mv[g, b, r] * sb
                else:
                    for r in range(RI):
                        acc_f[r] += np.float32(acc_i[r]) * (dv[g, b, r] * da)
            for r in range(min(RI, m - g * RI)):
                out[n, g * RI + r] = acc_f[r]


@kernel
def mul_mat_ri_portable(code, act, q, dv, mv, x, qs, d, s, sums, out, work):
    quantize_rows(act, x, qs, d, s, sums)
    _rows_ri_portable(code, q, dv, mv, qs, d, s, sums, out, work[0], 0, q.shape[0])


@kernel(parallel=True)
def mul_mat_ri_portable_par(code, act, q, dv, mv, x, qs, d, s, sums, out, work, n_chunks):
    quantize_rows(act, x, qs, d, s, sums)
    step = (q.shape[0] + n_chunks - 1) // n_chunks
    for c in prange(n_chunks):
        _rows_ri_portable(code, q, dv, mv, qs, d, s, sums, out, work[c], c * step, min(q.shape[0], (c + 1) * step))


# ---------------------------------------------------------------------------------------------
# Matrix products of a stored weight w [M, row bytes] with activation rows x [N, K]:
# out [N, M]. Every row of w is read once from memory and dotted with all N rows (N is small).
# The *_par variants split w's rows into n_chunks ranges over numba's threads.
# ---------------------------------------------------------------------------------------------

@kernel(_nrt=False)
def _rows_q8_portable(code, w, qs, d, s, sums, out, m0, m1):
    for m in range(m0, m1):
        row = w[m]
        for n in range(qs.shape[0]):
            out[n, m] = dot_portable(code, row, qs[n], d[n], s[n], sums[n])


@kernel(_nrt=False)
def _rows_q8_avx2(code, w, qs, d, s, sums, out, m0, m1):
    if code == Q4_0:
        _rows_q4_0_avx2(w, qs, d, s, sums, out, m0, m1)
    elif code == Q4_1:
        _rows_q4_1_avx2(w, qs, d, s, sums, out, m0, m1)
    elif code == Q5_0:
        _rows_q5_0_avx2(w, qs, d, s, sums, out, m0, m1)
    elif code == Q5_1:
        _rows_q5_1_avx2(w, qs, d, s, sums, out, m0, m1)
    elif code == Q8_0:
        _rows_q8_0_avx2(w, qs, d, s, sums, out, m0, m1)
    elif code == Q2_K:
        _rows_q2_k_avx2(w, qs, d, s, sums, out, m0, m1)
    elif code == Q3_K:
        _rows_q3_k_avx2(w, qs, d, s, sums, out, m0, m1)
    elif code == Q4_K:
        _rows_q4_k_avx2(w, qs, d, s, sums, out, m0, m1)
    elif code == Q5_K:
        _rows_q5_k_avx2(w, qs, d, s, sums, out, m0, m1)
    elif code == Q6_K:
        _rows_q6_k_avx2(w, qs, d, s, sums, out, m0, m1)


@kernel
def mul_mat_q8_portable(code, act, w, x, qs, d, s, sums, out):
    """Quantize x's rows to `act` blocks, then ggml's integer dot products, row by row of w."""
    quantize_rows(act, x, qs, d, s, sums)
    _rows_q8_portable(code, w, qs, d, s, sums, out, 0, w.shape[0])


@kernel(parallel=True)
def mul_mat_q8_portable_par(code, act, w, x, qs, d, s, sums, out, n_chunks):
    quantize_rows(act, x, qs, d, s, sums)
    step = (w.shape[0] + n_chunks - 1) // n_chunks
    for c in prange(n_chunks):
        _rows_q8_portable(code, w, qs, d, s, sums, out, c * step, min(w.shape[0], (c + 1) * step))


@kernel
def mul_mat_q8_avx2(code, act, w, x, qs, d, s, sums, out):
    quantize_rows_avx2(act, x, qs, d, s, sums)
    _rows_q8_avx2(code, w, qs, d, s, sums, out, 0, w.shape[0])


@kernel(parallel=True)
def mul_mat_q8_avx2_par(code, act, w, x, qs, d, s, sums, out, n_chunks):
    quantize_rows_avx2(act, x, qs, d, s, sums)
    step = (w.shape[0] + n_chunks - 1) // n_chunks
    for c in prange(n_chunks):
        _rows_q8_avx2(code, w, qs, d, s, sums, out, c * step, min(w.shape[0], (c + 1) * step))


@kernel
def _rows_f32_portable(code, w, x, buf, out, m0, m1):
    for m in range(m0, m1):
        dequantize_row(code, w[m], buf)
        for n in range(x.shape[0]):
            out[n, m] = _dotf_portable(buf, x[n])


@kernel
def _rows_f32_avx2(code, w, x, buf, out, m0, m1):
    for m in range(m0, m1):
        row = w[m]
        if code == F16 or code == BF16:
            for n in range(x.shape[0]):
                out[n, m] = _dotf_avx2(code, row, x[n])
        else:
            dequantize_row_avx2(code, row, buf)
            for n in range(x.shape[0]):
                out[n, m] = _dotf_avx2(F32, buf, x[n])


@kernel
def mul_mat_f32_portable(code, w, x, buf, out):
    """Rows of w decoded one at a time into buf[0] (f32 [K]) and dotted with f32 rows x."""
    _rows_f32_portable(code, w, x, buf[0], out, 0, w.shape[0])


@kernel(parallel=True)
def mul_mat_f32_portable_par(code, w, x, buf, out, n_chunks):
    step = (w.shape[0] + n_chunks - 1) // n_chunks
    for c in prange(n_chunks):
        _rows_f32_portable(code, w, x, buf[c], out, c * step, min(w.shape[0], (c + 1) * step))


@kernel
def mul_mat_f32_avx2(code, w, x, buf, out):
    _rows_f32_avx2(code, w, x, buf[0], out, 0, w.shape[0])


@kernel(parallel=True)
def mul_mat_f32_avx2_par(code, w, x, buf, out, n_chunks):
    step = (w.shape[0] + n_chunks - 1) // n_chunks
    for c in prange(n_chunks):
        _rows_f32_avx2(code, w, x, buf[c], out, c * step, min(w.shape[0], (c + 1) * step))
