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
from ggrun.core.backends.cpu.quant import CODES, F16, F32, Q4_0, Q8_0
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
def load_row(code, b, x):
    """The stored row b (bytes) of a cache of type `code` decoded into f32 x (ggml's to_float)."""
    n = x.shape[0]
    if code == F32:
        for j in range(n):
            x[j] = _f32_at(b, 4 * j)
    elif code == F16:
        for j in range(n):
            x[j] = f16_at(b, 2 * j)
    elif code == Q8_0:
        for blk in range(n // BLOCK):
            d = f16_at(b, 34 * blk)
            for j in range(BLOCK):
                x[BLOCK * blk + j] = np.float32(np.int8(b[34 * blk + 2 + j])) * d
    else:
        for blk in range(n // BLOCK):
            d = f16_at(b, 18 * blk)
            for j in range(BLOCK // 2):
                v = np.int32(b[18 * blk + 2 + j])
                x[BLOCK * blk + j] = np.float32((v & 15) - 8) * d
                x[BLOCK * blk + BLOCK // 2 + j] = np.float32((v >> 4) - 8) * d


@kernel(inline="always")
def load_key(code, b, kq, kd):
    """A cached key row b as a dot product reads it: for Q8_0 / Q4_0 its integer values in kq (as
    f32) and its block scales in kd; for f16 / f32 its values in kq and scales of 1."""
    n = kq.shape[0]
    if code == Q8_0:
        for blk in range(n // BLOCK):
            kd[blk] = f16_at(b, 34 * blk)
            for j in range(BLOCK):
                kq[BLOCK * blk + j] = np.float32(np.int8(b[34 * blk + 2 + j]))
    elif code == Q4_0:
        for blk in range(n // BLOCK):
            kd[blk] = f16_at(b, 18 * blk)
            for j in range(BLOCK // 2):
                v = np.int32(b[18 * blk + 2 + j])
                kq[BLOCK * blk + j] = np.float32((v & 15) - 8)
                kq[BLOCK * blk + BLOCK // 2 + j] = np.float32((v >> 4) - 8)
    else:
        load_row(code, b, kq)
        for blk in range(n // BLOCK):
            kd[blk] = np.float32(1.0)


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
def dot_blocks(kq, kd, qq, qd):
    """ggml's AVX2 block dot product of a key (kq, kd) and a query (qq, qd): per block, eight
    lanes of four products each (exact integers when both sides are quantized) accumulate
    fma(kd * qd, lane, acc) over the blocks; then the lanes are summed as hsum_float_8 does."""
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0.0)
    for blk in range(kd.shape[0]):
        d = kd[blk] * qd[blk]
        o = BLOCK * blk
        a0 = fma(d, _lane(kq, qq, o), a0)
        a1 = fma(d, _lane(kq, qq, o + 4), a1)
        a2 = fma(d, _lane(kq, qq, o + 8), a2)
        a3 = fma(d, _lane(kq, qq, o + 12), a3)
        a4 = fma(d, _lane(kq, qq, o + 16), a4)
        a5 = fma(d, _lane(kq, qq, o + 20), a5)
        a6 = fma(d, _lane(kq, qq, o + 24), a6)
        a7 = fma(d, _lane(kq, qq, o + 28), a7)
    return ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7))


@kernel(inline="always")
def _lane(k, q, o):
    return (k[o] * q[o] + k[o + 1] * q[o + 1]) + (k[o + 2] * q[o + 2] + k[o + 3] * q[o + 3])
