"""AVX-512 kernels (level "avx512", isa.py: AVX-512 F/BW/VL with VNNI) beside avx2_r8.py's AVX2 ones:
the products of weights repacked "r16" (layouts.py; decode steps, prompts, mul_mat_multi, mul_mat_glu)
and the activation quantizer they start with, written in a 512-bit vocabulary (`zvec`) built on
vec.py's LLVM helpers.

"r16" is the r8 layout with groups of 16 rows: per group and block the 16 rows' f16 scales
(and mins), then lane vectors of 64 bytes, lane r holding 4 bytes of row r, so that one 512-bit
`vpdpbusd` multiplies 4 quants of every row by 4 broadcast activation bytes and adds them into
the row's 32-bit lane. Every offset is twice r8's; Q8_0's quants are stored plus 128 (unsigned,
as vpdpbusd reads its first operand; 128 times the activations' block sum is taken off again).
The integer block sums are exact, as r8's are, and per row the float steps are r8's in r8's order,
so every result equals the AVX2 kernels' bit for bit (the tests compare them).

The drivers at the end repeat avx2_r8.py's with the r16 row kernels: a numba kernel calls the kernels
it names, and one taking the row kernel as an argument would not be cached on disk.
Compiled only where the level is avx512: an AVX-512 instruction stops LLVM on a CPU without it.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import prange, types
from numba.extending import intrinsic, models, register_model

from ggrun.core.backends.cpu.jit import kernel
from ggrun.core.backends.cpu.quant.codes import (
    _I8, _I16, _I32, _I64, ACT_Q8_1, ACT_Q8_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0,
)
from ggrun.core.backends.cpu.quant.layouts import PF_GROUPS, R16, TOKENS, _r8_block
from ggrun.core.backends.cpu.quant.routing import chunk_step, group_rows, n_tasks, scatter_rows, task
from ggrun.core.backends.cpu.quant.vec import _addr, _as, _llvm_call, _splat, f16_round, prefetch
from ggrun.core.backends.cpu.vecmath import glu_span

_F32 = ir.FloatType()


# ---------------------------------------------------------------------------------------------
# A 512-bit vector type and the intrinsics the kernels use
# ---------------------------------------------------------------------------------------------

class _ZType(types.Type):
    def __init__(self) -> None:
        super().__init__(name="vec512")


zvec = _ZType()
_Z = ir.VectorType(_I64, 8)
_ZB = ir.VectorType(_I8, 64)
_ZW = ir.VectorType(_I16, 32)
_ZD = ir.VectorType(_I32, 16)
_ZF = ir.VectorType(_F32, 16)


@register_model(_ZType)
class _ZModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type) -> None:
        super().__init__(dmm, fe_type, _Z)


def _zop(n_args, body, arg_types=None):
    """An intrinsic (zvec, ...) -> zvec of n_args arguments whose LLVM body is body(builder, *args)."""
    sig = zvec(*(arg_types or (zvec,) * n_args))

    def codegen(context, builder, signature, llargs):
        return body(builder, *llargs)
    typing = {  # numba reads an intrinsic's arity from its typing function
        0: lambda typingctx: (sig, codegen),
        1: lambda typingctx, a: (sig, codegen),
        2: lambda typingctx, a, b: (sig, codegen),
        3: lambda typingctx, a, b, c: (sig, codegen),
    }[n_args]
    return intrinsic(typing)


def _i32s(op):
    return lambda b, x, y: _as(b, op(_as(b, x, _ZD), _as(b, y, _ZD)), _Z)


def _f32s(op):
    return lambda b, x, y: _as(b, op(_as(b, x, _ZF), _as(b, y, _ZF)), _Z)


zand = _zop(2, lambda b, x, y: b.and_(x, y))
zor = _zop(2, lambda b, x, y: b.or_(x, y))
zadd32 = _zop(2, lambda b, x, y: _i32s(b.add)(b, x, y))
zsub32 = _zop(2, lambda b, x, y: _i32s(b.sub)(b, x, y))
zmul32 = _zop(2, lambda b, x, y: _i32s(b.mul)(b, x, y))
zmin32 = _zop(2, lambda b, x, y: _as(b, b.select(b.icmp_signed("<", _as(b, x, _ZD), _as(b, y, _ZD)),
                                                  _as(b, x, _ZD), _as(b, y, _ZD)), _Z))
zmulf = _zop(2, lambda b, x, y: _f32s(b.fmul)(b, x, y))
zaddf = _zop(2, lambda b, x, y: _f32s(b.fadd)(b, x, y))
zsubf = _zop(2, lambda b, x, y: _f32s(b.fsub)(b, x, y))
zfma = _zop(3, lambda b, x, y, z: _as(b, _llvm_call(b, "llvm.fma.v16f32", _ZF, [_as(b, x, _ZF), _as(b, y, _ZF),
                                                                          _as(b, z, _ZF)]), _Z))
# acc + the sums of 4 products of unsigned bytes u and signed bytes s, per 32-bit lane
zdp = _zop(3, lambda b, acc, u, s: _as(b, _llvm_call(b, "llvm.x86.avx512.vpdpbusd.512", _ZD,
                                                [_as(b, acc, _ZD), _as(b, u, _ZD), _as(b, s, _ZD)]), _Z))
zcvt = _zop(1, lambda b, x: _as(b, b.sitofp(_as(b, x, _ZD), _ZF), _Z))
zabsf = _zop(1, lambda b, x: _as(b, _llvm_call(b, "llvm.fabs.v16f32", _ZF, [_as(b, x, _ZF)]), _Z))
# floats to the nearest int32, ties to even (vcvtps2dq in the current rounding mode, as AVX2's)
zround = _zop(1, lambda b, x: _as(b, _llvm_call(b, "llvm.x86.avx512.mask.cvtps2dq.512", _ZD, [
    _as(b, x, _ZF), ir.Constant(_ZD, [0] * 16), ir.Constant(_I16, -1), ir.Constant(_I32, 4)]), _Z))
zsrl16 = _zop(2, lambda b, x, n: _as(b, b.lshr(_as(b, x, _ZW), _splat(b, b.trunc(n, _I16), _ZW)), _Z),
              (zvec, types.int64))
zsll16 = _zop(2, lambda b, x, n: _as(b, b.shl(_as(b, x, _ZW), _splat(b, b.trunc(n, _I16), _ZW)), _Z),
              (zvec, types.int64))
zsll32 = _zop(2, lambda b, x, n: _as(b, b.shl(_as(b, x, _ZD), _splat(b, b.trunc(n, _I32), _ZD)), _Z),
              (zvec, types.int64))
zset8 = _zop(1, lambda b, x: _as(b, _splat(b, b.trunc(x, _I8), _ZB), _Z), (types.int64,))
zset32 = _zop(1, lambda b, x: _as(b, _splat(b, b.trunc(x, _I32), _ZD), _Z), (types.int64,))
zsetf = _zop(1, lambda b, x: _as(b, _splat(b, x, _ZF), _Z), (types.float32,))
zzero = _zop(0, lambda b: ir.Constant(_Z, [0] * 8))


def _load_op(ret, body):
    """An intrinsic (array, byte offset) -> ret whose body reads from that address."""
    @intrinsic
    def load(typingctx, ary, off):
        def codegen(context, builder, signature, args):
            return body(builder, lambda t: _addr(context, builder, signature.args[0], args[0], args[1], t))
        return ret(ary, types.intp), codegen
    return load


def _widen(count, signed):
    def body(b, at):
        x = b.load(at(ir.VectorType(_I8, count)), align=1)
        return _as(b, b.sext(x, _ZD) if signed else b.zext(x, _ZD), _Z)
    return body


zload = _load_op(zvec, lambda b, at: b.load(at(_Z), align=1))  # 64 bytes
zbcast32 = _load_op(zvec, lambda b, at: _as(b, _splat(b, b.load(at(_I32), align=1), _ZD), _Z))  # 4 bytes, 16 times
zf16x16 = _load_op(zvec, lambda b, at: _as(b, b.fpext(b.load(at(ir.VectorType(ir.HalfType(), 16)), align=1), _ZF), _Z))
zf32x16 = _load_op(zvec, lambda b, at: b.load(at(_Z), align=1))  # 16 floats
zu8x16 = _load_op(zvec, _widen(16, False))  # 16 unsigned bytes, one per 32-bit lane
zs8x16 = _load_op(zvec, _widen(16, True))   # 16 signed bytes, one per 32-bit lane


@intrinsic
def zstoref(typingctx, ary, off, x):
    """Store a vector's 16 floats at byte `off` of an array's data."""
    def codegen(context, builder, signature, args):
        builder.store(_as(builder, args[2], _ZF), _addr(context, builder, signature.args[0], args[0], args[1], _ZF),
                      align=1)
        return context.get_dummy_value()
    return types.none(ary, types.intp, zvec), codegen


@intrinsic
def zstore_i8(typingctx, ary, off, x):
    """Store a vector's 16 int32 lanes (each within int8) as 16 int8 at byte `off`."""
    def codegen(context, builder, signature, args):
        q = builder.trunc(_as(builder, args[2], _ZD), ir.VectorType(_I8, 16))
        builder.store(q, _addr(context, builder, signature.args[0], args[0], args[1], ir.VectorType(_I8, 16)), align=1)
        return context.get_dummy_value()
    return types.none(ary, types.intp, zvec), codegen


@intrinsic
def zlane(typingctx, x, i):
    """Float lane i of a vector."""
    def codegen(context, builder, signature, args):
        return builder.extract_element(_as(builder, args[0], _ZF), builder.trunc(args[1], _I32))
    return types.float32(zvec, types.intp), codegen


@intrinsic
def zhsum32(typingctx, x):
    """The sum of a vector's 16 int32 lanes."""
    def codegen(context, builder, signature, args):
        total = _llvm_call(builder, "llvm.vector.reduce.add.v16i32", _I32, [_as(builder, args[0], _ZD)])
        return builder.sext(total, _I64)
    return types.int64(zvec), codegen


@intrinsic
def zmaxf(typingctx, a, b):
    """Lane by lane b where b > a, else a (a NaN in b is never taken, as the scalar loops keep it)."""
    def codegen(context, builder, signature, args):
        x, y = _as(builder, args[0], _ZF), _as(builder, args[1], _ZF)
        return _as(builder, builder.select(builder.fcmp_ordered(">", y, x), y, x), _Z)
    return zvec(zvec, zvec), codegen


@intrinsic
def zhmaxf(typingctx, x):
    """The largest of a vector's 16 floats (lanes compared as `zmaxf` compares them)."""
    def codegen(context, builder, signature, args):
        f = _as(builder, args[0], _ZF)
        best = builder.extract_element(f, ir.Constant(_I32, 0))
        for i in range(1, 16):
            v = builder.extract_element(f, ir.Constant(_I32, i))
            best = builder.select(builder.fcmp_ordered(">", v, best), v, best)
        return best
    return types.float32(zvec), codegen


@intrinsic
def zanynan(typingctx, a, b):
    """Whether any of the 32 floats of two vectors is NaN."""
    def codegen(context, builder, signature, args):
        x, y = _as(builder, args[0], _ZF), _as(builder, args[1], _ZF)
        nan = builder.or_(builder.fcmp_unordered("uno", x, x), builder.fcmp_unordered("uno", y, y))
        return _llvm_call(builder, "llvm.vector.reduce.or.v16i1", ir.IntType(1), [nan])
    return types.boolean(zvec, zvec), codegen


# ---------------------------------------------------------------------------------------------
# Activation rows to 8-bit blocks: activations.quantize_rows' results (the same rounding), 16 at a time
# ---------------------------------------------------------------------------------------------

@kernel(inline="always")
def _quantize_q8_0_block(x, o, qs, at, d, s, sums, n, b, with_s):
    """The 32 floats at byte o of x to one Q8_0/Q8_1 block: quants at qs byte `at`, d, s, sums. A NaN
    among them makes d NaN (as AVX2's quantizer does for a block of NaNs): a non-finite activation
    must reach the logits, where it is caught, not turn into a block of zeros."""
    v0 = zf32x16(x, o)
    v1 = zf32x16(x, o + 64)
    amax = zhmaxf(zmaxf(zmaxf(zzero(), zabsf(v0)), zabsf(v1)))
    if zanynan(v0, v1):
        amax = np.float32(np.nan)
    inv = zsetf(np.float32(127.0) / amax if amax != 0 else np.float32(0.0))
    q0 = zround(zmulf(v0, inv))
    q1 = zround(zmulf(v1, inv))
    zstore_i8(qs, at, q0)
    zstore_i8(qs, at + 16, q1)
    lo = zhsum32(q0)
    hi = zhsum32(q1)
    scale = amax / np.float32(127.0)
    d[n, b] = f16_round(scale)
    sums[n, 2 * b] = lo
    sums[n, 2 * b + 1] = hi
    if with_s:
        s[n, b] = f16_round(scale * np.float32(lo + hi))


@kernel(inline="always")
def _quantize_q8_k_block(x, o, qs, at, d, sums, n, b):
    """Block b of row n of x (256 floats from byte o) to one Q8_K block (quants at qs byte `at`), as
    activations.py's scalar loop: the scale from the first value of the largest magnitude (NaN never one),
    quants capped at 127."""
    m = zzero()
    for j in range(16):
        m = zmaxf(m, zabsf(zf32x16(x, o + 64 * j)))
    amax = zhmaxf(m)
    base = 256 * b
    if amax == 0:
        d[n, b] = 0.0
        for g in range(16):
            zstore_i8(qs, at + 16 * g, zzero())
            sums[n, 16 * b + g] = 0
        return
    vmax = amax
    for j in range(256):
        if abs(x[n, base + j]) == amax:
            vmax = x[n, base + j]
            break
    iscale = np.float32(-127.0) / vmax
    sv = zsetf(iscale)
    cap = zset32(127)
    for g in range(16):
        q = zmin32(zround(zmulf(sv, zf32x16(x, o + 64 * g))), cap)
        zstore_i8(qs, at + 16 * g, q)
        sums[n, 16 * b + g] = zhsum32(q)
    d[n, b] = np.float32(1.0) / iscale


@kernel(_nrt=False)
def quantize_rows_avx512(act, x, qs, d, s, sums):
    """activations.quantize_rows for rows of unit inner stride: x (f32 [N, K]) to Q8_0/Q8_1/Q8_K blocks."""
    n_rows, k = x.shape
    for n in range(n_rows):
        row = n * x.strides[0]  # bytes into x
        if act == ACT_Q8_K:
            for b in range(k // 256):
                _quantize_q8_k_block(x, row + 1024 * b, qs, n * k + 256 * b, d, sums, n, b)
        else:
            for b in range(k // 32):
                _quantize_q8_0_block(x, row + 128 * b, qs, n * k + 32 * b, d, s, sums, n, b, act == ACT_Q8_1)


# ---------------------------------------------------------------------------------------------
# r16 row kernels: groups g0..g1 of an r16 weight against activation rows n0..n1, out[n, 16g + r]
# ---------------------------------------------------------------------------------------------

@kernel(inline="always")
def _r16_block(code):
    """Bytes per group and block of a legacy type, and where the quants start in them: r8's, twice."""
    size, q_at = _r8_block(code)
    return 2 * size, 2 * q_at


@kernel(inline="always")
def _offset(code):
    """What each quant is stored above its value (taken off as this times the activations' sum)."""
    if code == Q4_0:
        return 8
    if code == Q5_0:
        return 16
    if code == Q8_0:
        return 128
    return 0


@kernel(inline="always")
def _fifth_bit(hb, bit):
    """Bit `bit` of every byte of hb moved to bit 4 (16-bit shifts; the mask drops what crosses bytes)."""
    return zsll16(hb, 4 - bit) if bit < 4 else zsrl16(hb, bit - 4)


@kernel(inline="always")
def _fifth_bits(code, p, at):
    """Q5's fifth bits, the 64 bytes before its quants at byte `at` (nothing read for Q4)."""
    if code == Q5_0 or code == Q5_1:
        return zload(p, at - 64)
    return zzero()


@kernel(inline="always")
def _nibbles(code, p, at, hb, j, m15, m16):
    """Lane vector j of a Q4/Q5 block whose quants start at byte `at`: the rows' low and high values."""
    q = zload(p, at + 64 * j)
    lo = zand(q, m15)
    hi = zand(zsrl16(q, 4), m15)
    if code == Q5_0 or code == Q5_1:
        lo = zor(lo, zand(_fifth_bit(hb, 2 * j), m16))
        hi = zor(hi, zand(_fifth_bit(hb, 2 * j + 1), m16))
    return lo, hi


@kernel(inline="always")
def _legacy_lanes(code, p, o, q_at, qs, x, m15, m16):
    """The 16 rows' integer sums of a legacy block at byte o with activation bytes at qs[x..]
    (quants as stored: the offset not yet taken off), in two chains."""
    a = zzero()
    c = zzero()
    if code == Q8_0:
        for j in range(0, 8, 2):
            a = zdp(a, zload(p, o + q_at + 64 * j), zbcast32(qs, x + 4 * j))
            c = zdp(c, zload(p, o + q_at + 64 * j + 64), zbcast32(qs, x + 4 * j + 4))
    else:
        hb = _fifth_bits(code, p, o + q_at)
        for j in range(4):
            lo, hi = _nibbles(code, p, o + q_at, hb, j, m15, m16)
            a = zdp(a, lo, zbcast32(qs, x + 4 * j))
            c = zdp(c, hi, zbcast32(qs, x + 16 + 4 * j))
    return zadd32(a, c)


@kernel(inline="always")
def _legacy_lanes4(code, p, o, q_at, qs, x, k, m15, m16):
    """`_legacy_lanes` for the four activation rows at qs[x..], qs[x + k..], ...: each weight
    vector loaded and unpacked once."""
    l0 = zzero()
    l1 = zzero()
    l2 = zzero()
    l3 = zzero()
    if code == Q8_0:
        for j in range(8):
            q = zload(p, o + q_at + 64 * j)
            at = x + 4 * j
            l0 = zdp(l0, q, zbcast32(qs, at))
            l1 = zdp(l1, q, zbcast32(qs, at + k))
            l2 = zdp(l2, q, zbcast32(qs, at + 2 * k))
            l3 = zdp(l3, q, zbcast32(qs, at + 3 * k))
    else:
        hb = _fifth_bits(code, p, o + q_at)
        for j in range(4):
            lo, hi = _nibbles(code, p, o + q_at, hb, j, m15, m16)
            at = x + 4 * j
            l0 = zdp(zdp(l0, lo, zbcast32(qs, at)), hi, zbcast32(qs, at + 16))
            l1 = zdp(zdp(l1, lo, zbcast32(qs, at + k)), hi, zbcast32(qs, at + k + 16))
            l2 = zdp(zdp(l2, lo, zbcast32(qs, at + 2 * k)), hi, zbcast32(qs, at + 2 * k + 16))
            l3 = zdp(zdp(l3, lo, zbcast32(qs, at + 3 * k)), hi, zbcast32(qs, at + 3 * k + 16))
    return l0, l1, l2, l3


@kernel(inline="always")
def _less_offset(code, lanes, sums, n, b):
    off = _offset(code)
    if off == 0:
        return lanes
    return zsub32(lanes, zset32(off * (sums[n, 2 * b] + sums[n, 2 * b + 1])))


@kernel(inline="always")
def _scaled(wd, d, n, b, lanes, acc):
    """acc plus integer lanes times the rows' scales wd and activation row n's block-b scale
    (r8's float step, in its order)."""
    return zfma(zmulf(wd, zsetf(d[n, b])), zcvt(lanes), acc)


@kernel(inline="always")
def _r16_store(out, n, g, m, acc):
    r = R16 * g
    if r + R16 <= m:
        zstoref(out, 4 * (n * out.shape[1] + r), acc)
    else:
        for i in range(m - r):
            out[n, r + i] = zlane(acc, i)


@kernel(inline="always")
def _prefetch_rows(p, g0, g1):
    """Start reading groups g0..g1."""
    for at in range(g0 * p.strides[0], min(g1, p.shape[0]) * p.strides[0], 64):
        prefetch(p, at)


@kernel(_nrt=False)
def _rows_r16(code, p, qs, d, s, sums, out, g0, g1, n0, n1):
    """Legacy types, one activation row at a time (decode steps). No software prefetch in the one-row
    kernels: streaming weights from memory, the hardware prefetcher alone read them faster (one thread,
    80 matrices of 640 x 2048 out of cache, shared 2-core EPYC: Q5_0 12-15 -> 16-20 GB/s, Q4_1 10-13 ->
    17-19, Q4_K 9 -> 18, Q6_K 6.3 -> 7.3), as it already did for Q8_0."""
    k = qs.shape[1]
    m = out.shape[1]
    size, q_at = _r16_block(code)
    m15 = zset8(15)
    m16 = zset8(16)
    for g in range(g0, g1):
        for n in range(n0, n1):
            acc = zzero()
            acc_m = zzero()
            for b in range(k // 32):
                o = g * p.strides[0] + size * b  # no software prefetch: the hardware's streams faster
                lanes = _less_offset(code, _legacy_lanes(code, p, o, q_at, qs, n * k + 32 * b, m15, m16), sums, n, b)
                acc = _scaled(zf16x16(p, o), d, n, b, lanes, acc)
                if code == Q4_1 or code == Q5_1:
                    acc_m = zfma(zf16x16(p, o + 32), zsetf(s[n, b]), acc_m)
            _r16_store(out, n, g, m, zaddf(acc, acc_m))


@kernel(_nrt=False)
def _rows_r16_x4(code, p, qs, d, s, sums, out, g0, g1, n0, n1):
    """Legacy types, four activation rows at a time (n1 - n0 a multiple of 4): as `_rows_r16`
    computes each row."""
    k = qs.shape[1]
    m = out.shape[1]
    size, q_at = _r16_block(code)
    m15 = zset8(15)
    m16 = zset8(16)
    for g in range(g0, g1):
        _prefetch_rows(p, g + 1, g + 2)
        for n in range(n0, n1, TOKENS):
            acc0 = zzero()
            acc1 = zzero()
            acc2 = zzero()
            acc3 = zzero()
            for b in range(k // 32):
                o = g * p.strides[0] + size * b
                l0, l1, l2, l3 = _legacy_lanes4(code, p, o, q_at, qs, n * k + 32 * b, k, m15, m16)
                wd = zf16x16(p, o)
                acc0 = _scaled(wd, d, n, b, _less_offset(code, l0, sums, n, b), acc0)
                acc1 = _scaled(wd, d, n + 1, b, _less_offset(code, l1, sums, n + 1, b), acc1)
                acc2 = _scaled(wd, d, n + 2, b, _less_offset(code, l2, sums, n + 2, b), acc2)
                acc3 = _scaled(wd, d, n + 3, b, _less_offset(code, l3, sums, n + 3, b), acc3)
            if code == Q4_1 or code == Q5_1:  # the mins' chain, apart as in the one-row kernel
                e0 = zzero()
                e1 = zzero()
                e2 = zzero()
                e3 = zzero()
                for b in range(k // 32):
                    wm = zf16x16(p, g * p.strides[0] + size * b + 32)
                    e0 = zfma(wm, zsetf(s[n, b]), e0)
                    e1 = zfma(wm, zsetf(s[n + 1, b]), e1)
                    e2 = zfma(wm, zsetf(s[n + 2, b]), e2)
                    e3 = zfma(wm, zsetf(s[n + 3, b]), e3)
                acc0 = zaddf(acc0, e0)
                acc1 = zaddf(acc1, e1)
                acc2 = zaddf(acc2, e2)
                acc3 = zaddf(acc3, e3)
            _r16_store(out, n, g, m, acc0)
            _r16_store(out, n + 1, g, m, acc1)
            _r16_store(out, n + 2, g, m, acc2)
            _r16_store(out, n + 3, g, m, acc3)


# Q4_K / Q5_K per group and super-block: d (16 f16) at 0, dmin at 32, the scales [sub-block][row]
# at 64, the mins at 192, (Q5_K) the fifth bits as 8 lane vectors at 320, then the quants as 32
# lane vectors (vector 8i + j: 4 bytes of each row's 32 for sub-blocks 2i and 2i + 1).

@kernel(inline="always")
def _k4_values(five, p, o, q_at, i, j, m15, m16):
    """Quant vector 8i + j of a Q4_K/Q5_K block: the rows' values of sub-blocks 2i and 2i + 1."""
    q = zload(p, o + q_at + 64 * (8 * i + j))
    lo = zand(q, m15)
    hi = zand(zsrl16(q, 4), m15)
    if five:
        hb = zload(p, o + 320 + 64 * j)
        lo = zor(lo, zand(_fifth_bit(hb, 2 * i), m16))
        hi = zor(hi, zand(_fifth_bit(hb, 2 * i + 1), m16))
    return lo, hi


@kernel(inline="always")
def _k4_mins(p, o, sums, n, b):
    """Sum over sub-blocks of the rows' mins times the activations' sums (integer lanes)."""
    msum = zzero()
    for sub in range(8):
        msum = zadd32(msum, zmul32(zu8x16(p, o + 192 + 16 * sub),
                                   zset32(sums[n, 16 * b + 2 * sub] + sums[n, 16 * b + 2 * sub + 1])))
    return msum


@kernel(_nrt=False)
def _rows_r16_q45_k(five, p, qs, d, sums, out, g0, g1, n0, n1):
    k = qs.shape[1]
    m = out.shape[1]
    size = 2880 if five else 2368
    q_at = 832 if five else 320
    m15 = zset8(15)
    m16 = zset8(16)
    for g in range(g0, g1):
        for n in range(n0, n1):
            acc = zzero()
            acc_min = zzero()
            for b in range(k // 256):
                o = g * p.strides[0] + size * b  # no software prefetch, as in _rows_r16
                x = n * k + 256 * b
                isum = zzero()
                for i in range(4):
                    t_lo = zzero()
                    t_hi = zzero()
                    for j in range(8):
                        lo, hi = _k4_values(five, p, o, q_at, i, j, m15, m16)
                        t_lo = zdp(t_lo, lo, zbcast32(qs, x + 64 * i + 4 * j))
                        t_hi = zdp(t_hi, hi, zbcast32(qs, x + 64 * i + 32 + 4 * j))
                    isum = zadd32(isum, zadd32(zmul32(t_lo, zu8x16(p, o + 64 + 32 * i)),
                                               zmul32(t_hi, zu8x16(p, o + 80 + 32 * i))))
                acc = _scaled(zf16x16(p, o), d, n, b, isum, acc)
                acc_min = _scaled(zf16x16(p, o + 32), d, n, b, _k4_mins(p, o, sums, n, b), acc_min)
            _r16_store(out, n, g, m, zsubf(acc, acc_min))


@kernel(_nrt=False)
def _rows_r16_x4_q45_k(five, p, qs, d, sums, out, g0, g1, n0, n1):
    """Q4_K / Q5_K, four activation rows at a time, as `_rows_r16_q45_k` computes each row."""
    k = qs.shape[1]
    m = out.shape[1]
    size = 2880 if five else 2368
    q_at = 832 if five else 320
    m15 = zset8(15)
    m16 = zset8(16)
    for g in range(g0, g1):
        _prefetch_rows(p, g + 1, g + 2)
        for n in range(n0, n1, TOKENS):
            acc0 = zzero()
            acc1 = zzero()
            acc2 = zzero()
            acc3 = zzero()
            a0 = zzero()
            a1 = zzero()
            a2 = zzero()
            a3 = zzero()
            for b in range(k // 256):
                o = g * p.strides[0] + size * b
                x = n * k + 256 * b
                i0 = zzero()
                i1 = zzero()
                i2 = zzero()
                i3 = zzero()
                for i in range(4):
                    lo0 = zzero()
                    hi0 = zzero()
                    lo1 = zzero()
                    hi1 = zzero()
                    lo2 = zzero()
                    hi2 = zzero()
                    lo3 = zzero()
                    hi3 = zzero()
                    for j in range(8):
                        lo, hi = _k4_values(five, p, o, q_at, i, j, m15, m16)
                        at = x + 64 * i + 4 * j
                        lo0 = zdp(lo0, lo, zbcast32(qs, at))
                        hi0 = zdp(hi0, hi, zbcast32(qs, at + 32))
                        lo1 = zdp(lo1, lo, zbcast32(qs, at + k))
                        hi1 = zdp(hi1, hi, zbcast32(qs, at + k + 32))
                        lo2 = zdp(lo2, lo, zbcast32(qs, at + 2 * k))
                        hi2 = zdp(hi2, hi, zbcast32(qs, at + 2 * k + 32))
                        lo3 = zdp(lo3, lo, zbcast32(qs, at + 3 * k))
                        hi3 = zdp(hi3, hi, zbcast32(qs, at + 3 * k + 32))
                    sc_lo = zu8x16(p, o + 64 + 32 * i)
                    sc_hi = zu8x16(p, o + 80 + 32 * i)
                    i0 = zadd32(i0, zadd32(zmul32(lo0, sc_lo), zmul32(hi0, sc_hi)))
                    i1 = zadd32(i1, zadd32(zmul32(lo1, sc_lo), zmul32(hi1, sc_hi)))
                    i2 = zadd32(i2, zadd32(zmul32(lo2, sc_lo), zmul32(hi2, sc_hi)))
                    i3 = zadd32(i3, zadd32(zmul32(lo3, sc_lo), zmul32(hi3, sc_hi)))
                wd = zf16x16(p, o)
                acc0 = _scaled(wd, d, n, b, i0, acc0)
                acc1 = _scaled(wd, d, n + 1, b, i1, acc1)
                acc2 = _scaled(wd, d, n + 2, b, i2, acc2)
                acc3 = _scaled(wd, d, n + 3, b, i3, acc3)
                wmin = zf16x16(p, o + 32)
                a0 = _scaled(wmin, d, n, b, _k4_mins(p, o, sums, n, b), a0)
                a1 = _scaled(wmin, d, n + 1, b, _k4_mins(p, o, sums, n + 1, b), a1)
                a2 = _scaled(wmin, d, n + 2, b, _k4_mins(p, o, sums, n + 2, b), a2)
                a3 = _scaled(wmin, d, n + 3, b, _k4_mins(p, o, sums, n + 3, b), a3)
            _r16_store(out, n, g, m, zsubf(acc0, a0))
            _r16_store(out, n + 1, g, m, zsubf(acc1, a1))
            _r16_store(out, n + 2, g, m, zsubf(acc2, a2))
            _r16_store(out, n + 3, g, m, zsubf(acc3, a3))


# Q6_K per group and super-block: d (16 f16) at 0, the int8 scales [group of 16][row] at 32, ql as
# 32 lane vectors at 288 (vector 16h + 8c + j: bytes 64h + 32c + 4j.. of each row), qh as 16 at 2336.

@kernel(inline="always")
def _k6_values(p, o, h, c, j, m15, m48):
    """The rows' six-bit values of elements 128h + 32c + 4j.. (lo) and 128h + 32c + 64 + 4j.. (hi)."""
    q = zload(p, o + 288 + 64 * (16 * h + 8 * c + j))
    hq = zload(p, o + 2336 + 64 * (8 * h + j))
    lo = zor(zand(q, m15), zand(_fifth_bit(hq, 2 * c), m48))
    hi = zor(zand(zsrl16(q, 4), m15), zand(_fifth_bit(hq, 2 * c + 4), m48))
    return lo, hi


@kernel(inline="always")
def _k6_offset(p, o, sums, n, b):
    """Sum over groups of the rows' scales times the activations' sums (the -32 of every quant)."""
    osum = zzero()
    for grp in range(16):
        osum = zadd32(osum, zmul32(zs8x16(p, o + 32 + 16 * grp), zset32(sums[n, 16 * b + grp])))
    return zsll32(osum, 5)


@kernel(_nrt=False)
def _rows_r16_q6_k(p, qs, d, sums, out, g0, g1, n0, n1):
    k = qs.shape[1]
    m = out.shape[1]
    size = 3360
    m15 = zset8(15)
    m48 = zset8(48)
    for g in range(g0, g1):
        for n in range(n0, n1):
            acc = zzero()
            for b in range(k // 256):
                o = g * p.strides[0] + size * b  # no software prefetch, as in _rows_r16
                x = n * k + 256 * b
                isum = zzero()
                for h in range(2):
                    for c in range(2):
                        for jj in range(0, 8, 4):  # one scale per 16 elements: 4 lane vectors
                            t_lo = zzero()
                            t_hi = zzero()
                            for j in range(jj, jj + 4):
                                lo, hi = _k6_values(p, o, h, c, j, m15, m48)
                                at = x + 128 * h + 32 * c + 4 * j
                                t_lo = zdp(t_lo, lo, zbcast32(qs, at))
                                t_hi = zdp(t_hi, hi, zbcast32(qs, at + 64))
                            grp = 8 * h + 2 * c + jj // 4
                            isum = zadd32(isum, zadd32(zmul32(t_lo, zs8x16(p, o + 32 + 16 * grp)),
                                                       zmul32(t_hi, zs8x16(p, o + 32 + 16 * (grp + 4)))))
                acc = _scaled(zf16x16(p, o), d, n, b, zsub32(isum, _k6_offset(p, o, sums, n, b)), acc)
            _r16_store(out, n, g, m, acc)


@kernel(_nrt=False)
def _rows_r16_x4_q6_k(p, qs, d, sums, out, g0, g1, n0, n1):
    """Q6_K, four activation rows at a time, as `_rows_r16_q6_k` computes each row."""
    k = qs.shape[1]
    m = out.shape[1]
    size = 3360
    m15 = zset8(15)
    m48 = zset8(48)
    for g in range(g0, g1):
        _prefetch_rows(p, g + 1, g + 2)
        for n in range(n0, n1, TOKENS):
            acc0 = zzero()
            acc1 = zzero()
            acc2 = zzero()
            acc3 = zzero()
            for b in range(k // 256):
                o = g * p.strides[0] + size * b
                x = n * k + 256 * b
                i0 = zzero()
                i1 = zzero()
                i2 = zzero()
                i3 = zzero()
                for h in range(2):
                    for c in range(2):
                        for jj in range(0, 8, 4):
                            lo0 = zzero()
                            hi0 = zzero()
                            lo1 = zzero()
                            hi1 = zzero()
                            lo2 = zzero()
                            hi2 = zzero()
                            lo3 = zzero()
                            hi3 = zzero()
                            for j in range(jj, jj + 4):
                                lo, hi = _k6_values(p, o, h, c, j, m15, m48)
                                at = x + 128 * h + 32 * c + 4 * j
                                lo0 = zdp(lo0, lo, zbcast32(qs, at))
                                hi0 = zdp(hi0, hi, zbcast32(qs, at + 64))
                                lo1 = zdp(lo1, lo, zbcast32(qs, at + k))
                                hi1 = zdp(hi1, hi, zbcast32(qs, at + k + 64))
                                lo2 = zdp(lo2, lo, zbcast32(qs, at + 2 * k))
                                hi2 = zdp(hi2, hi, zbcast32(qs, at + 2 * k + 64))
                                lo3 = zdp(lo3, lo, zbcast32(qs, at + 3 * k))
                                hi3 = zdp(hi3, hi, zbcast32(qs, at + 3 * k + 64))
                            grp = 8 * h + 2 * c + jj // 4
                            sc_lo = zs8x16(p, o + 32 + 16 * grp)
                            sc_hi = zs8x16(p, o + 32 + 16 * (grp + 4))
                            i0 = zadd32(i0, zadd32(zmul32(lo0, sc_lo), zmul32(hi0, sc_hi)))
                            i1 = zadd32(i1, zadd32(zmul32(lo1, sc_lo), zmul32(hi1, sc_hi)))
                            i2 = zadd32(i2, zadd32(zmul32(lo2, sc_lo), zmul32(hi2, sc_hi)))
                            i3 = zadd32(i3, zadd32(zmul32(lo3, sc_lo), zmul32(hi3, sc_hi)))
                wd = zf16x16(p, o)
                acc0 = _scaled(wd, d, n, b, zsub32(i0, _k6_offset(p, o, sums, n, b)), acc0)
                acc1 = _scaled(wd, d, n + 1, b, zsub32(i1, _k6_offset(p, o, sums, n + 1, b)), acc1)
                acc2 = _scaled(wd, d, n + 2, b, zsub32(i2, _k6_offset(p, o, sums, n + 2, b)), acc2)
                acc3 = _scaled(wd, d, n + 3, b, zsub32(i3, _k6_offset(p, o, sums, n + 3, b)), acc3)
            _r16_store(out, n, g, m, acc0)
            _r16_store(out, n + 1, g, m, acc1)
            _r16_store(out, n + 2, g, m, acc2)
            _r16_store(out, n + 3, g, m, acc3)


@kernel(_nrt=False)
def _rows_r16_any(code, p, qs, d, s, sums, out, g0, g1, n0, n1):
    """Groups g0..g1 of an r16 weight against activation rows n0..n1: four at a time, the last
    (n1 - n0) % 4 one at a time."""
    n4 = n0 + (n1 - n0) // TOKENS * TOKENS
    if n4 > n0:
        if code == Q4_K or code == Q5_K:
            _rows_r16_x4_q45_k(code == Q5_K, p, qs, d, sums, out, g0, g1, n0, n4)
        elif code == Q6_K:
            _rows_r16_x4_q6_k(p, qs, d, sums, out, g0, g1, n0, n4)
        else:
            _rows_r16_x4(code, p, qs, d, s, sums, out, g0, g1, n0, n4)
    if n1 > n4:
        if code == Q4_K or code == Q5_K:
            _rows_r16_q45_k(code == Q5_K, p, qs, d, sums, out, g0, g1, n4, n1)
        elif code == Q6_K:
            _rows_r16_q6_k(p, qs, d, sums, out, g0, g1, n4, n1)
        else:
            _rows_r16(code, p, qs, d, s, sums, out, g0, g1, n4, n1)


# ---------------------------------------------------------------------------------------------
# Products (avx2_r8.py's drivers, on r16): one to MAX_PARTS weights with one input, and a gated
# feed-forward's two products with their GLU
# ---------------------------------------------------------------------------------------------

@kernel(_nrt=False)
def _r16_parts(codes, packs, n_parts, qs, d, s, sums, outs, g0, g1):
    """Groups g0..g1 of the first n_parts weights, part i's groups following part i - 1's, against
    every activation row: part i's rows go to outs[i]."""
    base = 0
    for i in range(n_parts):
        p = packs[i]
        lo = max(g0 - base, 0)
        hi = min(g1 - base, p.shape[0])
        if lo < hi:
            _prefetch_rows(p, lo, lo + PF_GROUPS)
            _rows_r16_any(codes[i], p, qs, d, s, sums, outs[i], lo, hi, 0, qs.shape[0])
        base += p.shape[0]


@kernel(inline="always")
def _groups(packs, n_parts):
    total = 0
    for i in range(n_parts):
        total += packs[i].shape[0]
    return total


@kernel
def mul_mat_r16(codes, act, packs, n_parts, x, qs, d, s, sums, outs):
    """outs[i] = x @ w_i^T for the r16 weights packs[i] of types codes[i], i < n_parts (MAX_PARTS
    slots each), x quantized once to the `act` blocks they all read."""
    _prefetch_rows(packs[0], 0, PF_GROUPS)  # the first rows arrive while x is quantized
    quantize_rows_avx512(act, x, qs, d, s, sums)
    _r16_parts(codes, packs, n_parts, qs, d, s, sums, outs, 0, _groups(packs, n_parts))


@kernel(parallel=True)
def mul_mat_r16_par(codes, act, packs, n_parts, x, qs, d, s, sums, outs, n_chunks):
    quantize_rows_avx512(act, x, qs, d, s, sums)
    total = _groups(packs, n_parts)
    step = (total + n_chunks - 1) // n_chunks
    for c in prange(n_chunks):
        _r16_parts(codes, packs, n_parts, qs, d, s, sums, outs, c * step, min(total, (c + 1) * step))


@kernel(_nrt=False)
def _r16_glu_groups(codes, pg, pu, kind, table, qs, d, s, sums, out, tile, g0, g1, step):
    """Groups g0..g1 of the r16 gate pg and up pu, `step` groups at a time: the gate's rows into out,
    the up's into tile (f32, at least N * 16 * step), then out = glu(gate, up) over those rows."""
    n = qs.shape[0]
    m = out.shape[1]
    for a in range(g0, g1, step):
        b = min(a + step, g1)
        r0, r1 = R16 * a, min(R16 * b, m)
        _rows_r16_any(codes[0], pg, qs, d, s, sums, out, a, b, 0, n)
        up = tile[:n * (r1 - r0)].reshape((n, r1 - r0))
        _rows_r16_any(codes[1], pu[a:b], qs, d, s, sums, up, 0, b - a, 0, n)
        glu_span(kind, table, out, up, r0, r1)


@kernel
def mul_mat_glu_r16(codes, act, pg, pu, kind, table, x, qs, d, s, sums, out, tiles, step):
    """out = glu(x @ gate^T, x @ up^T) for r16 weights pg and pu of types codes[0], codes[1] that
    read the same `act` blocks: x quantized once, tiles[0] holding the up's rows of each step."""
    _prefetch_rows(pg, 0, PF_GROUPS)
    quantize_rows_avx512(act, x, qs, d, s, sums)
    _r16_glu_groups(codes, pg, pu, kind, table, qs, d, s, sums, out, tiles[0], 0, pg.shape[0], step)


@kernel(parallel=True)
def mul_mat_glu_r16_par(codes, act, pg, pu, kind, table, x, qs, d, s, sums, out, tiles, step, n_chunks):
    quantize_rows_avx512(act, x, qs, d, s, sums)
    total = pg.shape[0]
    per = (total + n_chunks - 1) // n_chunks
    for c in prange(n_chunks):
        _r16_glu_groups(codes, pg, pu, kind, table, qs, d, s, sums, out, tiles[c], c * per,
                        min(total, (c + 1) * per), step)


@kernel(parallel=True)
def mul_mat_id_r16(code, p, groups, ids, per_slot, route, xq, gq, og, out, n_chunks):
    """mul_mat_id against experts repacked as one r16 weight p, `groups` groups an expert (routing.py): the pairs'
    quantized rows xq grouped by expert into gq, each chosen expert's groups split over n_chunks, the results og
    put back into out [pairs, M]."""
    group_rows(ids, per_slot, route, xq, gq)
    step = chunk_step(groups, n_chunks, 1)
    for i in prange(n_tasks(route, n_chunks)):
        e, a, b, g0, g1 = task(route, groups, n_chunks, step, i)
        _rows_r16_any(code, p[e * groups:(e + 1) * groups], gq[0], gq[1], gq[2], gq[3], og, g0, g1, a, b)
    scatter_rows(og, route, out)
