"""AVX2 products against weights in ggml's own block layout (`vec`, vec.py): the integer dot products of
each weight type against 8-bit activation blocks, four rows at a time (prompts of types that have no
repacked layout, and the tests' reference for the repacked kernels), and the f32 products of F16/BF16/F32
weights (and of quantized ones decoded to f32 rows).

The arithmetic follows ggml's CPU backend on x86 (ggml-cpu/arch/x86/quants.c): exact integer block sums
scaled once per block.
"""
from __future__ import annotations

import numpy as np
from numba import prange

from ggrun.core.backends.cpu.jit import kernel
from ggrun.core.backends.cpu.quant.activations import quantize_rows_avx2
from ggrun.core.backends.cpu.quant.codes import (
    BF16, F16, F32, Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, _bf16, _f16, _k4_sm, _q3_sc, _s8,
)
from ggrun.core.backends.cpu.quant.decode import dequantize_row_avx2
from ggrun.core.backends.cpu.quant.routing import chunk_step, group_rows, n_tasks, scatter_rows, task
from ggrun.core.backends.cpu.quant.vec import (
    blk_fma, four_rows, prefetch4, sf16, store4, vabs8, vadd32, vaddf, vand, vbf16x8, vbits, vcvt, vdot, vf16x8,
    vf32x8, vfma, vhsum, vlane0, vload, vmadd, vmaddubs, vnib, vor, vset16x2, vset32, vset8, vsetf, vsign8, vsll16,
    vsrl16, vsub32, vzero,
)


# Row kernels: rows m0..m1 of w against every quantized activation row, out[n, m]. The legacy
# types run four weight rows per pass (one activation load and four independent accumulator
# chains per block); the last pass repeats the last row where fewer than four remain.
# Compiled without NRT: they allocate nothing, and array views then cost no reference counting.

@kernel(_nrt=False)
def _rows_q4_0_avx2(w, qs, d, s, sums, out, m0, m1):
    k = qs.shape[1]
    for m in range(m0, m1, 4):
        r0, r1, r2, r3 = four_rows(w, m, m1)
        for n in range(qs.shape[0]):
            a0 = a1 = a2 = a3 = vzero()
            for b in range(k // 32):
                x = vload(qs, n * k + 32 * b)
                off = vset32(sums[n, 2 * b] + sums[n, 2 * b + 1])  # q - 8: 8 * sum(x) over 8 lanes
                da = d[n, b]
                o = 18 * b
                prefetch4(w, r0, r1, r2, r3, o)
                a0 = blk_fma(w, r0 + o, da, vsub32(vdot(vnib(w, r0 + o + 2), x), off), a0)
                a1 = blk_fma(w, r1 + o, da, vsub32(vdot(vnib(w, r1 + o + 2), x), off), a1)
                a2 = blk_fma(w, r2 + o, da, vsub32(vdot(vnib(w, r2 + o + 2), x), off), a2)
                a3 = blk_fma(w, r3 + o, da, vsub32(vdot(vnib(w, r3 + o + 2), x), off), a3)
            store4(out, n, m, m1, vhsum(a0), vhsum(a1), vhsum(a2), vhsum(a3))


@kernel(_nrt=False)
def _rows_q4_1_avx2(w, qs, d, s, sums, out, m0, m1):
    k = qs.shape[1]
    for m in range(m0, m1, 4):
        r0, r1, r2, r3 = four_rows(w, m, m1)
        for n in range(qs.shape[0]):
            a0 = a1 = a2 = a3 = vzero()
            e0 = e1 = e2 = e3 = np.float32(0.0)  # sum of m * s (ggml's summs)
            for b in range(k // 32):
                x = vload(qs, n * k + 32 * b)
                da = d[n, b]
                sb = s[n, b]
                o = 20 * b
                prefetch4(w, r0, r1, r2, r3, o)
                a0 = blk_fma(w, r0 + o, da, vdot(vnib(w, r0 + o + 4), x), a0)
                a1 = blk_fma(w, r1 + o, da, vdot(vnib(w, r1 + o + 4), x), a1)
                a2 = blk_fma(w, r2 + o, da, vdot(vnib(w, r2 + o + 4), x), a2)
                a3 = blk_fma(w, r3 + o, da, vdot(vnib(w, r3 + o + 4), x), a3)
                e0 += sf16(w, r0 + o + 2) * sb
                e1 += sf16(w, r1 + o + 2) * sb
                e2 += sf16(w, r2 + o + 2) * sb
                e3 += sf16(w, r3 + o + 2) * sb
            store4(out, n, m, m1, vhsum(a0) + e0, vhsum(a1) + e1, vhsum(a2) + e2, vhsum(a3) + e3)


@kernel(inline="always")
def _q5(w, at, hm):
    """Q5 quants at w[at..]: the 4 bytes of fifth bits, then 16 nibble-pair bytes: values 0..31."""
    return vor(vnib(w, at + 4), vand(vbits(w, at), hm))


@kernel(_nrt=False)
def _rows_q5_0_avx2(w, qs, d, s, sums, out, m0, m1):
    k = qs.shape[1]
    hm = vset8(16)
    for m in range(m0, m1, 4):
        r0, r1, r2, r3 = four_rows(w, m, m1)
        for n in range(qs.shape[0]):
            a0 = a1 = a2 = a3 = vzero()
            for b in range(k // 32):
                x = vload(qs, n * k + 32 * b)
                off = vset32(2 * (sums[n, 2 * b] + sums[n, 2 * b + 1]))  # q - 16
                da = d[n, b]
                o = 22 * b
                prefetch4(w, r0, r1, r2, r3, o)
                a0 = blk_fma(w, r0 + o, da, vsub32(vdot(_q5(w, r0 + o + 2, hm), x), off), a0)
                a1 = blk_fma(w, r1 + o, da, vsub32(vdot(_q5(w, r1 + o + 2, hm), x), off), a1)
                a2 = blk_fma(w, r2 + o, da, vsub32(vdot(_q5(w, r2 + o + 2, hm), x), off), a2)
                a3 = blk_fma(w, r3 + o, da, vsub32(vdot(_q5(w, r3 + o + 2, hm), x), off), a3)
            store4(out, n, m, m1, vhsum(a0), vhsum(a1), vhsum(a2), vhsum(a3))


@kernel(_nrt=False)
def _rows_q5_1_avx2(w, qs, d, s, sums, out, m0, m1):
    k = qs.shape[1]
    hm = vset8(16)
    for m in range(m0, m1, 4):
        r0, r1, r2, r3 = four_rows(w, m, m1)
        for n in range(qs.shape[0]):
            a0 = a1 = a2 = a3 = vzero()
            e0 = e1 = e2 = e3 = np.float32(0.0)
            for b in range(k // 32):
                x = vload(qs, n * k + 32 * b)
                da = d[n, b]
                sb = s[n, b]
                o = 24 * b
                prefetch4(w, r0, r1, r2, r3, o)
                a0 = blk_fma(w, r0 + o, da, vdot(_q5(w, r0 + o + 4, hm), x), a0)
                a1 = blk_fma(w, r1 + o, da, vdot(_q5(w, r1 + o + 4, hm), x), a1)
                a2 = blk_fma(w, r2 + o, da, vdot(_q5(w, r2 + o + 4, hm), x), a2)
                a3 = blk_fma(w, r3 + o, da, vdot(_q5(w, r3 + o + 4, hm), x), a3)
                e0 += sf16(w, r0 + o + 2) * sb
                e1 += sf16(w, r1 + o + 2) * sb
                e2 += sf16(w, r2 + o + 2) * sb
                e3 += sf16(w, r3 + o + 2) * sb
            store4(out, n, m, m1, vhsum(a0) + e0, vhsum(a1) + e1, vhsum(a2) + e2, vhsum(a3) + e3)


@kernel(inline="always")
def _q8_lanes(w, at, x):
    """Signed weight bytes at w[at..] times signed x: |w| times x carrying w's sign."""
    q = vload(w, at)
    return vdot(vabs8(q), vsign8(x, q))


@kernel(_nrt=False)
def _rows_q8_0_avx2(w, qs, d, s, sums, out, m0, m1):
    k = qs.shape[1]
    for m in range(m0, m1, 4):
        r0, r1, r2, r3 = four_rows(w, m, m1)
        for n in range(qs.shape[0]):
            a0 = a1 = a2 = a3 = vzero()
            for b in range(k // 32):
                x = vload(qs, n * k + 32 * b)
                da = d[n, b]
                o = 34 * b
                prefetch4(w, r0, r1, r2, r3, o)
                a0 = blk_fma(w, r0 + o, da, _q8_lanes(w, r0 + o + 2, x), a0)
                a1 = blk_fma(w, r1 + o, da, _q8_lanes(w, r1 + o + 2, x), a1)
                a2 = blk_fma(w, r2 + o, da, _q8_lanes(w, r2 + o + 2, x), a2)
                a3 = blk_fma(w, r3 + o, da, _q8_lanes(w, r3 + o + 2, x), a3)
            store4(out, n, m, m1, vhsum(a0), vhsum(a1), vhsum(a2), vhsum(a3))


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
def mul_mat_f32_avx2(code, w, x, buf, out):
    _rows_f32_avx2(code, w, x, buf[0], out, 0, w.shape[0])


@kernel(parallel=True)
def mul_mat_f32_avx2_par(code, w, x, buf, out, n_chunks):
    step = (w.shape[0] + n_chunks - 1) // n_chunks
    for c in prange(n_chunks):
        _rows_f32_avx2(code, w, x, buf[c], out, c * step, min(w.shape[0], (c + 1) * step))


@kernel(parallel=True)
def mul_mat_id_q8_avx2(code, w, ids, per_slot, route, xq, gq, og, out, n_chunks):
    """mul_mat_id against stored rows w [experts, M, row bytes] (routing.py): the pairs' quantized rows xq grouped
    by expert into gq, each chosen expert's rows split over n_chunks, the results og put back into out [pairs, M]."""
    group_rows(ids, per_slot, route, xq, gq)
    step = chunk_step(w.shape[1], n_chunks, 4)
    for i in prange(n_tasks(route, n_chunks)):
        e, a, b, m0, m1 = task(route, w.shape[1], n_chunks, step, i)
        _rows_q8_avx2(code, w[e], gq[0][a:b], gq[1][a:b], gq[2][a:b], gq[3][a:b], og[a:b], m0, m1)
    scatter_rows(og, route, out)
