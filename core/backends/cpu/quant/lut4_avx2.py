"""AVX2 products of the lookup-table 4-bit types IQ4_NL, IQ4_XS and MXFP4 (lut4.py's integer dot products,
vectorized) against their 8-bit activation blocks (Q8_0; IQ4_XS Q8_K), four weight rows per pass as
avx2.py's legacy kernels read theirs.

A block's 16 bytes of index pairs widen to 32 indices (vnib), one vpshufb of the type's 16-value table
turns them into signed weight bytes (vlut16), and those multiply the activation quants as ggml's
mul_sum_i8_pairs does (|w| times x carrying w's sign, maddubs then madd): eight exact int32 lanes per
block, scaled once per block (IQ4_XS: the sub-blocks' six-bit scales applied in integers by the madd, the
whole super-block summed exactly, then scaled once), as lut4.dot and ggml's vec_dot compute them; only
the order in which the eight lanes add differs. Compiled only where SIMD is "avx2" or above (matmul.py
calls these there).
"""
from __future__ import annotations

import numpy as np
from numba import prange

from ggrun.core.backends.cpu.jit import kernel
from ggrun.core.backends.cpu.quant.codes import IQ4_NL, IQ4_XS
from ggrun.core.backends.cpu.quant.routing import chunk_step, group_rows, n_tasks, scatter_rows, task
from ggrun.core.backends.cpu.quant.vec import (
    blk_fma, four_rows, prefetch4, sf16, store4, su8, su16, vabs8, vadd32, vcvt, vfma, vhsum, vload, vlut16, vmadd,
    vmaddubs, vnib, vset16x2, vsetf, vsign8, vtable16, vzero,
)
from ggrun.core.quants import IQ4_VALUES, MXFP4_VALUES, e8m0_half

_E8M0_HALF = e8m0_half(np.arange(256, dtype=np.uint8))  # every exponent byte as the f32 scale it stands for
_IQ4_TABLE = vtable16(IQ4_VALUES)
_MX_TABLE = vtable16(MXFP4_VALUES)


@kernel(inline="always")
def _pairs(w, at, table, x):
    """16-bit lanes, each the sum of two products of the block's weights (index pairs at w[at]) with x."""
    q = vlut16(table, vnib(w, at))
    return vmaddubs(vabs8(q), vsign8(x, q))


@kernel(inline="always")
def _lanes(w, at, table, x):
    """8 int32 lanes of the block's weights times x, summing to the block's integer product."""
    return vmadd(_pairs(w, at, table, x), vset16x2(1, 1))


@kernel(inline="always")
def _mx_blk(w, at, da, p, acc):
    """acc + the E8M0 scale at w[at] (as half of 2^(e - 127)) * da * the block's integer lanes p."""
    return vfma(vsetf(_E8M0_HALF[su8(w, at)] * da), vcvt(p), acc)


@kernel(_nrt=False)
def _rows_iq4_nl(w, qs, d, out, m0, m1):
    k = qs.shape[1]
    t = _IQ4_TABLE()
    for m in range(m0, m1, 4):
        r0, r1, r2, r3 = four_rows(w, m, m1)
        for n in range(qs.shape[0]):
            a0 = a1 = a2 = a3 = vzero()
            for b in range(k // 32):
                x = vload(qs, n * k + 32 * b)
                da = d[n, b]
                o = 18 * b
                prefetch4(w, r0, r1, r2, r3, o)
                a0 = blk_fma(w, r0 + o, da, _lanes(w, r0 + o + 2, t, x), a0)
                a1 = blk_fma(w, r1 + o, da, _lanes(w, r1 + o + 2, t, x), a1)
                a2 = blk_fma(w, r2 + o, da, _lanes(w, r2 + o + 2, t, x), a2)
                a3 = blk_fma(w, r3 + o, da, _lanes(w, r3 + o + 2, t, x), a3)
            store4(out, n, m, m1, vhsum(a0), vhsum(a1), vhsum(a2), vhsum(a3))


@kernel(_nrt=False)
def _rows_mxfp4(w, qs, d, out, m0, m1):
    k = qs.shape[1]
    t = _MX_TABLE()
    for m in range(m0, m1, 4):
        r0, r1, r2, r3 = four_rows(w, m, m1)
        for n in range(qs.shape[0]):
            a0 = a1 = a2 = a3 = vzero()
            for b in range(k // 32):
                x = vload(qs, n * k + 32 * b)
                da = d[n, b]
                o = 17 * b
                prefetch4(w, r0, r1, r2, r3, o)
                a0 = _mx_blk(w, r0 + o, da, _lanes(w, r0 + o + 1, t, x), a0)
                a1 = _mx_blk(w, r1 + o, da, _lanes(w, r1 + o + 1, t, x), a1)
                a2 = _mx_blk(w, r2 + o, da, _lanes(w, r2 + o + 1, t, x), a2)
                a3 = _mx_blk(w, r3 + o, da, _lanes(w, r3 + o + 1, t, x), a3)
            store4(out, n, m, m1, vhsum(a0), vhsum(a1), vhsum(a2), vhsum(a3))


@kernel(inline="always")
def _xs_super(w, at, t, qs, q_at):
    """IQ4_XS: the super-block at w[at] times the 256 activation quants at qs[q_at], as 8 exact int32 lanes
    (each sub-block's pair sums times its six-bit scale minus 32, by madd)."""
    high = np.int64(su16(w, at + 2))
    isum = vzero()
    for ib in range(8):
        low = (np.int64(su8(w, at + 4 + ib // 2)) >> (4 * (ib % 2))) & 15
        ls = (low | (((high >> (2 * ib)) & 3) << 4)) - 32
        isum = vadd32(isum, vmadd(_pairs(w, at + 8 + 16 * ib, t, vload(qs, q_at + 32 * ib)), vset16x2(ls, ls)))
    return isum


@kernel(inline="always")
def _xsblk_fma(w, at, ds, t, qs, q_at, acc):
    return vfma(vsetf(sf16(w, at) * ds), vcvt(_xs_super(w, at, t, qs, q_at)), acc)


@kernel(_nrt=False)
def _rows_iq4_xs(w, qs, d, out, m0, m1):
    k = qs.shape[1]
    t = _IQ4_TABLE()
    for m in range(m0, m1, 4):
        r0, r1, r2, r3 = four_rows(w, m, m1)
        for n in range(qs.shape[0]):
            a0 = a1 = a2 = a3 = vzero()
            for sb in range(k // 256):
                ds = d[n, sb]
                q_at = n * k + 256 * sb
                o = 136 * sb
                prefetch4(w, r0, r1, r2, r3, o)
                prefetch4(w, r0, r1, r2, r3, o + 64)
                a0 = _xsblk_fma(w, r0 + o, ds, t, qs, q_at, a0)
                a1 = _xsblk_fma(w, r1 + o, ds, t, qs, q_at, a1)
                a2 = _xsblk_fma(w, r2 + o, ds, t, qs, q_at, a2)
                a3 = _xsblk_fma(w, r3 + o, ds, t, qs, q_at, a3)
            store4(out, n, m, m1, vhsum(a0), vhsum(a1), vhsum(a2), vhsum(a3))


@kernel(_nrt=False)
def _rows(code, w, qs, d, out, m0, m1):
    if code == IQ4_NL:
        _rows_iq4_nl(w, qs, d, out, m0, m1)
    elif code == IQ4_XS:
        _rows_iq4_xs(w, qs, d, out, m0, m1)
    else:
        _rows_mxfp4(w, qs, d, out, m0, m1)


@kernel
def mul_mat_q8(code, w, qs, d, out):
    """out [N, M] = the integer dot of every row of w (stored rows [M, row bytes]) with every quantized
    activation row (qs int8 [N, K], d f32 block scales), as lut4.mul_mat_q8 computes it."""
    _rows(code, w, qs, d, out, 0, w.shape[0])


@kernel(parallel=True)
def mul_mat_q8_par(code, w, qs, d, out, n_chunks):
    step = (w.shape[0] + n_chunks - 1) // n_chunks
    step = (step + 3) // 4 * 4  # whole passes of four rows per chunk
    for c in prange(n_chunks):
        _rows(code, w, qs, d, out, c * step, min(w.shape[0], (c + 1) * step))


@kernel(parallel=True)
def mul_mat_id_q8(code, w, ids, per_slot, route, xq, gq, og, out, n_chunks):
    """mul_mat_id against stored rows w [experts, M, row bytes] (routing.py): the pairs' quantized rows xq grouped
    by expert into gq, each chosen expert's rows split over n_chunks, the results og put back into out [pairs, M]."""
    group_rows(ids, per_slot, route, xq, gq)
    step = chunk_step(w.shape[1], n_chunks, 4)
    for i in prange(n_tasks(route, n_chunks)):
        e, a, b, m0, m1 = task(route, w.shape[1], n_chunks, step, i)
        _rows(code, w[e], gq[0][a:b], gq[1][a:b], og[a:b], m0, m1)
    scatter_rows(og, route, out)
