"""The portable products (any CPU, no intrinsics): ggml's integer dot products of each weight type against
8-bit activation blocks one row at a time (the scalar reference every vector kernel is tested
against), f32 dot products for F16/BF16/F32 weights, the "ri64" kernels for the legacy types (see
layouts.py) and the GLU of a gated feed-forward's two products.

Kernels never allocate: callers hand them views of planned memory (a node's result and scratch).
"""
from __future__ import annotations

import numpy as np
from numba import prange

from ggrun.core.backends.cpu.jit import kernel
from ggrun.core.backends.cpu.quant.activations import quantize_rows
from ggrun.core.backends.cpu.quant.codes import (
    Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, _f16, _k4_scale_min, _q3_scale, _s8,
)
from ggrun.core.backends.cpu.quant.decode import dequantize_row
from ggrun.core.backends.cpu.quant.layouts import RI
from ggrun.core.backends.cpu.quant.routing import chunk_step, group_rows, n_tasks, scatter_rows, task
from ggrun.core.backends.cpu.vecmath import glu_span


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


# The GLU of a gated feed-forward's two products, where they were not fused (mul_mat_glu)
@kernel
def glu_rows(kind, table, out, up):
    """out = glu(out, up) for [N, M] arrays (kind: GLU_SWIGLU, GLU_GEGLU or GLU_GEGLU_TABLE)."""
    glu_span(kind, table, out, up, 0, out.shape[1])


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
def _rows_f32_portable(code, w, x, buf, out, m0, m1):
    for m in range(m0, m1):
        dequantize_row(code, w[m], buf)
        for n in range(x.shape[0]):
            out[n, m] = _dotf_portable(buf, x[n])


@kernel
def mul_mat_f32_portable(code, w, x, buf, out):
    """Rows of w decoded one at a time into buf[0] (f32 [K]) and dotted with f32 rows x."""
    _rows_f32_portable(code, w, x, buf[0], out, 0, w.shape[0])


@kernel(parallel=True)
def mul_mat_f32_portable_par(code, w, x, buf, out, n_chunks):
    step = (w.shape[0] + n_chunks - 1) // n_chunks
    for c in prange(n_chunks):
        _rows_f32_portable(code, w, x, buf[c], out, c * step, min(w.shape[0], (c + 1) * step))


@kernel(parallel=True)
def mul_mat_id_q8_portable(code, w, ids, per_slot, route, xq, gq, og, out, n_chunks):
    """mul_mat_id against stored rows w [experts, M, row bytes] (routing.py): the pairs' quantized rows xq grouped
    by expert into gq, each chosen expert's rows split over n_chunks, the results og put back into out [pairs, M]."""
    group_rows(ids, per_slot, route, xq, gq)
    step = chunk_step(w.shape[1], n_chunks, 4)
    for i in prange(n_tasks(route, n_chunks)):
        e, a, b, m0, m1 = task(route, w.shape[1], n_chunks, step, i)
        _rows_q8_portable(code, w[e], gq[0][a:b], gq[1][a:b], gq[2][a:b], gq[3][a:b], og[a:b], m0, m1)
    scatter_rows(og, route, out)
