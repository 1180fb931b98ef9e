"""Compiled element-wise and data-movement kernels: the gated feed-forward activations (swiglu,
geglu with ggml's f16 GELU table), add, mul, scale, soft-capping, softmax rows, f32/f16 row gathers
(get_rows), KV cache row writes (set_rows; Q8_0 and Q4_0 caches through kv_quant) and strided
copies (cont).

Binders take only the layouts they were written for (contiguous f32 rows, mostly) and return
None otherwise, so the reference kernel runs; element-wise kernels are written to be right when
`out` aliases the first source (in-place).
"""
from __future__ import annotations

import numpy as np

from ggrun.core.backends.cpu.dispatch import binds
from ggrun.core.backends.cpu.jit import kernel
from ggrun.core.backends.cpu.kv_quant import CACHE_TYPES, code_of, hadamard, store_row
from ggrun.core.backends.cpu.vecmath import as_f32, expf, f16_to_f32, f32_to_f16, gelu, gelu_f16_table, gelu_table, silu
from ggrun.core.backends.cpu.warmup import kv, readonly, rows, warms
from ggrun.core.dtypes import DType


@kernel
def swiglu_flat(g, u, out):
    for i in range(g.shape[0]):
        out[i] = silu(g[i]) * u[i]


@kernel
def swiglu_oai_flat(g, u, alpha, limit, out):
    """gpt-oss's gated unit as ggml's CPU computes it: x = min(gate, limit), x / (1 + e^(-alpha x)) times
    (clamp(up, -limit, limit) + 1)."""
    one = np.float32(1.0)
    for i in range(g.shape[0]):
        x = min(g[i], limit)
        y = min(max(u[i], -limit), limit)
        out[i] = x / (one + expf(-alpha * x)) * (y + one)


@kernel
def geglu_table_flat(g, u, table, out):
    for i in range(g.shape[0]):
        out[i] = gelu_table(g[i], table) * u[i]


@kernel
def geglu_flat(g, u, out):
    for i in range(g.shape[0]):
        out[i] = gelu(g[i]) * u[i]


@kernel
def gelu_table_flat(a, table, out):
    for i in range(a.shape[0]):
        out[i] = gelu_table(a[i], table)


@kernel
def silu_flat(a, out):
    for i in range(a.shape[0]):
        out[i] = silu(a[i])


@kernel
def scale_flat(a, s, out):
    for i in range(a.shape[0]):
        out[i] = a[i] * s


@kernel
def softcap_flat(a, cap, out):
    inv = np.float32(1.0) / cap
    for i in range(a.shape[0]):
        out[i] = np.float32(np.tanh(a[i] * inv)) * cap


@kernel
def add_rows(a, b, out):
    """out[r] = a[r] + b[r % len(b)] (b's rows repeat over a's)."""
    nb = b.shape[0]
    for r in range(a.shape[0]):
        br = b[r % nb]
        for i in range(a.shape[1]):
            out[r, i] = a[r, i] + br[i]


@kernel
def mul_rows(a, b, out):
    nb = b.shape[0]
    for r in range(a.shape[0]):
        br = b[r % nb]
        for i in range(a.shape[1]):
            out[r, i] = a[r, i] * br[i]


@kernel
def soft_max_rows(a, mask, use_mask, scale, sinks, out):
    """out[r] = softmax(a[r] * scale + mask[r % rows]) for rows r of [..., rows, cols] flattened;
    the mask is f16 bits or f32. With sinks (f32 [heads], gpt-oss's; empty: none) head h's rows count one
    more logit, sinks[h], in their maximum and sum, whose share is dropped."""
    rows = a.shape[0]
    n_mask = mask.shape[0] if use_mask else 1
    for r in range(rows):
        m = np.float32(-np.inf)
        mr = r % n_mask
        for i in range(a.shape[1]):
            v = a[r, i] * scale
            if use_mask:
                v += as_f32(mask[mr, i])
            out[r, i] = v
            m = max(m, v)
        sink = sinks[r // n_mask] if sinks.shape[0] else np.float32(-np.inf)
        m = max(m, sink)
        total = 0.0
        for i in range(a.shape[1]):
            e = expf(out[r, i] - m)
            out[r, i] = e
            total += e
        if sinks.shape[0]:
            total += expf(sink - m)
        inv = np.float32(1.0 / total)
        for i in range(a.shape[1]):
            out[r, i] *= inv


@kernel
def gather_f32(a, ids, out):
    for r in range(ids.shape[0]):
        if ids[r] < 0 or ids[r] >= a.shape[0]:
            raise IndexError("get_rows: row id out of range")
        src = a[ids[r]]
        for i in range(a.shape[1]):
            out[r, i] = src[i]


@kernel
def gather_f16(a, ids, out):
    for r in range(ids.shape[0]):
        if ids[r] < 0 or ids[r] >= a.shape[0]:
            raise IndexError("get_rows: row id out of range")
        src = a[ids[r]]
        for i in range(a.shape[1]):
            out[r, i] = f16_to_f32(src[i])


@kernel
def scatter_f16(rows, idx, dst):
    """dst[idx[r]] = rows[r] rounded to f16 (bits)."""
    for r in range(rows.shape[0]):
        if idx[r] < 0 or idx[r] >= dst.shape[0]:
            raise IndexError("set_rows: row index out of range")
        d = dst[idx[r]]
        for i in range(rows.shape[1]):
            d[i] = f32_to_f16(rows[r, i])


@kernel
def scatter_f32(rows, idx, dst):
    for r in range(rows.shape[0]):
        if idx[r] < 0 or idx[r] >= dst.shape[0]:
            raise IndexError("set_rows: row index out of range")
        d = dst[idx[r]]
        for i in range(rows.shape[1]):
            d[i] = rows[r, i]


@kernel
def scatter_blocks(rows, idx, code, rot, dst):
    """dst[idx[r]] = rows[r] as a block-quantized cache stores it (bytes of type `code`), turned
    first by the cache's Walsh-Hadamard rotation of size rot (0: none)."""
    row = np.empty(rows.shape[1], dtype=np.float32)
    for r in range(rows.shape[0]):
        if idx[r] < 0 or idx[r] >= dst.shape[0]:
            raise IndexError("set_rows: row index out of range")
        for i in range(rows.shape[1]):
            row[i] = rows[r, i]
        if rot:
            hadamard(row, rot)
        store_row(code, row, dst[idx[r]])


@kernel
def copy4(a, out):
    """out = a for 4-d arrays of any strides (a contiguous copy of a view)."""
    for i in range(a.shape[0]):
        for j in range(a.shape[1]):
            for k in range(a.shape[2]):
                for m in range(a.shape[3]):
                    out[i, j, k, m] = a[i, j, k, m]


# ---- binders ----------------------------------------------------------------------------------

def _flat_f32(node, arrays: list, srcs_f32: int) -> list | None:
    """The arrays as flat f32 vectors when all are contiguous f32 of one size and the first
    `srcs_f32` sources are stored as f32."""
    if any(node.srcs[i].dtype is not DType.F32 for i in range(srcs_f32)):
        return None
    n = arrays[0].size
    if any(a.dtype != np.float32 or not a.flags.c_contiguous or a.size != n for a in arrays):
        return None
    return [a.reshape(-1) for a in arrays]


_GELU_TABLE: list[np.ndarray] = []


def f16_gelu_table() -> np.ndarray:
    """ggml's f16 GELU table (vecmath.gelu_f16_table), made once per process."""
    if not _GELU_TABLE:
        _GELU_TABLE.append(gelu_f16_table())
    return _GELU_TABLE[0]


@binds("swiglu")
def bind_swiglu(node, out, srcs, scratch):
    flat = _flat_f32(node, [srcs[0], srcs[1], out], 2)
    if flat is None:
        return None
    g, u, o = flat
    return lambda: swiglu_flat(g, u, o)


@binds("swiglu_oai")
def bind_swiglu_oai(node, out, srcs, scratch):
    flat = _flat_f32(node, [srcs[0], srcs[1], out], 2)
    if flat is None:
        return None
    g, u, o = flat
    alpha, limit = np.float32(node.params["alpha"]), np.float32(node.params["limit"])
    return lambda: swiglu_oai_flat(g, u, alpha, limit, o)


@binds("geglu")
def bind_geglu(node, out, srcs, scratch):
    flat = _flat_f32(node, [srcs[0], srcs[1], out], 2)
    if flat is None:
        return None
    g, u, o = flat
    if node.params.get("f16_table"):
        table = f16_gelu_table()
        return lambda: geglu_table_flat(g, u, table, o)
    return lambda: geglu_flat(g, u, o)


@binds("gelu")
def bind_gelu(node, out, srcs, scratch):
    flat = _flat_f32(node, [srcs[0], out], 1)
    if flat is None or not node.params.get("f16_table"):
        return None
    a, o = flat
    table = f16_gelu_table()
    return lambda: gelu_table_flat(a, table, o)


@binds("silu")
def bind_silu(node, out, srcs, scratch):
    flat = _flat_f32(node, [srcs[0], out], 1)
    if flat is None:
        return None
    a, o = flat
    return lambda: silu_flat(a, o)


@binds("scale")
def bind_scale(node, out, srcs, scratch):
    return _bind_with_param(scale_flat, "s", node, out, srcs)


@binds("softcap")
def bind_softcap(node, out, srcs, scratch):
    return _bind_with_param(softcap_flat, "cap", node, out, srcs)


def _bind_with_param(fn, key: str, node, out, srcs):
    """fn(a, value, out) over flat f32 views, value the node's f32 parameter `key` (scale's s, softcap's cap)."""
    flat = _flat_f32(node, [srcs[0], out], 1)
    if flat is None:
        return None
    a, o = flat
    value = np.float32(node.params[key])
    return lambda: fn(a, value, o)


def _bind_binary(fn, node, out, srcs):
    """a op b for contiguous f32 operands where b is a's shape or a trailing part of it (repeated)."""
    a, b = srcs
    if any(s.dtype is not DType.F32 for s in node.srcs) or not all(x.flags.c_contiguous for x in (a, b, out)):
        return None
    bshape = tuple(b.shape)
    while bshape and bshape[0] == 1:
        bshape = bshape[1:]
    if b.size != 1 and bshape != tuple(node.shape[len(node.shape) - len(bshape):]):
        return None
    n = b.size
    a2, b2, o2 = a.reshape(-1, n), b.reshape(1, n), out.reshape(-1, n)
    return lambda: fn(a2, b2, o2)


@binds("add")
def bind_add(node, out, srcs, scratch):
    return _bind_binary(add_rows, node, out, srcs)


@binds("mul")
def bind_mul(node, out, srcs, scratch):
    return _bind_binary(mul_rows, node, out, srcs)


@binds("soft_max")
def bind_soft_max(node, out, srcs, scratch):
    a = srcs[0]
    if node.srcs[0].dtype is not DType.F32 or not (a.flags.c_contiguous and out.flags.c_contiguous):
        return None
    cols = node.shape[-1]
    rows_per_head = node.shape[-2] if len(node.shape) > 1 else 1
    a2, o2 = a.reshape(-1, cols), out.reshape(-1, cols)
    use_mask = len(srcs) > 1
    if use_mask:
        mdt = node.srcs[1].dtype
        mask = srcs[1][:rows_per_head]
        if mdt not in (DType.F16, DType.F32) or mask.strides[-1] != mask.itemsize:
            return None
        if mdt is DType.F16:
            mask = mask.view(np.uint16)
    else:
        mask = np.zeros((1, cols), dtype=np.float32)
    scale = np.float32(node.params["scale"])
    sinks = srcs[2] if node.params.get("sinks") else _NO_SINKS
    if sinks.dtype != np.float32 or not sinks.flags.c_contiguous:
        return None
    return lambda: soft_max_rows(a2, mask, use_mask, scale, sinks, o2)


_NO_SINKS = np.zeros(0, np.float32)


@binds("get_rows")
def bind_get_rows(node, out, srcs, scratch):
    a, ids = srcs
    dtype = node.srcs[0].dtype
    if dtype not in (DType.F32, DType.F16) or a.strides[-1] != a.itemsize or not out.flags.c_contiguous:
        return None
    if dtype is DType.F16:
        a16 = a.view(np.uint16)
        return lambda: gather_f16(a16, ids, out)
    return lambda: gather_f32(a, ids, out)


@binds("set_rows")
def bind_set_rows(node, out, srcs, scratch):
    _, rows, idx = srcs
    if node.srcs[1].dtype is not DType.F32 or rows.strides[-1] != 4 or out.strides[-1] != out.itemsize:
        return None
    if node.dtype is DType.F16:
        dst = out.view(np.uint16)
        return lambda: scatter_f16(rows, idx, dst)
    if node.dtype is DType.F32:
        return lambda: scatter_f32(rows, idx, out)
    if node.dtype.is_quantized and node.dtype in CACHE_TYPES and out.flags.c_contiguous:
        code, rot = code_of(node.dtype), int(node.srcs[0].root.params.get("hadamard", 0))
        return lambda: scatter_blocks(rows, idx, code, rot, out)
    return None


def _as4(a: np.ndarray) -> np.ndarray:
    return a.reshape((1,) * (4 - a.ndim) + a.shape) if a.ndim < 4 else a


@binds("cont")
def bind_cont(node, out, srcs, scratch):
    a = srcs[0]
    if a.ndim > 4 or not out.flags.c_contiguous or a.dtype != out.dtype or a.dtype.kind not in "fiu":
        return None
    if a.dtype == np.float16:
        a, out = a.view(np.uint16), out.view(np.uint16)
    a4, o4 = _as4(a), _as4(out)
    return lambda: copy4(a4, o4)


# ---- first-run compilation: the signatures a model's graphs meet ---------------------------------

def _f16_input(lf, name: str, data: np.ndarray):
    from ggrun.core.tensor import new_tensor

    t = new_tensor(name, DType.F16, data.shape, is_input=True)
    lf.feeds[t] = data.astype(np.float16)
    return t


@warms
def _warm_ffn(lf):
    from ggrun.core import ops

    g, u = lf.input("g", np.ones((2, 32), np.float32)), lf.input("u", np.ones((2, 32), np.float32))
    x = ops.scale(ops.swiglu(g, u), 2.0)
    x = ops.add(ops.geglu(x, u, f16_table=True), ops.geglu(x, u, f16_table=False))
    x = ops.add(x, readonly(lf, "bias", DType.F32, np.ones(32, np.float32)))  # a file's bias (qwen2, gpt-oss)
    return ops.mul(ops.silu(ops.gelu(ops.cont(ops.softcap(x, 30.0)), f16_table=True)), u)  # gemma2's soft-cap


@warms
def _warm_attention_parts(lf):
    """The non-fused attention's softmax and head merge, the V cache write, output-row selection."""
    from ggrun.core import ops

    kq = lf.input("kq", np.ones((2, 3, 8), np.float32))
    probs = ops.soft_max(kq, _f16_input(lf, "mask", np.zeros((3, 8), np.float32)), 0.5)
    merged = ops.cont(ops.permute(probs, (1, 0, 2)))
    rows = ops.get_rows(ops.reshape(merged, (3, 16)), lf.input("ids", np.array([0, 2], np.int32)))
    caches = []
    for dtype in (DType.F16, DType.F32):
        cache = lf.ctx.new_tensor(f"cache_{dtype}", dtype, (4, 16))
        lf.ctx.backend.set_tensor(cache, np.zeros((4, 16), dtype.np_dtype))
        caches.append(ops.set_rows(cache, rows, lf.input("idx", np.array([1, 3], np.int32))))
    return ops.add(ops.cast(caches[0], DType.F32), caches[1])


@warms(needs={kv(DType.Q8_0)})
def _warm_block_cache_write(lf):
    """The V cache write into a quantized cache (one signature serves Q8_0 and Q4_0)."""
    from ggrun.core import ops

    cache = lf.ctx.new_tensor("cache", DType.Q4_0, (4, 64))
    lf.ctx.backend.set_tensor(cache, np.zeros((4, DType.Q4_0.row_bytes(64)), np.uint8))
    rows = ops.scale(lf.input("rows", np.ones((2, 64), np.float32)), 1.0)
    return ops.set_rows(cache, rows, lf.input("idx", np.array([1, 3], np.int32)))


def _warm_embedding(lf, dtype: DType):
    """Embedding rows of a plain-typed weight, read-only as a memory map gives it."""
    from ggrun.core import ops

    table = readonly(lf, "table", dtype, np.ones((4, 16), dtype.np_dtype))
    return ops.get_rows(table, lf.input("ids", np.array([0, 3], np.int32)))


for _dtype in (DType.F16, DType.F32):
    warms(lambda lf, d=_dtype: _warm_embedding(lf, d), needs={rows(_dtype)})
