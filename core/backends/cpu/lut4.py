"""Compiled CPU kernels for the lookup-table 4-bit weight types IQ4_NL, IQ4_XS and MXFP4: rows decoded to
f32, and ggml's integer dot products of their rows with activation rows quantized to 8-bit blocks (IQ4_NL
and MXFP4 against Q8_0, IQ4_XS against Q8_K, as ggml's vec_dot_type says).

Each 4-bit index stands for one of 16 fixed values (ggml's kvalues_iq4nl or kvalues_mxfp4, quants.py's
IQ4_VALUES and MXFP4_VALUES); a block of 32 shares one scale: IQ4_NL an f16, MXFP4 an E8M0 exponent read as
half of 2^(e - 127) (the table's values are doubled), IQ4_XS an f16 per 256 times a six-bit scale per 32.
As in ggml (ggml-cpu/quants.c), the products of one block are summed exactly in integers and scaled once
(weight scale times activation scale, f32). The activation rows come from quant/activations.py's quantizers; the
binders (matmul.py) call those first. Kernels never allocate: they write into the views they are given.
"""
from __future__ import annotations

import numpy as np
from numba import prange

from ggrun.core.backends.cpu.jit import kernel
from ggrun.core.backends.cpu.quant.codes import IQ4_NL, IQ4_XS, MXFP4, _f16
from ggrun.core.backends.cpu.quant.routing import chunk_step, group_rows, n_tasks, scatter_rows, task
from ggrun.core.dtypes import DType
from ggrun.core.quants import IQ4_VALUES, MXFP4_VALUES, e8m0_half

# The types whose kernels are here, and their codes (quant/codes.py's).
TYPES: dict[DType, int] = {DType.IQ4_NL: IQ4_NL, DType.IQ4_XS: IQ4_XS, DType.MXFP4: MXFP4}

_IQ4 = IQ4_VALUES.astype(np.int32)
_MX = MXFP4_VALUES.astype(np.int32)
_E8M0_HALF = e8m0_half(np.arange(256, dtype=np.uint8))  # every exponent byte as the f32 scale it stands for


@kernel(inline="always")
def _block_sum(w, at, table, qs, q_at):
    """The integer sum of 32 weights (16 bytes of index pairs at w[at]: low nibbles are elements 0..15,
    high nibbles 16..31) times the 32 activation quants at qs[q_at]."""
    total = 0
    for j in range(16):
        byte = w[at + j]
        total += table[byte & 15] * np.int32(qs[q_at + j]) + table[byte >> 4] * np.int32(qs[q_at + 16 + j])
    return total


@kernel(inline="always")
def _xs_scale(w, at, ib):
    """IQ4_XS: the six-bit scale of sub-block ib of the super-block at w[at], minus 32."""
    low = (w[at + 4 + ib // 2] >> (4 * (ib % 2))) & 15
    high = ((np.int64(w[at + 2]) | (np.int64(w[at + 3]) << 8)) >> (2 * ib)) & 3
    return np.int64(low | (high << 4)) - 32


@kernel(inline="always")
def dot(code, w, qs, d):
    """One weight row (its bytes w) with one activation row: its quants qs (int8 [K]) and block scales
    d (f32: one per 32 for Q8_0, per 256 for Q8_K), as ggml's vec_dot sums it."""
    k = qs.shape[0]
    acc = np.float32(0.0)
    if code == IQ4_XS:
        for sb in range(k // 256):
            at = sb * 136
            isum = 0  # the sub-blocks' scales are integers: the whole super-block sums exactly (ggml's AVX2)
            for ib in range(8):
                isum += _xs_scale(w, at, ib) * _block_sum(w, at + 8 + 16 * ib, _IQ4, qs, 256 * sb + 32 * ib)
            acc += (_f16(w, at) * d[sb]) * np.float32(isum)
    elif code == IQ4_NL:
        for b in range(k // 32):
            at = b * 18
            acc += (_f16(w, at) * d[b]) * np.float32(_block_sum(w, at + 2, _IQ4, qs, 32 * b))
    else:
        for b in range(k // 32):
            at = b * 17
            acc += (_E8M0_HALF[w[at]] * d[b]) * np.float32(_block_sum(w, at + 1, _MX, qs, 32 * b))
    return acc


@kernel(inline="always")
def _decode_block(w, at, table, scale, out, o):
    for j in range(16):
        byte = w[at + j]
        out[o + j] = scale * np.float32(table[byte & 15])
        out[o + 16 + j] = scale * np.float32(table[byte >> 4])


@kernel
def dequantize_row(code, w, out):
    """One row of blocks (bytes w) as f32 values into out [K], as ggml's dequantize_row_* computes them
    (quant/decode.py's row decoders, and so its get_rows and weight tiles, call it for these types)."""
    k = out.shape[0]
    if code == IQ4_XS:
        for sb in range(k // 256):
            at = sb * 136
            d = _f16(w, at)
            for ib in range(8):
                _decode_block(w, at + 8 + 16 * ib, _IQ4, d * np.float32(_xs_scale(w, at, ib)), out, 256 * sb + 32 * ib)
    elif code == IQ4_NL:
        for b in range(k // 32):
            _decode_block(w, 18 * b + 2, _IQ4, _f16(w, 18 * b), out, 32 * b)
    else:
        for b in range(k // 32):
            _decode_block(w, 17 * b + 1, _MX, _E8M0_HALF[w[17 * b]], out, 32 * b)


@kernel
def _rows_q8(code, w, qs, d, out, m0, m1):
    for m in range(m0, m1):
        row = w[m]
        for n in range(qs.shape[0]):
            out[n, m] = dot(code, row, qs[n], d[n])


@kernel
def mul_mat_q8(code, w, qs, d, out):
    """out [N, M] = ggml's integer dot of every row of w with every quantized activation row (qs, d)."""
    _rows_q8(code, w, qs, d, out, 0, w.shape[0])


@kernel(parallel=True)
def mul_mat_q8_par(code, w, qs, d, out, n_chunks):
    step = (w.shape[0] + n_chunks - 1) // n_chunks
    for c in prange(n_chunks):
        _rows_q8(code, w, qs, d, out, c * step, min(w.shape[0], (c + 1) * step))


@kernel
def _rows_f32(code, w, x, buf, out, m0, m1):
    for m in range(m0, m1):
        dequantize_row(code, w[m], buf)
        for n in range(x.shape[0]):
            acc = np.float32(0.0)
            for j in range(buf.shape[0]):
                acc += buf[j] * x[n, j]
            out[n, m] = acc


@kernel
def mul_mat_f32(code, w, x, buf, out):
    """Rows of w decoded one at a time into buf[0] (f32 [K]) and dotted with the f32 rows x."""
    _rows_f32(code, w, x, buf[0], out, 0, w.shape[0])


@kernel(parallel=True)
def mul_mat_f32_par(code, w, x, buf, out, n_chunks):
    step = (w.shape[0] + n_chunks - 1) // n_chunks
    for c in prange(n_chunks):
        _rows_f32(code, w, x, buf[c], out, c * step, min(w.shape[0], (c + 1) * step))


@kernel(parallel=True)
def mul_mat_id_q8(code, w, ids, per_slot, route, xq, gq, og, out, n_chunks):
    """mul_mat_id against stored rows w [experts, M, row bytes] (routing.py): the pairs' quantized rows xq grouped
    by expert into gq, each chosen expert's rows split over n_chunks, the results og put back into out [pairs, M]."""
    group_rows(ids, per_slot, route, xq, gq)
    step = chunk_step(w.shape[1], n_chunks, 4)
    for i in prange(n_tasks(route, n_chunks)):
        e, a, b, m0, m1 = task(route, w.shape[1], n_chunks, step, i)
        _rows_q8(code, w[e], gq[0][a:b], gq[1][a:b], og[a:b], m0, m1)
    scatter_rows(og, route, out)
