"""Stored rows of every type decoded to f32 (get_rows, and the weight tiles of the BLAS path): the same
values, bit for bit, as core.quants' numpy decoders, portable and 8 at a time on AVX2. The lookup-table
types (IQ4_NL, IQ4_XS, MXFP4) are decoded by lut4.py's row decoder, in both.

Listed in jit.SHARED_SOURCES: the f32 products (portable.py, avx2.py) compile the row decoders in.
"""
from __future__ import annotations

import numpy as np
from numba import prange

from ggrun.core.backends.cpu import lut4
from ggrun.core.backends.cpu.jit import kernel
from ggrun.core.backends.cpu.quant.codes import (
    BF16, F16, Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, _bf16, _f16, _k4_scale_min, _k4_sm,
    _q3_scale, _s8,
)
from ggrun.core.backends.cpu.quant.vec import (
    sf16, vand, vbf16x8, vbits, vf16x8, vload, vmulf, vnib, vor, vs8f0, vs8f1, vs8f2, vs8f3, vset8, vsetf,
    vsll16, vsrl16, vstoref, vsubf, vu8f0, vu8f1, vu8f2, vu8f3,
)


@kernel
def block_mins(code, w, m0, m1, out):
    """out[r, b] = the f16 min of block b of row m0 + r (Q4_1, Q5_1)."""
    ts = 20 if code == Q4_1 else 24
    for m in range(m0, m1):
        for b in range(out.shape[1]):
            out[m - m0, b] = _f16(w[m], ts * b + 2)


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
    else:
        lut4.dequantize_row(code, w, out)


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
