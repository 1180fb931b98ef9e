"""The small LLVM vector language the AVX2 kernels are written in: a 256-bit vector type (`vec`) and a
handful of intrinsics on it (loads that widen packed quants, maddubs/madd, f32 fma, horizontal sums,
stores), each a numba intrinsic whose body is a few LLVM instructions; plus the builder helpers
(_addr, _llvm_call, _splat, _as) the AVX-512 vocabulary (avx512.py) is built from as well.

Compiled only where SIMD is "avx2" or above (an x86 intrinsic on a CPU without it stops LLVM, so nothing
else calls these). Listed in jit.SHARED_SOURCES: the kernels of the other files compile these in.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model

from ggrun.core.backends.cpu.jit import kernel
from ggrun.core.backends.cpu.quant.codes import _I16, _I32, _I64, _I8


class _VecType(types.Type):
    def __init__(self) -> None:
        super().__init__(name="vec256")


vec = _VecType()
_V = ir.VectorType(_I64, 4)
_B32 = ir.VectorType(_I8, 32)
_W16 = ir.VectorType(_I16, 16)
_D8 = ir.VectorType(_I32, 8)
_F8 = ir.VectorType(ir.FloatType(), 8)


@register_model(_VecType)
class _VecModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type) -> None:
        super().__init__(dmm, fe_type, _V)


def _addr(context, builder, aryty, ary, off, ptr_type):
    """ptr_type pointer to byte `off` of an array's data."""
    data = context.make_array(aryty)(context, builder, ary).data
    p = builder.gep(builder.bitcast(data, _I8.as_pointer()), [off])
    return builder.bitcast(p, ptr_type.as_pointer())


def _llvm_call(builder, name, ret, args):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, args)


def _splat(builder, value, vtype):
    v = builder.insert_element(ir.Constant(vtype, None), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vtype, None), ir.Constant(ir.VectorType(_I32, vtype.count), [0] * vtype.count))


def _as(builder, v, vtype):
    return builder.bitcast(v, vtype)


def _vec_op(n_args, body, arg_types=None):
    """An intrinsic (vec, ...) -> vec of n_args arguments whose LLVM body is body(builder, *args)."""
    sig = vec(*(arg_types or (vec,) * n_args))

    def codegen(context, builder, signature, llargs):
        return body(builder, *llargs)
    # numba reads an intrinsic's arity from its typing function, so each arity has its own
    typing = {
        0: lambda typingctx: (sig, codegen),
        1: lambda typingctx, a: (sig, codegen),
        2: lambda typingctx, a, b: (sig, codegen),
        3: lambda typingctx, a, b, c: (sig, codegen),
    }[n_args]
    return intrinsic(typing)


vand = _vec_op(2, lambda b, x, y: b.and_(x, y))
vor = _vec_op(2, lambda b, x, y: b.or_(x, y))
vadd32 = _vec_op(2, lambda b, x, y: _as(b, b.add(_as(b, x, _D8), _as(b, y, _D8)), _V))
vsub32 = _vec_op(2, lambda b, x, y: _as(b, b.sub(_as(b, x, _D8), _as(b, y, _D8)), _V))
vmaddubs = _vec_op(2, lambda b, u, s: _as(b, _llvm_call(b, "llvm.x86.avx2.pmadd.ub.sw", _W16,
                                                         [_as(b, u, _B32), _as(b, s, _B32)]), _V))
vmadd = _vec_op(2, lambda b, x, y: _as(b, _llvm_call(b, "llvm.x86.avx2.pmadd.wd", _D8,
                                                      [_as(b, x, _W16), _as(b, y, _W16)]), _V))
vsign8 = _vec_op(2, lambda b, x, y: _as(b, _llvm_call(b, "llvm.x86.avx2.psign.b", _B32,
                                                       [_as(b, x, _B32), _as(b, y, _B32)]), _V))
vabs8 = _vec_op(1, lambda b, x: _as(b, _llvm_call(b, "llvm.abs.v32i8", _B32,
                                                  [_as(b, x, _B32), ir.Constant(ir.IntType(1), 0)]), _V))
vcvt = _vec_op(1, lambda b, x: _as(b, b.sitofp(_as(b, x, _D8), _F8), _V))
vfma = _vec_op(3, lambda b, x, y, z: _as(b, _llvm_call(b, "llvm.fma.v8f32", _F8,
                                                       [_as(b, x, _F8), _as(b, y, _F8), _as(b, z, _F8)]), _V))
vsubf = _vec_op(2, lambda b, x, y: _as(b, b.fsub(_as(b, x, _F8), _as(b, y, _F8)), _V))
vaddf = _vec_op(2, lambda b, x, y: _as(b, b.fadd(_as(b, x, _F8), _as(b, y, _F8)), _V))
vsrl16 = _vec_op(2, lambda b, x, n: _as(b, b.lshr(_as(b, x, _W16), _splat(b, b.trunc(n, _I16), _W16)), _V),
                 (vec, types.int64))
vsll16 = _vec_op(2, lambda b, x, n: _as(b, b.shl(_as(b, x, _W16), _splat(b, b.trunc(n, _I16), _W16)), _V),
                 (vec, types.int64))
vset8 = _vec_op(1, lambda b, x: _as(b, _splat(b, b.trunc(x, _I8), _B32), _V), (types.int64,))
vset32 = _vec_op(1, lambda b, x: _as(b, _splat(b, b.trunc(x, _I32), _D8), _V), (types.int64,))
vsetf = _vec_op(1, lambda b, x: _as(b, _splat(b, x, _F8), _V), (types.float32,))
vzero = _vec_op(0, lambda b: ir.Constant(_V, [0, 0, 0, 0]))
vsll32 = _vec_op(2, lambda b, x, n: _as(b, b.shl(_as(b, x, _D8), _splat(b, b.trunc(n, _I32), _D8)), _V),
                 (vec, types.int64))
vadd16 = _vec_op(2, lambda b, x, y: _as(b, b.add(_as(b, x, _W16), _as(b, y, _W16)), _V))
vmulf = _vec_op(2, lambda b, x, y: _as(b, b.fmul(_as(b, x, _F8), _as(b, y, _F8)), _V))
# bytes of a table (both 128-bit halves alike) picked by the low four bits of each index byte (vpshufb)
vlut16 = _vec_op(2, lambda b, table, idx: _as(b, _llvm_call(b, "llvm.x86.avx2.pshuf.b", _B32,
                                                            [_as(b, table, _B32), _as(b, idx, _B32)]), _V))


def vtable16(values) -> object:
    """A vector constant of 16 signed byte values in both 128-bit halves (vlut16's table), as an intrinsic of
    no arguments."""
    table = [int(v) & 0xFF for v in values]
    if len(table) != 16:
        raise ValueError("a vlut16 table holds 16 values")
    return _vec_op(0, lambda b: _as(b, ir.Constant(_B32, table + table), _V))


def _lane0(b, x):
    return _as(b, b.insert_element(ir.Constant(_D8, [0] * 8), b.trunc(x, _I32), ir.Constant(_I32, 0)), _V)


vlane0 = _vec_op(1, _lane0, (types.int64,))  # x in 32-bit lane 0, zeros elsewhere


def _set16x2(b, x, y):
    lo = _splat(b, b.trunc(x, _I16), ir.VectorType(_I16, 8))
    hi = _splat(b, b.trunc(y, _I16), ir.VectorType(_I16, 8))
    return _as(b, b.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_I32, 16), list(range(16)))), _V)


vset16x2 = _vec_op(2, _set16x2, (types.int64, types.int64))  # 16-bit lanes 0..7 = x, 8..15 = y


def _load_op(body):
    """An intrinsic (array, byte offset) -> value whose body reads from that address."""
    @intrinsic
    def load(typingctx, ary, off):
        ret, fn = body

        def codegen(context, builder, signature, args):
            return fn(builder, context, signature.args[0], args[0], args[1])
        return ret(ary, types.intp), codegen
    return load


def _vload(b, ctx, aryty, ary, off):
    return b.load(_addr(ctx, b, aryty, ary, off, _V), align=1)


def _vnib(b, ctx, aryty, ary, off):
    # 16 bytes of nibble pairs -> 32 bytes: the low nibbles, then the high ones (ggml's order)
    x = b.load(_addr(ctx, b, aryty, ary, off, ir.VectorType(_I8, 16)), align=1)
    lo = b.and_(x, ir.Constant(ir.VectorType(_I8, 16), [15] * 16))
    hi = b.lshr(x, ir.Constant(ir.VectorType(_I8, 16), [4] * 16))
    return _as(b, b.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_I32, 32), list(range(32)))), _V)


def _vbits(b, ctx, aryty, ary, off):
    # 4 bytes, little-endian bit j -> byte j = 0xFF if set else 0 (Q5's fifth bits)
    x = b.load(_addr(ctx, b, aryty, ary, off, _I32), align=1)
    bytes4 = _as(b, _splat(b, x, _D8), _B32)
    spread = b.shuffle_vector(bytes4, ir.Constant(_B32, None),
                              ir.Constant(ir.VectorType(_I32, 32), [j // 8 for j in range(32)]))
    bit = b.and_(spread, ir.Constant(_B32, [1 << (j % 8) for j in range(32)]))
    return _as(b, b.sext(b.icmp_unsigned("!=", bit, ir.Constant(_B32, [0] * 32)), _B32), _V)


def _vf16x8(b, ctx, aryty, ary, off):
    h = b.load(_addr(ctx, b, aryty, ary, off, ir.VectorType(ir.HalfType(), 8)), align=1)
    return _as(b, b.fpext(h, _F8), _V)


def _vbf16x8(b, ctx, aryty, ary, off):
    h = b.load(_addr(ctx, b, aryty, ary, off, ir.VectorType(_I16, 8)), align=1)
    return _as(b, b.shl(b.zext(h, _D8), ir.Constant(_D8, [16] * 8)), _V)


def _vf32x8(b, ctx, aryty, ary, off):
    return _as(b, b.load(_addr(ctx, b, aryty, ary, off, _F8), align=1), _V)


def _sf16(b, ctx, aryty, ary, off):
    return b.fpext(b.load(_addr(ctx, b, aryty, ary, off, ir.HalfType()), align=1), ir.FloatType())


def _su8(b, ctx, aryty, ary, off):
    return b.load(_addr(ctx, b, aryty, ary, off, _I8), align=1)


def _su16(b, ctx, aryty, ary, off):
    return b.load(_addr(ctx, b, aryty, ary, off, _I16), align=1)


def _vbcast32(b, ctx, aryty, ary, off):
    return _as(b, _splat(b, b.load(_addr(ctx, b, aryty, ary, off, _I32), align=1), _D8), _V)


def _bytes_to_lanes(signed, pair):
    """8 bytes -> one per 32-bit lane (zero- or sign-extended); `pair`: the 16-bit value in both
    halves of the lane (madd then scales both products of a pair), else in the low half only."""
    def load(b, ctx, aryty, ary, off):
        x = b.load(_addr(ctx, b, aryty, ary, off, ir.VectorType(_I8, 8)), align=1)
        v = b.sext(x, _D8) if signed else b.zext(x, _D8)
        v = b.and_(v, ir.Constant(_D8, [0xFFFF] * 8))
        if pair:
            v = b.or_(v, b.shl(v, ir.Constant(_D8, [16] * 8)))
        return _as(b, v, _V)
    return load


vload = _load_op((vec, _vload))      # 32 bytes
vbcast32 = _load_op((vec, _vbcast32))  # 4 bytes repeated in every 32-bit lane
vu8pair = _load_op((vec, _bytes_to_lanes(False, True)))   # 8 unsigned bytes as (x, x) 16-bit pairs
vu8lo = _load_op((vec, _bytes_to_lanes(False, False)))    # 8 unsigned bytes as (x, 0)
vs8pair = _load_op((vec, _bytes_to_lanes(True, True)))    # 8 signed bytes as (x, x)
vs8lo = _load_op((vec, _bytes_to_lanes(True, False)))     # 8 signed bytes as (x, 0)
vnib = _load_op((vec, _vnib))        # 16 nibble-pair bytes as 32 values 0..15
vbits = _load_op((vec, _vbits))      # 32 bits as 32 bytes of 0 / 0xFF
vf16x8 = _load_op((vec, _vf16x8))    # 8 halves as 8 floats
vbf16x8 = _load_op((vec, _vbf16x8))  # 8 bfloat16 as 8 floats
vf32x8 = _load_op((vec, _vf32x8))    # 8 floats
sf16 = _load_op((types.float32, _sf16))  # one half as a float (F16C)
su8 = _load_op((types.uint8, _su8))      # one byte
su16 = _load_op((types.uint16, _su16))   # two bytes, little-endian


@intrinsic
def prefetch(typingctx, ary, off):
    """Hint that byte `off` of an array's data is read soon (into all cache levels)."""
    def codegen(context, builder, signature, args):
        p = _addr(context, builder, signature.args[0], args[0], args[1], _I8)
        i32 = lambda v: ir.Constant(_I32, v)  # noqa: E731
        _llvm_call(builder, "llvm.prefetch.p0", ir.VoidType(), [p, i32(0), i32(3), i32(1)])
        return context.get_dummy_value()
    return types.none(ary, types.intp), codegen


def _bytes_f32(part, signed):
    """Bytes 8 * part .. 8 * part + 7 of a vector as 8 floats."""
    def body(b, x):
        v = b.shuffle_vector(_as(b, x, _B32), ir.Constant(_B32, None),
                             ir.Constant(ir.VectorType(_I32, 8), list(range(8 * part, 8 * part + 8))))
        return _as(b, b.sitofp(b.sext(v, _D8) if signed else b.zext(v, _D8), _F8), _V)
    return _vec_op(1, body)


vu8f0, vu8f1, vu8f2, vu8f3 = (_bytes_f32(i, False) for i in range(4))
vs8f0, vs8f1, vs8f2, vs8f3 = (_bytes_f32(i, True) for i in range(4))


@intrinsic
def vabsmax4(typingctx, a, b, c, e):
    """The largest |value| among the 32 floats of four vectors."""
    def codegen(context, builder, signature, args):
        absf = lambda v: _llvm_call(builder, "llvm.fabs.v8f32", _F8, [_as(builder, v, _F8)])  # noqa: E731
        mx = lambda x, y: _llvm_call(builder, "llvm.x86.avx.max.ps.256", _F8, [x, y])  # noqa: E731
        m = mx(mx(absf(args[0]), absf(args[1])), mx(absf(args[2]), absf(args[3])))
        e8 = [builder.extract_element(m, ir.Constant(_I32, i)) for i in range(8)]
        best = e8[0]
        for v in e8[1:]:
            best = builder.select(builder.fcmp_ordered(">", v, best), v, best)
        return best
    return types.float32(vec, vec, vec, vec), codegen


vround32 = _vec_op(1, lambda b, x: _as(b, _llvm_call(b, "llvm.x86.avx.cvt.ps2dq.256", _D8, [_as(b, x, _F8)]), _V))


@intrinsic
def vhsum32(typingctx, x):
    """The sum of a vector's 8 int32 lanes."""
    def codegen(context, builder, signature, args):
        v = _as(builder, args[0], _D8)
        total = ir.Constant(_I64, 0)
        for i in range(8):
            total = builder.add(total, builder.sext(builder.extract_element(v, ir.Constant(_I32, i)), _I64))
        return total
    return types.int64(vec), codegen


@intrinsic
def vstore_i8x32(typingctx, ary, off, a, b, c, e):
    """Four vectors of 8 int32 (each within int8) stored as 32 int8 at byte `off`, in order."""
    def codegen(context, builder, signature, args):
        w = [_as(builder, v, _D8) for v in args[2:]]
        lo = _llvm_call(builder, "llvm.x86.avx2.packssdw", _W16, [w[0], w[1]])  # lanes: 0-3 8-11 | 4-7 12-15
        hi = _llvm_call(builder, "llvm.x86.avx2.packssdw", _W16, [w[2], w[3]])
        q = _llvm_call(builder, "llvm.x86.avx2.packsswb", _B32, [lo, hi])
        order = ir.Constant(_D8, [0, 4, 1, 5, 2, 6, 3, 7])
        q = _llvm_call(builder, "llvm.x86.avx2.permd", _D8, [_as(builder, q, _D8), order])
        builder.store(_as(builder, q, _B32), _addr(context, builder, signature.args[0], args[0], args[1], _B32), align=1)
        return context.get_dummy_value()
    return types.none(ary, types.intp, vec, vec, vec, vec), codegen


@intrinsic
def f16_round(typingctx, x):
    """x rounded to the nearest f16 value, ties to even (F16C), as float32."""
    def codegen(context, builder, signature, args):
        return builder.fpext(builder.fptrunc(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.float32), codegen


@intrinsic
def vlane(typingctx, x, i):
    """Float lane i of a vector."""
    def codegen(context, builder, signature, args):
        return builder.extract_element(_as(builder, args[0], _F8), builder.trunc(args[1], _I32))
    return types.float32(vec, types.intp), codegen


@intrinsic
def vstoref(typingctx, ary, off, x):
    """Store a vector's 8 floats at byte `off` of an array's data."""
    def codegen(context, builder, signature, args):
        builder.store(_as(builder, args[2], _F8), _addr(context, builder, signature.args[0], args[0], args[1], _F8),
                      align=1)
        return context.get_dummy_value()
    return types.none(ary, types.intp, vec), codegen


@intrinsic
def vhsum(typingctx, x):
    """The sum of a vector's 8 floats, pairwise."""
    def codegen(context, builder, signature, args):
        f = _as(builder, args[0], _F8)
        e = [builder.extract_element(f, ir.Constant(_I32, i)) for i in range(8)]
        return builder.fadd(builder.fadd(builder.fadd(e[0], e[4]), builder.fadd(e[1], e[5])),
                            builder.fadd(builder.fadd(e[2], e[6]), builder.fadd(e[3], e[7])))
    return types.float32(vec), codegen


@kernel(inline="always")
def vdot(u, s):
    """8 int32 lanes, each the sum of 4 products of unsigned bytes u and signed bytes s."""
    return vmadd(vmaddubs(u, s), vset16x2(1, 1))


# Helpers of the kernels that read four weight rows per pass (avx2.py's legacy types, lut4_avx2.py): each
# pass reads rows m..m+3 (the last pass repeats the last row where fewer than four remain).

@kernel(inline="always")
def four_rows(w, m, m1):
    """Byte offsets of the pass's four rows of w from row m (rows past m1 - 1 repeat it)."""
    rs = w.strides[0]
    return m * rs, min(m + 1, m1 - 1) * rs, min(m + 2, m1 - 1) * rs, min(m + 3, m1 - 1) * rs


@kernel(inline="always")
def store4(out, n, m, m1, v0, v1, v2, v3):
    """The pass's four results into out[n, m..m+3], those of repeated rows left out."""
    out[n, m] = v0
    if m + 1 < m1:
        out[n, m + 1] = v1
    if m + 2 < m1:
        out[n, m + 2] = v2
    if m + 3 < m1:
        out[n, m + 3] = v3


@kernel(inline="always")
def prefetch4(w, r0, r1, r2, r3, o):
    """Prefetch block offset o of the next four rows (the hardware prefetcher loses four streams)."""
    ahead = 4 * w.strides[0]
    prefetch(w, r0 + ahead + o)
    prefetch(w, r1 + ahead + o)
    prefetch(w, r2 + ahead + o)
    prefetch(w, r3 + ahead + o)


@kernel(inline="always")
def blk_fma(w, at, da, p, acc):
    """acc + f16 scale at w[at] * da * the block's integer lanes p."""
    return vfma(vsetf(sf16(w, at) * da), vcvt(p), acc)
