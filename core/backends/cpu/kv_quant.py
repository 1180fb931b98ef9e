"""Scalar helpers the compiled kernels inline to write and read a block-quantized KV cache
(Q8_0, Q4_0) as ggml's CPU does: rows quantized as its from_float (quantize_row_q8_0 on x86,
quantize_row_q4_0_ref), the Walsh-Hadamard rotation llama.cpp gives such a cache's rows (its
attn_rot; ggml_compute_forward_fwht), cached rows decoded to f32, and the integer dot product of
a cached key with a query quantized to Q8_0 (ggml_vec_dot_q8_0_q8_0 / q4_0_q8_0 on AVX2).

Cache rows reach the kernels as bytes of any stored type, told apart by a type code (quant.CODES):
one compiled signature serves f16, f32, Q8_0 and Q4_0 caches. The kernels using these helpers
live in rope.py, elementwise.py and attention.py; this file is listed in jit.SHARED_SOURCES, so
editing it recompiles them. The numpy reference is core.quants (encoders) and kernels.py.
"""
from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from ggrun.core.backends.cpu.jit import kernel
from ggrun.core.backends.cpu.quant.codes import CODES, F16, F32, Q4_0, Q8_0
from ggrun.core.backends.cpu.vecmath import f16_to_f32, f32_to_f16, fma
from ggrun.core.dtypes import DType

BLOCK = 32  # elements per Q8_0 / Q4_0 block
BLOCK_BYTES = {Q8_0: 34, Q4_0: 18}
CACHE_TYPES = (DType.F32, DType.F16, DType.Q8_0, DType.Q4_0)


def code_of(dtype: DType) -> int:
    """The type code a cache of `dtype` is read and written with."""
    return CODES[dtype]


@intrinsic
def _f32_of_bits(typingctx, bits):
    """The float32 whose IEEE bits are the low 32 bits of an integer."""
    if not isinstance(bits, types.Integer) or bits.bitwidth < 32:
        return None

    def codegen(context, builder, signature, args):
        v = args[0] if bits.bitwidth == 32 else builder.trunc(args[0], ir.IntType(32))
        return builder.bitcast(v, ir.FloatType())
    return types.float32(bits), codegen


@intrinsic
def _bits_of_f32(typingctx, x):
    """The IEEE bits of a float32, as a uint32."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(x), codegen


@kernel(inline="always")
def f16_at(b, at):
    """The f16 stored little-endian at bytes b[at], b[at + 1], as f32."""
    return f16_to_f32(np.uint16(np.int64(b[at]) | (np.int64(b[at + 1]) << 8)))


@kernel(inline="always")
def _f32_at(b, at):
    bits = np.int64(b[at]) | (np.int64(b[at + 1]) << 8) | (np.int64(b[at + 2]) << 16) | (np.int64(b[at + 3]) << 24)
    return _f32_of_bits(bits)


@kernel(inline="always")
def _put_f16(b, at, x):
    h = np.int64(f32_to_f16(x))
    b[at] = np.uint8(h & 255)
    b[at + 1] = np.uint8(h >> 8)


@kernel(inline="always")
def _put_f32(b, at, x):
    bits = np.int64(_bits_of_f32(np.float32(x)))
    for i in range(4):
        b[at + i] = np.uint8((bits >> (8 * i)) & 255)


@kernel(inline="always")
def _rint(x):
    """Round to nearest, ties to even (as _mm256_round_ps); exact for |x| < 2^22."""
    return np.float32(np.rint(np.float64(x)))


# Block bytes become values in f32 arithmetic (exact for bytes): numba would widen integer
# arithmetic on them to int64, which AVX2 cannot convert to floats a vector at a time. Row slices
# are indexed from 0, so LLVM sees non-negative indices and vectorizes the loops.

@kernel(inline="always")
def _s8(byte):
    """A stored byte as the signed value it holds (Q8_0), as f32."""
    return np.float32(np.int8(byte))


@kernel(inline="always")
def _nibbles(byte):
    """A stored byte's low and high nibbles (Q4_0), as f32."""
    f = np.float32(byte)
    hi = np.floor(f * np.float32(0.0625))
    return f - np.float32(16.0) * hi, hi


@kernel(inline="always")
def hadamard(x, n):
    """x turned in place, in chunks of n (a power of two), by the orthonormal Walsh-Hadamard
    transform: scaled by 1/sqrt(n) first, then butterflies of width 1, 2, 4, ... (ggml's fwht)."""
    scale = np.float32(1.0) / np.float32(math.sqrt(np.float32(n)))
    for j in range(x.shape[0]):
        x[j] = x[j] * scale
    for c in range(0, x.shape[0], n):
        width = 1
        while width < n:
            for i in range(c, c + n, 2 * width):
                for j in range(i, i + width):
                    u = x[j]
                    v = x[j + width]
                    x[j] = u + v
                    x[j + width] = u - v
            width *= 2


@kernel(inline="always")
def store_row(code, x, b):
    """f32 row x into the stored row b (bytes) of a cache of type `code`, as ggml's CPU stores it."""
    n = x.shape[0]
    if code == F32:
        for j in range(n):
            _put_f32(b, 4 * j, x[j])
    elif code == F16:
        for j in range(n):
            _put_f16(b, 2 * j, x[j])
    elif code == Q8_0:
        for blk in range(n // BLOCK):
            o = BLOCK * blk
            at = 34 * blk
            amax = np.float32(0.0)
            for j in range(BLOCK):
                amax = max(amax, abs(x[o + j]))
            inv = np.float32(127.0) / amax if amax != 0 else np.float32(0.0)
            _put_f16(b, at, amax / np.float32(127.0))
            for j in range(BLOCK):
                b[at + 2 + j] = np.uint8(np.int32(_rint(x[o + j] * inv)) & 255)
    else:  # Q4_0
        for blk in range(n // BLOCK):
            o = BLOCK * blk
            at = 18 * blk
            amax = np.float32(0.0)
            vmax = np.float32(0.0)
            for j in range(BLOCK):
                if amax < abs(x[o + j]):
                    amax = abs(x[o + j])
                    vmax = x[o + j]
            d = vmax / np.float32(-8.0)
            inv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
            _put_f16(b, at, d)
            for j in range(BLOCK // 2):
                lo = min(15, np.int32(x[o + j] * inv + np.float32(8.5)))
                hi = min(15, np.int32(x[o + BLOCK // 2 + j] * inv + np.float32(8.5)))
                b[at + 2 + j] = np.uint8(lo | (hi << 4))


@kernel(inline="always")
def load_row(code, b, at, x):
    """The row stored from byte `at` of b (bytes of a cache of type `code`) decoded into f32 x
    (ggml's to_float)."""
    n = x.shape[0]
    m = min(BLOCK, n)  # BLOCK, as a value LLVM cannot unroll the loops on: it vectorizes them instead
    if code == F32:
        for j in range(n):
            x[j] = _f32_at(b, at + 4 * j)
    elif code == F16:
        for j in range(n):
            x[j] = f16_at(b, at + 2 * j)
    elif code == Q8_0:
        for blk in range(n // BLOCK):
            o = at + 34 * blk
            d = f16_at(b, o)
            qs, xs = b[o + 2:o + 34], x[BLOCK * blk:BLOCK * (blk + 1)]
            for j in range(m):
                xs[j] = _s8(qs[j]) * d
    else:
        for blk in range(n // BLOCK):
            o = at + 18 * blk
            d = f16_at(b, o)
            qs, xs = b[o + 2:o + 18], x[BLOCK * blk:BLOCK * (blk + 1)]
            for j in range(m // 2):
                lo, hi = _nibbles(qs[j])
                xs[j] = (lo - np.float32(8.0)) * d
                xs[BLOCK // 2 + j] = (hi - np.float32(8.0)) * d


@kernel(inline="always")
def load_key(code, b, at, kq, kd, c):
    """The key row stored from byte `at` of b as the dot products read it, into column c of the
    tiles kq [d, cells] and kd [d / 32, cells]: for Q8_0 / Q4_0 its integer values (as f32) and
    block scales; for f16 / f32 its values and scales of 1."""
    n = kq.shape[0]
    m = min(BLOCK, n)
    if code == Q8_0:
        for blk in range(n // BLOCK):
            o = at + 34 * blk
            kd[blk, c] = f16_at(b, o)
            qs, ks = b[o + 2:o + 34], kq[BLOCK * blk:BLOCK * (blk + 1), c]
            for j in range(m):
                ks[j] = _s8(qs[j])
    elif code == Q4_0:
        for blk in range(n // BLOCK):
            o = at + 18 * blk
            kd[blk, c] = f16_at(b, o)
            qs, ks = b[o + 2:o + 18], kq[BLOCK * blk:BLOCK * (blk + 1), c]
            for j in range(m // 2):
                lo, hi = _nibbles(qs[j])
                ks[j] = lo - np.float32(8.0)
                ks[BLOCK // 2 + j] = hi - np.float32(8.0)
    else:
        for j in range(n):
            kq[j, c] = _f32_at(b, at + 4 * j) if code == F32 else f16_at(b, at + 2 * j)
        for blk in range(n // BLOCK):
            kd[blk, c] = np.float32(1.0)


@kernel(inline="always")
def quantize_q8_0(x, qq, qd):
    """Row x as Q8_0 blocks (quantize_row_q8_0): integer values in qq (as f32), f16 scales in qd."""
    for blk in range(x.shape[0] // BLOCK):
        o = BLOCK * blk
        amax = np.float32(0.0)
        for j in range(BLOCK):
            amax = max(amax, abs(x[o + j]))
        inv = np.float32(127.0) / amax if amax != 0 else np.float32(0.0)
        qd[blk] = f16_to_f32(f32_to_f16(amax / np.float32(127.0)))
        for j in range(BLOCK):
            qq[o + j] = _rint(x[o + j] * inv)


@kernel(inline="always")
def score_cells(kq, kd, qq, qd, lo, hi, lanes, out):
    """out[c] for cells c in [lo, hi): ggml's AVX2 block dot product of key c (column c of the tiles
    kq, kd from load_key) with a query (qq, qd): per block, eight lanes of four products each (exact
    integers when both sides are quantized) accumulate fma(kd * qd, lane, acc) over the blocks, and
    the lanes are summed as hsum_float_8 sums them. The loops run across cells (lanes [8, cells] is
    work space), so they vectorize: with unsigned cell indices, as numba then leaves out the
    negative-index wrap-around that keeps LLVM from it."""
    lo, hi = np.uint64(lo), np.uint64(hi)
    for lane in range(8):
        for c in range(lo, hi):
            lanes[lane, c] = np.float32(0.0)
    for blk in range(kd.shape[0]):
        d = qd[blk]
        for lane in range(8):
            o = BLOCK * blk + 4 * lane
            q0, q1, q2, q3 = qq[o], qq[o + 1], qq[o + 2], qq[o + 3]
            for c in range(lo, hi):
                s = (kq[o, c] * q0 + kq[o + 1, c] * q1) + (kq[o + 2, c] * q2 + kq[o + 3, c] * q3)
                lanes[lane, c] = fma(kd[blk, c] * d, s, lanes[lane, c])
    for c in range(lo, hi):
        out[c] = ((lanes[0, c] + lanes[4, c]) + (lanes[2, c] + lanes[6, c])) \
            + ((lanes[1, c] + lanes[5, c]) + (lanes[3, c] + lanes[7, c]))
