"""AVX2 products of weights repacked "r8" (layouts.py; decode steps, prompts, mul_mat_multi, mul_mat_glu):
per group of 8 rows one maddubs multiplies 4 quants of each row by 4 broadcast activation bytes, so
the accumulator's lanes are the 8 rows' results and the scales apply 8 rows at a time. One-token and
four-token (TOKENS) passes, the drivers that run one to MAX_PARTS weights on one quantized input, and
a gated feed-forward's two products with their GLU.
"""
from __future__ import annotations

from numba import prange

from ggrun.core.backends.cpu.jit import kernel
from ggrun.core.backends.cpu.quant.activations import quantize_rows_avx2
from ggrun.core.backends.cpu.quant.codes import Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0
from ggrun.core.backends.cpu.quant.layouts import PF_GROUPS, R8, TOKENS, _r8_block
from ggrun.core.backends.cpu.quant.routing import chunk_step, group_rows, n_tasks, scatter_rows, task
from ggrun.core.backends.cpu.quant.vec import (
    prefetch, vabs8, vadd16, vadd32, vaddf, vand, vbcast32, vcvt, vf16x8, vfma, vlane, vload, vmadd, vmaddubs,
    vmulf, vor, vs8lo, vs8pair, vset16x2, vset32, vset8, vsetf, vsign8, vsll16, vsll32, vsrl16, vstoref, vsub32,
    vsubf, vu8lo, vu8pair, vzero,
)
from ggrun.core.backends.cpu.vecmath import glu_span


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
# depend on the batch it came in (the integer block sums are exact in any order). TOKENS: layouts.py.
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
# The call always takes MAX_PARTS (layouts.py) weights (one compiled signature for one, two or three): slots
# past n_parts repeat a real weight and are never read.
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


@kernel(parallel=True)
def mul_mat_id_r8(code, p, groups, ids, per_slot, route, xq, gq, og, out, n_chunks):
    """mul_mat_id against experts repacked as one r8 weight p, `groups` groups an expert (routing.py): the pairs'
    quantized rows xq grouped by expert into gq, each chosen expert's groups split over n_chunks, the results og
    put back into out [pairs, M]."""
    group_rows(ids, per_slot, route, xq, gq)
    step = chunk_step(groups, n_chunks, 1)
    for i in prange(n_tasks(route, n_chunks)):
        e, a, b, g0, g1 = task(route, groups, n_chunks, step, i)
        _rows_r8_any_avx2(code, p[e * groups:(e + 1) * groups], gq[0], gq[1], gq[2], gq[3], og, g0, g1, a, b)
    scatter_rows(og, route, out)
