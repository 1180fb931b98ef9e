"""Activation rows quantized to ggml's 8-bit blocks before an integer dot product (Q8_0, Q8_1, Q8_K), and
the rounding of rows as ggml's CPU sees them (round_rows): portable, and 32 values at a time on AVX2.

ggml's rounding (ggml-cpu/arch/x86/quants.c): Q8_0/Q8_1: d = amax/127 stored as f16,
q = round-half-even(x * 127/amax); Q8_K: d = max/-127 as f32. Every product kernel starts with one of
these, so this file is listed in jit.SHARED_SOURCES.
"""
from __future__ import annotations

import numpy as np

from ggrun.core.backends.cpu.jit import kernel
from ggrun.core.backends.cpu.quant.codes import ACT_Q8_1, ACT_Q8_K, _rint, _to_f16
from ggrun.core.backends.cpu.quant.vec import (
    f16_round, vabsmax4, vadd32, vf32x8, vhsum32, vmulf, vround32, vsetf, vstore_i8x32,
)


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
