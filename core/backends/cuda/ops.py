"""Which CUDA kernel runs each node that is not a weight product: copies and casts, element-wise
ops and gated units, norms (fused with their weight and residual add), RoPE (YaRN's too; fused with
per-head norms, output scale, the cache write, a bias add before it), cache row writes (with a bias add
before them), softmax (with attention sinks),
fused attention. Each binder returns None
for a case its kernel does not cover, and the node then runs the shared array kernel."""
from __future__ import annotations

import math

import numpy as np

from ggrun.core.backends.bias_adds import row_bias
from ggrun.core.backends.cuda.binding import (NULL, Launch, binds, disjoint, estrides, f32, fuses, grid1d, i32, i64,
                                              launch_step, pad4, ptr, rows_of, threads_for, writes_apart)
from ggrun.core.backends.cuda.module import DECODE_DIMS, FA_EPL, GLU_ACTS, NO_WEIGHT, TC_DIMS, TYPE_IDS, kernel
from ggrun.core.backends.kernels import yarn_corr_dims
from ggrun.core.dtypes import DType
from ggrun.core.ops import ROPE_NEOX
from ggrun.core.tensor import Tensor

FLOAT_TYPES = (DType.F32, DType.F16, DType.BF16)
# elements a thread of add_rms_norm serves where rows allow: a decode row is one block of 512 threads
# (1024 threads: llama-1b's decode graph took 578 us, not 571; H100)
NORM_PER_THREAD = 4


def _tid(dtype: DType) -> int:
    return TYPE_IDS[dtype.name]


def _is_float(*dtypes: DType) -> bool:
    return all(d in FLOAT_TYPES for d in dtypes)


def weight_id(node: Tensor, i: int) -> int | None:
    """Template id of an optional 1-d float weight source (NO_WEIGHT when absent), None if unusable."""
    if i >= len(node.srcs):
        return NO_WEIGHT
    w = node.srcs[i]
    return _tid(w.dtype) if _is_float(w.dtype) and len(w.shape) == 1 and w.is_contiguous else None


def _q8_dest(node: Tensor, backend) -> np.uint64:
    """Where node's kernel also writes its result as q8_1 blocks for the product after it (handoff.py),
    or NULL; called by binders whose kernel writes them whenever given an address."""
    slot = backend.handoffs.dest(node)
    if slot is None:
        return NULL
    backend.handoffs.wrote(node)
    return np.uint64(backend.q8_slot(slot))


# ---- copies and element-wise --------------------------------------------------------------------


def _copy(node: Tensor, out, srcs, scratch, backend):
    launch = _copy_launch(srcs[0], node.srcs[0].dtype, out, node.dtype)
    return launch_step(node.op, launch) if launch is not None else None


def _copy_launch(src, src_dtype: DType, out, out_dtype: DType) -> Launch | None:
    """copy4 of src's elements into out (same shape, or both contiguous with as many elements), converting
    between float types; None where it does not serve."""
    if not _is_float(src_dtype, out_dtype):
        return None
    if src.shape != out.shape:
        if not (src.flags.c_contiguous and out.flags.c_contiguous) or src.size != out.size:
            return None
        src, out = src.reshape(-1), out.reshape(-1)
    sp, op = pad4(src.shape, estrides(src)), pad4(out.shape, estrides(out))
    if sp is None or op is None:
        return None
    (_, n1, n2, n3), ss = sp
    _, ds = op
    k = kernel("elementwise.cu", f"copy4<{_tid(src_dtype)}, {_tid(out_dtype)}>")
    grid, block = grid1d(out.size)
    args = (ptr(src), ptr(out), i64(out.size), i64(n1), i64(n2), i64(n3), *map(i64, ss), *map(i64, ds))
    return Launch(k, grid, block, args)


for _op in ("cont", "cast", "cpy"):
    binds(_op)(_copy)


@binds("concat")
def _concat(node: Tensor, out, srcs, scratch, backend):
    """Both sources copied into their places of out along the axis (copy4 each): the gather of a product
    split by rows (core/rowsplit.py) is then a kernel of ours, which CUDA graphs capture."""
    axis = node.params["axis"] % out.ndim
    a, b = srcs
    if a.size == 0 or b.size == 0:
        return None
    cut = a.shape[axis]
    index = (slice(None),) * axis
    launches = [_copy_launch(x, t.dtype, out[index + (part,)], node.dtype)
                for x, t, part in ((a, node.srcs[0], slice(0, cut)), (b, node.srcs[1], slice(cut, None)))]
    if any(launch is None for launch in launches):
        return None
    return launch_step(node.op, *launches)


def _binary(code: int):
    def bind(node: Tensor, out, srcs, scratch, backend):
        a, b = srcs
        if not _is_float(node.srcs[0].dtype, node.srcs[1].dtype) or a.shape != out.shape:
            return None
        ap = pad4(a.shape, estrides(a))
        if ap is None or b.ndim > a.ndim:
            return None
        (_, n1, n2, n3), sa = ap
        bshape = (1,) * (4 - b.ndim) + b.shape
        bstr = (0,) * (4 - b.ndim) + estrides(b)
        sb = tuple(0 if size == 1 else s for size, s in zip(bshape, bstr))
        if any(x != y and x != 1 for x, y in zip(bshape, (1,) * (4 - a.ndim) + a.shape)):
            return None
        k = kernel("elementwise.cu", f"binary4<{code}, {_tid(node.srcs[0].dtype)}, {_tid(node.srcs[1].dtype)}>")
        grid, block = grid1d(out.size)
        args = (ptr(a), ptr(b), ptr(out), i64(out.size), i64(n1), i64(n2), i64(n3), *map(i64, sa), *map(i64, sb))
        return launch_step(node.op, Launch(k, grid, block, args))
    return bind


binds("add")(_binary(0))
binds("mul")(_binary(1))

UNARY = {"scale": 0, "silu": 1, "gelu": 2}


def _unary(node: Tensor, out, srcs, scratch, backend):
    a = srcs[0]
    ap = pad4(a.shape, estrides(a))
    if node.srcs[0].dtype is not DType.F32 or ap is None or a.shape != out.shape:
        return None
    (_, n1, n2, n3), sa = ap
    k = kernel("elementwise.cu", f"unary4<{UNARY[node.op]}>")
    grid, block = grid1d(out.size)
    args = (ptr(a), ptr(out), f32(node.params.get("s", 1.0)), i64(out.size), i64(n1), i64(n2), i64(n3),
            *map(i64, sa))
    return launch_step(node.op, Launch(k, grid, block, args))


for _op in UNARY:
    binds(_op)(_unary)


def _gated(act: int):
    def bind(node: Tensor, out, srcs, scratch, backend):
        g, u = (rows_of(x) for x in srcs)
        if g is None or u is None or any(s.dtype is not DType.F32 for s in node.srcs) or not out.flags.c_contiguous:
            return None
        rows, n, ldg = g
        k = kernel("elementwise.cu", f"gated<{act}>")
        grid, block = grid1d(rows * n)
        args = (ptr(srcs[0]), ptr(srcs[1]), ptr(out), i32(n), i64(rows), i64(ldg), i64(u[2]))
        return launch_step(node.op, Launch(k, grid, block, args))
    return bind


for _op, _act in GLU_ACTS.items():
    binds(_op)(_gated(_act))


@binds("swiglu_oai")
def _swiglu_oai(node: Tensor, out, srcs, scratch, backend):
    g, u = (rows_of(x) for x in srcs)
    if g is None or u is None or any(s.dtype is not DType.F32 for s in node.srcs) or not out.flags.c_contiguous:
        return None
    rows, n, ldg = g
    grid, block = grid1d(rows * n)
    args = (ptr(srcs[0]), ptr(srcs[1]), ptr(out), i32(n), i64(rows), i64(ldg), i64(u[2]), f32(node.params["alpha"]),
            f32(node.params["limit"]))
    return launch_step(node.op, Launch(kernel("elementwise.cu", "swiglu_oai"), grid, block, args))


@binds("set_rows")
def _set_rows(node: Tensor, out, srcs, scratch, backend):
    _, rows, idx = srcs
    src = rows_of(rows)
    if src is None or node.srcs[1].dtype is not DType.F32 or not _is_float(node.dtype) or out.ndim != 2:
        return None
    n_rows, n, lds = src
    if n != out.shape[1] or out.strides[1] != out.itemsize:
        return None
    k = kernel("elementwise.cu", f"set_rows<{_tid(node.dtype)}>")
    grid, block = grid1d(n_rows * n)
    args = (ptr(rows), ptr(idx), ptr(out), i32(n), i64(n_rows), i64(lds), i64(estrides(out)[0]))
    return launch_step(node.op, Launch(k, grid, block, args))


def _biased_rows(add: Tensor, consumer: Tensor, srcs: list, outs: list):
    """(rows of the add's first source (rows_of), its bias array) when `add` adds a bias vector to f32 rows
    (bias_adds.row_bias) and `consumer` reads the sum whole through a view (its f32 rows: rope's first source,
    rope_set_rows' and set_rows' second), so that the consumer's kernel can read rows + bias itself and store
    the sum on the way; else None."""
    at = 0 if consumer.op == "rope" else 1
    view = consumer.srcs[at]
    a = rows_of(srcs[0][0])
    if (row_bias(add) is None or a is None or view.root is not add or view.view_offset != 0
            or not view.is_contiguous or not outs[0].flags.c_contiguous or a[0] * a[1] != add.n_elements):
        return None
    return a, srcs[0][1]


@fuses("add", "set_rows")
def _bias_set_rows(nodes: list[Tensor], outs: list, srcs: list, backend):
    """A bias add and the cache write of its rows (attention's v with a bias) in one set_rows_bias launch: the
    rows plus the bias go to the cache and to the add's result."""
    add, sr = nodes
    found = _biased_rows(add, sr, srcs, outs)
    out = outs[1]
    if (found is None or not _is_float(sr.dtype) or out.ndim != 2 or out.strides[1] != out.itemsize
            or out.shape[1] != found[0][1]):
        return None
    (n_rows, n, lda), bias = found
    idx = srcs[1][2]
    if not writes_apart(outs, [bias, idx], in_place=(srcs[0][0],)):
        return None
    k = kernel("elementwise.cu", f"set_rows_bias<{_tid(sr.dtype)}>")
    grid, block = grid1d(n_rows * n)
    args = (ptr(srcs[0][0]), ptr(bias), ptr(outs[0]), ptr(idx), ptr(out), i32(n), i64(n_rows), i64(lda),
            i64(estrides(out)[0]))
    return launch_step("set_rows+bias", Launch(k, grid, block, args))


@binds("soft_max")
def _soft_max(node: Tensor, out, srcs, scratch, backend):
    a = rows_of(srcs[0])
    if a is None or node.srcs[0].dtype is not DType.F32 or not out.flags.c_contiguous:
        return None
    rows, n, lda = a
    mask, mid, ldm = NULL, NO_WEIGHT, 0
    if len(srcs) > 1:
        m = srcs[1]
        if not _is_float(node.srcs[1].dtype) or m.strides[-1] != m.itemsize:
            return None
        mask, mid, ldm = ptr(m), _tid(node.srcs[1].dtype), estrides(m)[0]
    sinks = NULL
    if node.params.get("sinks"):
        s = srcs[2]
        if node.srcs[2].dtype is not DType.F32 or s.ndim != 1 or s.strides[0] != s.itemsize:
            return None
        sinks = ptr(s)
    k = kernel("elementwise.cu", f"soft_max<{mid}>")
    args = (ptr(srcs[0]), mask, sinks, ptr(out), i32(n), i32(srcs[0].shape[-2] if srcs[0].ndim > 1 else 1), i64(lda),
            i64(ldm), f32(node.params["scale"]))
    return launch_step(node.op, Launch(k, (rows,), (threads_for(n, 256),), args))


# ---- norms ------------------------------------------------------------------------------------


def _rms_norm(node: Tensor, out, srcs, scratch, backend):
    x, o = rows_of(srcs[0]), rows_of(out)
    wid = weight_id(node, 1)
    if x is None or o is None or wid is None or node.srcs[0].dtype is not DType.F32:
        return None
    rows, n, ldx = x
    if wid != NO_WEIGHT and node.srcs[1].shape[0] != n:
        return None
    k = kernel("norm.cu", f"rms_norm<{wid}>")
    args = (ptr(srcs[0]), ptr(srcs[1]) if wid != NO_WEIGHT else NULL, ptr(out), i32(n), i64(ldx), i64(o[2]),
            f32(node.params["eps"]))
    return launch_step(node.op, Launch(k, (rows,), (threads_for(n, 512),), args))


binds("rms_norm")(_rms_norm)
binds("rms_norm_mul")(_rms_norm)


@binds("norm")
def _norm(node: Tensor, out, srcs, scratch, backend):
    x, o = rows_of(srcs[0]), rows_of(out)
    if x is None or o is None or node.srcs[0].dtype is not DType.F32:
        return None
    rows, n, ldx = x
    k = kernel("norm.cu", "layer_norm")
    args = (ptr(srcs[0]), ptr(out), i32(n), i64(ldx), i64(o[2]), f32(node.params["eps"]))
    return launch_step(node.op, Launch(k, (rows,), (threads_for(n, 512),), args))


@binds("add_rms_norm")
def _add_rms_norm(node: Tensor, out, srcs, scratch, backend):
    x, h = srcs[:2]
    post = len(srcs) > 3
    wid = weight_id(node, 2)
    if (not (x.flags.c_contiguous and h.flags.c_contiguous and out.flags.c_contiguous) or wid in (None, NO_WEIGHT)
            or any(s.dtype is not DType.F32 for s in node.srcs[:2])):
        return None
    if post and (weight_id(node, 3) != wid):
        return None
    n = x.shape[-1]
    rows = x.size // n
    k = kernel("norm.cu", f"add_rms_norm<{wid}, {'true' if post else 'false'}>")
    args = (ptr(x), ptr(h), ptr(srcs[2]), ptr(srcs[3]) if post else NULL, ptr(out), i32(n), i64(rows),
            f32(node.params["eps"]), _q8_dest(node, backend))
    return launch_step(node.op, Launch(k, (rows,), (threads_for(-(-n // NORM_PER_THREAD), 1024),), args))


# ---- RoPE ------------------------------------------------------------------------------------


def rope_params(node: Tensor, d: int, heads: int, out_scale: float) -> tuple:
    """The RoPE kernels' ROPE_PARAMS (rope.cu): dimensions, angles, scales, and YaRN's ramp where the node
    has one (ext_factor 0 and mscale 1 where not)."""
    p = node.params
    n_dims = p["n_dims"]
    theta_scale = p["freq_base"] ** (-2.0 / n_dims)
    ext, mscale, low, high = 0.0, 1.0, 0.0, 0.0
    yarn = p.get("yarn")
    if yarn is not None:
        ext, mscale = yarn.ext_factor, yarn.attn_factor
        if ext != 0:
            low, high = yarn_corr_dims(n_dims, yarn.n_ctx_orig, p["freq_base"], yarn.beta_fast, yarn.beta_slow)
            mscale *= 1 + 0.1 * math.log(1 / p["freq_scale"])
    return (i32(n_dims), i32(d), i32(heads), i32(p["mode"] == ROPE_NEOX), f32(theta_scale), f32(p["freq_scale"]),
            f32(out_scale), f32(p.get("eps", 0.0)), f32(ext), f32(mscale), f32(low), f32(high))


def _heads(a) -> tuple[int, int, int, int] | None:
    """(tokens, heads, head dim, token stride) of a [tokens, heads, dim] whose heads lie back to back."""
    if a.ndim != 3 or a.strides[2] != a.itemsize or (a.shape[1] > 1 and a.strides[1] != a.shape[2] * a.itemsize):
        return None
    return a.shape[0], a.shape[1], a.shape[2], estrides(a)[0]


@binds("rope")
def _rope(node: Tensor, out, srcs, scratch, backend):
    """rope, or with frequency factors (the node's last source: LongRoPE, Llama 3's rope_freqs) rope_ff."""
    a = _heads(srcs[0])
    wid = weight_id(node, 2) if "eps" in node.params else NO_WEIGHT
    factors = srcs[-1] if node.params.get("factors") else None
    if (a is None or wid is None or node.srcs[0].dtype is not DType.F32 or not out.flags.c_contiguous
            or (factors is not None and not factors.flags.c_contiguous)):
        return None
    t, heads, d, lda = a
    norm = ptr(srcs[2]) if wid != NO_WEIGHT else NULL
    ff = () if factors is None else (ptr(factors),)
    k = kernel("rope.cu", f"rope<{wid}>" if factors is None else f"rope_ff<{wid}>")
    args = (ptr(srcs[0]), ptr(srcs[1]), norm, *ff, ptr(out), i64(lda),
            *rope_params(node, d, heads, node.params.get("out_scale", 1.0)))
    return launch_step(node.op, Launch(k, (t * heads,), (threads_for(node.params["n_dims"] // 2, 512),), args))


@binds("rope_set_rows")
def _rope_set_rows(node: Tensor, out, srcs, scratch, backend):
    dst, a_arr, idx, pos = srcs[:4]
    a = _heads(a_arr)
    wid = weight_id(node, 4)
    if (a is None or wid is None or node.srcs[1].dtype is not DType.F32 or not _is_float(node.dtype)
            or out.ndim != 2 or out.strides[1] != out.itemsize):
        return None
    t, heads, d, lda = a
    k = kernel("rope.cu", f"rope_set_rows<{wid}, {_tid(node.dtype)}>")
    args = (ptr(a_arr), ptr(pos), ptr(idx), ptr(srcs[4]) if wid != NO_WEIGHT else NULL, ptr(out), i64(lda),
            i64(estrides(out)[0]), *rope_params(node, d, heads, 1.0))
    return launch_step(node.op, Launch(k, (t * heads,), (threads_for(node.params["n_dims"] // 2, 512),), args))


@fuses("add", "rope")
def _bias_rope(nodes: list[Tensor], outs: list, srcs: list, backend):
    """A bias add and the RoPE of its result (attention's q or k with a bias: gpt-oss, qwen2) in one rope_bias
    launch: each head's rows plus the bias are stored as the add's result and rotated as rope does."""
    add, rope = nodes
    if "factors" in rope.params:
        return None
    found = _biased_rows(add, rope, srcs, outs)
    view = rope.srcs[0]
    wid = weight_id(rope, 2)
    if found is None or wid is None or len(view.shape) != 3 or not outs[1].flags.c_contiguous:
        return None
    (n_rows, m, lda), bias = found
    t, heads, d = view.shape
    reads = [bias, srcs[1][1]] + ([srcs[1][2]] if wid != NO_WEIGHT else [])
    if n_rows != t or heads * d != m or not writes_apart(outs, reads, in_place=(srcs[0][0],)):
        return None
    k = kernel("rope.cu", f"rope_bias<{wid}>")
    args = (ptr(srcs[0][0]), ptr(bias), ptr(outs[0]), ptr(srcs[1][1]), ptr(srcs[1][2]) if wid != NO_WEIGHT else NULL,
            ptr(outs[1]), i64(lda), *rope_params(rope, d, heads, rope.params.get("out_scale", 1.0)))
    return launch_step("rope+bias", Launch(k, (t * heads,), (threads_for(rope.params["n_dims"] // 2, 512),), args))


@fuses("add", "rope_set_rows")
def _bias_rope_set_rows(nodes: list[Tensor], outs: list, srcs: list, backend):
    """A bias add and the keys' RoPE into the cache after it (qwen2's k) in one rope_set_rows_bias launch: each
    head's rows plus the bias are stored as the add's result and rotated into their cache rows."""
    add, rs = nodes
    found = _biased_rows(add, rs, srcs, outs)
    view, out = rs.srcs[1], outs[1]
    wid = weight_id(rs, 4)
    if (found is None or wid is None or len(view.shape) != 3 or not _is_float(rs.dtype) or out.ndim != 2
            or out.strides[1] != out.itemsize):
        return None
    (n_rows, m, lda), bias = found
    t, heads, d = view.shape
    _, _, idx, pos = srcs[1][:4]
    reads = [bias, idx, pos] + ([srcs[1][4]] if wid != NO_WEIGHT else [])
    if n_rows != t or heads * d != m or not writes_apart(outs, reads, in_place=(srcs[0][0],)):
        return None
    k = kernel("rope.cu", f"rope_set_rows_bias<{wid}, {_tid(rs.dtype)}>")
    args = (ptr(srcs[0][0]), ptr(bias), ptr(outs[0]), ptr(pos), ptr(idx), ptr(srcs[1][4]) if wid != NO_WEIGHT else NULL,
            ptr(out), i64(lda), i64(estrides(out)[0]), *rope_params(rs, d, heads, 1.0))
    return launch_step("rope_set_rows+bias", Launch(k, (t * heads,), (threads_for(rs.params["n_dims"] // 2, 512),),
                                                    args))


# what the queries' and keys' RoPE must share
ROPE_SHARED = ("n_dims", "mode", "freq_base", "freq_scale", "eps", "yarn")


@fuses("rope", "rope_set_rows", "set_rows")
def rope_qkv(nodes: list[Tensor], outs: list, srcs: list, backend):
    """The queries' RoPE, the keys' RoPE into the cache and the values' cache write of one layer
    (three nodes, consecutive in every attention block) in one launch: each is a few tiny blocks."""
    rq, rk, sv = nodes
    if "factors" in rq.params:
        return None
    (q_arr, pos, *_), (_, k_arr, idx, *_), (_, v_arr, _) = srcs
    q_out, k_out, v_out = outs
    q, k, v = _heads(q_arr), _heads(k_arr), rows_of(v_arr)
    wid = weight_id(rq, 2)
    if (q is None or k is None or v is None or wid is None or weight_id(rk, 4) != wid
            or rk.srcs[3] is not rq.srcs[1] or sv.srcs[2] is not rk.srcs[2]
            or any(rq.params.get(x, 0.0) != rk.params.get(x, 0.0) for x in ROPE_SHARED)
            or any(n.srcs[i].dtype is not DType.F32 for n, i in ((rq, 0), (rk, 1), (sv, 1)))
            or rk.dtype is not sv.dtype or not _is_float(rk.dtype) or not q_out.flags.c_contiguous
            or any(o.ndim != 2 or o.strides[1] != o.itemsize for o in (k_out, v_out))):
        return None
    t, hq, d, ldq = q
    tk, hk, dk, ldk = k
    if tk != t or dk != d or v[0] != t or v[1] != hk * d:
        return None
    # one launch runs all three at once: no node may write what a later one reads
    if not all(disjoint(q_out, x) for x in (*srcs[1], *srcs[2])) or not all(disjoint(k_out, x) for x in srcs[2]):
        return None
    fn = kernel("rope.cu", f"rope_qkv<{wid}, {_tid(rk.dtype)}>")
    wq = ptr(srcs[0][2]) if wid != NO_WEIGHT else NULL
    wk = ptr(srcs[1][4]) if wid != NO_WEIGHT else NULL
    args = (ptr(q_arr), ptr(k_arr), ptr(v_arr), ptr(pos), ptr(idx), wq, wk, ptr(q_out), ptr(k_out), ptr(v_out),
            i64(ldq), i64(ldk), i64(v[2]), i64(estrides(k_out)[0]), i64(estrides(v_out)[0]), i32(t), i32(hq),
            f32(rq.params.get("out_scale", 1.0)), *rope_params(rk, d, hk, 1.0))
    block = threads_for(rq.params["n_dims"] // 2, 512)
    return launch_step("rope_qkv", Launch(fn, (t * (hq + 2 * hk),), (block,), args))


# ---- attention -------------------------------------------------------------------------------

FA_ROWS, FA_KEYS, FA_THREADS = 4, 32, 128  # rows per block: a warp each
SM_TARGET = 264  # blocks that keep an H100's 132 multiprocessors busy


DECODE_ROWS = 32  # query rows per KV head up to which attention runs attn_decode (attention.cu)
DECODE_SMEM = 96 << 10  # its shared memory: query rows, one chunk's weights, 4096 floats of value sums
DECODE_SUMS = 4096
DECODE_MIN_KEYS = 256  # keys per block before a cache is split over blocks
DECODE_FEW_ROWS = 16  # query rows per KV head up to which attn_decode_rows serves (a block each 4 of them)
DECODE_BLOCK_ROWS = 4  # query rows an attn_decode_rows or attn_decode_tok block serves (attention.cu's DS_ROWS)


def _decode_chunk(node: Tensor) -> int | None:
    """Keys per block of attn_decode, or None where the node's rows or head dimension are not the
    kernel's. A block's time grows with its keys only past a few hundred (its loads are issued
    together), so short caches take one block per KV head and long ones are split to fill the GPU."""
    hq, t, d = node.srcs[0].shape
    hk, n_kv, _ = node.srcs[1].shape
    rows = t * (hq // hk)
    if rows > DECODE_ROWS or d not in DECODE_DIMS:
        return None
    chunk = -(-n_kv // max(1, SM_TARGET // (2 * hk)))
    chunk = max(DECODE_MIN_KEYS, -(-chunk // 32) * 32)
    chunk = min(chunk, (DECODE_SMEM // 4 - DECODE_SUMS - rows * d) // rows // 32 * 32)
    return chunk if chunk >= 32 else None


def _decode_smem(node: Tensor, chunk: int) -> int:
    hq, t, d = node.srcs[0].shape
    return (t * (hq // node.srcs[1].shape[0]) * (d + chunk) + DECODE_SUMS) * 4


def flash_split(node: Tensor) -> int:
    """Key chunks of a fused attention (flash-decoding when few query rows fill few blocks)."""
    hq, t, _ = node.srcs[0].shape
    hk, n_kv, _ = node.srcs[1].shape
    chunk = _decode_chunk(node)
    if chunk is not None:
        return -(-n_kv // chunk)
    blocks = -(-t * (hq // hk) // FA_ROWS) * hk
    if blocks >= SM_TARGET // 2:
        return 1
    return max(1, min(-(-n_kv // (2 * FA_KEYS)), -(-SM_TARGET // blocks)))


def _fa_scratch(node: Tensor) -> int:
    split = flash_split(node)
    hq, t, d = node.srcs[0].shape
    return 0 if split == 1 else split * t * hq * (d + 2) * 4


def _attention_operands(node: Tensor, out, srcs) -> bool:
    """Whether the fused attention kernels take these operands: f32 queries, a float cache with the
    same type for keys and values, an f16 mask, unit strides along the head dimension (and along the
    sinks, f32 [heads], where the node has them)."""
    q = srcs[0]
    kt = node.srcs[1].dtype
    return (-(-q.shape[2] // 32) in FA_EPL and node.srcs[0].dtype is DType.F32 and node.srcs[2].dtype is kt
            and _is_float(kt) and node.srcs[3].dtype is DType.F16 and out.flags.c_contiguous
            and all(x.strides[-1] == x.itemsize for x in srcs))


def _sinks(node: Tensor, srcs) -> np.uint64:
    """Address of the heads' attention sinks (f32 [heads]) the kernels fold into each row's softmax, or NULL."""
    return ptr(srcs[4]) if node.params.get("sinks") else NULL


def _attention_args(node: Tensor, srcs, chunk: int) -> tuple:
    """The arguments both attention kernels take after their pointers: d, T, r, n_kv, chunk, strides, scale."""
    q, k, v, mask = srcs[:4]
    hq, t, d = q.shape
    hk, n_kv, _ = k.shape
    sq, sk, sv = estrides(q), estrides(k), estrides(v)
    return (i32(d), i32(t), i32(hq // hk), i32(n_kv), i32(chunk), i64(sq[0]), i64(sq[1]), i64(sk[0]),
            i64(sk[1]), i64(sv[0]), i64(sv[1]), i64(estrides(mask)[0]), f32(node.params["scale"]))


def _aligned8(*arrays) -> bool:
    """Every array's address and strides fit attn_decode's loads of eight elements (16 bytes for f16)."""
    return all(a.data.ptr % (8 * a.itemsize) == 0 and all(st % (8 * a.itemsize) == 0 for st in a.strides[:-1])
               for a in arrays)


def _cache_writer(t: Tensor) -> Tensor | None:
    """The set_rows (or rope_set_rows) node whose result t reads through views, if any."""
    while t.op not in ("set_rows", "rope_set_rows"):
        if t.op not in ("view", "reshape", "permute", "transpose"):
            return None
        t = t.srcs[0]
    return t


def _fresh_rows(node: Tensor, backend) -> np.uint64:
    """Address of the cache rows this step writes into the keys and values attention reads (the row
    indices both writes take, one per token), or NULL where the graph does not show them: attn_decode_rows
    reads those rows after the kernel before has finished, the others before."""
    writers = [_cache_writer(node.srcs[i]) for i in (1, 2)]
    if any(w is None for w in writers) or writers[0].srcs[2] is not writers[1].srcs[2]:
        return NULL
    idx = writers[0].srcs[2]
    buffer = idx.root.buffer
    if (idx.dtype is not DType.I32 or idx.n_elements != node.srcs[0].shape[1] or buffer is None
            or buffer.backend is not backend):
        return NULL
    return ptr(backend.array(idx))


def _mask_is_step_input(node: Tensor) -> bool:
    """Whether attention's mask is copied in before the step's first kernel (attn_decode and attn_decode_rows
    read it before pdl_begin then), not made by a kernel of the step (ops.kq_mask), which may still run."""
    return node.srcs[3].root.op != "kq_mask"


@binds("kq_mask")
def _kq_mask(node: Tensor, out, srcs, scratch, backend):
    """The KQ mask from the cells (ops.kq_mask): a block of 256 cells of one token's row each."""
    cell_pos, cell_seqs, tok_pos, tok_seq = srcs
    if not all(a.flags.c_contiguous for a in (out, *srcs)):
        return None
    t, n_kv = out.shape
    args = (ptr(cell_pos), ptr(cell_seqs), ptr(tok_pos), ptr(tok_seq), ptr(out), i32(n_kv), i32(cell_seqs.shape[1]),
            i32(node.params["window"]))
    return launch_step(node.op, Launch(kernel("attention.cu", "kq_mask"), (-(-n_kv // 256), t), (256,), args))


TOK_MAX_CELLS = 65536  # cells attention kernels list the tiles of (attention.cu's DT_MAX_TILES * 32)
TOK_MAX_ROWS = 16  # query heads per KV head attn_decode_tok serves (4 blocks of DECODE_BLOCK_ROWS)


CASCADE_SPLIT = 4  # key chunks of a shared prefix flash_attn_tc's PREFIX mode reads (attention.cu's CASCADE_SPLIT)


def _cascades(node: Tensor) -> bool:
    """Whether a decode step of many sequences whose cells may be shared (the graph builder marks it
    `shared_prefix`: GraphParams.shared) reads the prefix of cells its tokens share once for all of them
    (flash_attn_tc's PREFIX mode, on tensor cores: an f16 cache, head sizes TC_DIMS, no sinks) before each token's
    own cells (attn_decode_tok). Which cells are shared the step finds itself (attn_tiles); where none are, the
    extra launch returns at once, but costs (H200, 64 sequences of their own cells: 24 us a layer against 14)."""
    return (node.params.get("shared_prefix", False) and node.srcs[1].dtype is DType.F16
            and node.srcs[2].dtype is DType.F16 and node.srcs[0].shape[2] in TC_DIMS and not node.params.get("sinks"))


def _tok_layout(node: Tensor) -> tuple[int, int, int]:
    """attn_decode_tok's scratch: the bytes of attn_tiles' lists (a count and up to n_kv / 32 tiles a token),
    then with _cascades each token's leading tiles seen whole (i32) and the PREFIX pass's partial rows (f32 [chunk][T *
    hq rows][D + 2]): (offset of the tiles seen whole, offset of the partial rows, bytes in all)."""
    hq, t, d = node.srcs[0].shape
    n_kv = node.srcs[1].shape[1]
    lists = t * (-(-n_kv // 32) + 1) * 4
    if not _cascades(node):
        return lists, lists, lists
    part = -(-(lists + t * 4) // 16) * 16
    return lists, part, part + CASCADE_SPLIT * t * hq * (d + 2) * 4


def _tok_tiles(node: Tensor) -> int:
    """Bytes of attn_decode_tok's scratch (_tok_layout) for a decode step of many sequences, else 0."""
    return _tok_layout(node)[2] if node.params.get("per_token") else 0


@binds("flash_attn", scratch=_tok_tiles)
def _attn_decode_tok(node: Tensor, out, srcs, scratch, backend):
    """A decode step of many sequences (the graph builder marks it `per_token`): attn_tiles lists each token's
    tiles of cells from its mask row once, then attn_decode_tok, a block per KV head, token and 4 heads of the
    group, reads those tiles only, so each sequence's attention reads its own cells rather than the whole
    cache under a mask."""
    q, k, v, mask = srcs[:4]
    hq, t, d = q.shape
    hk, n_kv, _ = k.shape
    r = hq // hk
    if (not node.params.get("per_token") or d not in DECODE_DIMS or r > TOK_MAX_ROWS or n_kv % 8
            or n_kv > TOK_MAX_CELLS or not _attention_operands(node, out, srcs) or not _aligned8(k, v, mask)):
        return None
    sq, sk, sv = estrides(q), estrides(k), estrides(v)
    ldm = i64(estrides(mask)[0])
    cascade = _cascades(node)
    at_full, at_part, _ = _tok_layout(node)
    full = np.uint64(scratch.data.ptr + at_full) if cascade else NULL
    part = np.uint64(scratch.data.ptr + at_part) if cascade else NULL
    tiles = Launch(kernel("attention.cu", "attn_tiles"), (t,), (256,),
                   (ptr(mask), ldm, i32(n_kv), ptr(scratch), i32(_mask_is_step_input(node)), full))
    args = (ptr(q), ptr(k), ptr(v), ptr(mask), _sinks(node, srcs), ptr(out), ptr(scratch), i32(r), i32(n_kv),
            i64(sq[0]), i64(sq[1]), i64(sk[0]), i64(sk[1]), i64(sv[0]), i64(sv[1]), ldm, f32(node.params["scale"]),
            full, part)
    fn = kernel("attention.cu", f"attn_decode_tok<{_tid(node.srcs[1].dtype)}, {d}>")
    own = Launch(fn, (hk, t, -(-r // DECODE_BLOCK_ROWS)), (256,), args)
    if not cascade:
        return launch_step(node.op, tiles, own)
    common = _attention_args(node, srcs, n_kv)  # all but chunk, as flash_attn_tc takes them; not listed
    prefix_args = (ptr(q), ptr(k), ptr(v), ptr(mask), NULL, ptr(out), *common[:4], *common[5:], i32(0), full, part)
    prefix = Launch(kernel("attention.cu", f"flash_attn_tc<{d}, true>"),
                    (-(-t * r // TC_BLOCK_ROWS), hk, CASCADE_SPLIT), (128,), prefix_args)
    return launch_step(node.op, tiles, prefix, own)


@binds("flash_attn", scratch=_fa_scratch)
def _attn_decode(node: Tensor, out, srcs, scratch, backend):
    """Few query rows: one launch of attn_decode (its last block per head merges the key chunks)."""
    chunk = _decode_chunk(node)
    q, k, v, mask = srcs[:4]
    if chunk is None or not _attention_operands(node, out, srcs) or not _aligned8(k, v):
        return None
    hq, t, d = q.shape
    hk, n_kv, _ = k.shape
    split = -(-n_kv // chunk)
    rows = t * (hq // hk)
    blocks = -(-rows // DECODE_BLOCK_ROWS) if rows <= DECODE_FEW_ROWS else 1  # row blocks of attn_decode_rows
    args = (ptr(q), ptr(k), ptr(v), ptr(mask), _sinks(node, srcs), ptr(out), ptr(scratch) if split > 1 else NULL,
            ptr(backend.tickets(hk * blocks)), *_attention_args(node, srcs, chunk), _q8_dest(node, backend))
    mask_in = i32(_mask_is_step_input(node))
    if rows <= DECODE_FEW_ROWS:  # one token's heads: the kernel built for latency, a block each 4 rows
        fn = kernel("attention.cu", f"attn_decode_rows<{_tid(node.srcs[1].dtype)}, {d}>")
        rows_args = args + (_fresh_rows(node, backend), mask_in, i32(0))
        return launch_step(node.op, Launch(fn, (hk, split, blocks), (256,), rows_args, prologue=True, light=True))
    args += (mask_in, i32(0))
    fn = kernel("attention.cu", f"attn_decode<{_tid(node.srcs[1].dtype)}, {d}>")
    smem = _decode_smem(node, chunk)
    fn.max_dynamic_shared_size_bytes = max(fn.max_dynamic_shared_size_bytes, smem)
    return launch_step(node.op, Launch(fn, (hk, split), (128,), args, smem, prologue=True))


TC_BLOCK_ROWS = 64  # query rows of a flash_attn_tc block: 4 warps of 16


@binds("flash_attn")
def _flash_attn_tc(node: Tensor, out, srcs, scratch, backend):
    """Prompts over an f16 cache: flash_attn_tc, scores and weighted values on tensor cores, where a
    KV head's query rows fill whole blocks and need no key split."""
    q, k, v, mask = srcs[:4]
    hq, t, d = q.shape
    hk, n_kv, _ = k.shape
    if (d not in TC_DIMS or node.srcs[1].dtype is not DType.F16 or t * (hq // hk) < TC_BLOCK_ROWS
            or flash_split(node) > 1 or not _attention_operands(node, out, srcs) or not _aligned8(k, v)):
        return None
    fn = kernel("attention.cu", f"flash_attn_tc<{d}, false>")
    args = _attention_args(node, srcs, n_kv)
    listed = i32(n_kv % 8 == 0 and n_kv <= TOK_MAX_CELLS and _aligned8(mask))  # list_tiles' conditions
    # all of _attention_args but chunk: one key chunk
    args = (ptr(q), ptr(k), ptr(v), ptr(mask), _sinks(node, srcs), ptr(out), *args[:4], *args[5:], listed, NULL,
            NULL)
    return launch_step(node.op, Launch(fn, (-(-t * (hq // hk) // TC_BLOCK_ROWS), hk), (128,), args))


@binds("flash_attn")
def _flash_attn(node: Tensor, out, srcs, scratch, backend):
    if not _attention_operands(node, out, srcs):
        return None
    q, k, v, mask = srcs[:4]
    hq, t, d = q.shape
    hk, n_kv, _ = k.shape
    epl = -(-d // 32)
    r = hq // hk
    split = flash_split(node)
    chunk = -(-n_kv // split)
    chunk = -(-chunk // FA_KEYS) * FA_KEYS
    split = -(-n_kv // chunk)
    fa = kernel("attention.cu", f"flash_attn<{_tid(node.srcs[1].dtype)}, {epl}>")
    smem = (2 * FA_KEYS + FA_ROWS) * (d + 1) * 4
    fa.max_dynamic_shared_size_bytes = max(fa.max_dynamic_shared_size_bytes, smem)
    part = ptr(scratch) if split > 1 else NULL
    args = (ptr(q), ptr(k), ptr(v), ptr(mask), _sinks(node, srcs), ptr(out), part, *_attention_args(node, srcs, chunk))
    grid = (-(-t * r // FA_ROWS), hk, split)
    launches = [Launch(fa, grid, (FA_THREADS,), args, smem)]
    if split > 1:
        combine = kernel("attention.cu", "attn_combine")
        launches.append(Launch(combine, (t * hq,), (threads_for(d, 256),), (part, ptr(out), i32(d), i32(t * hq),
                                                                           i32(split))))
    return launch_step(node.op, *launches)


# ---- greedy sampling ---------------------------------------------------------------------------

ARGMAX_THREADS = 256
ARGMAX_MIN_CHUNK = 1024  # elements a block reads at least: 4 a thread


def _argmax_split(node: Tensor) -> tuple[int, int]:
    """(elements per block, blocks per row) of argmax_rows. Rows are split over blocks until the launch has
    about SM_TARGET blocks: one 1024-thread block would read a decode step's 128k logits from one
    multiprocessor, a load after another; 126 blocks of 256 threads read 4 each, all at once (H100, launches
    back to back: 24.7 us against 9.7, the pace of the launches themselves). Rows that fill the GPU by
    themselves take a block each (and no tickets)."""
    rows, n = node.srcs[0].shape
    chunk = max(ARGMAX_MIN_CHUNK, -(-n // max(1, SM_TARGET // max(rows, 1))))
    return chunk, -(-n // chunk)


def _argmax_scratch(node: Tensor) -> int:
    """Each block's (key, index) when rows are split over blocks."""
    _, split = _argmax_split(node)
    return 0 if split == 1 else node.srcs[0].shape[0] * split * 8


@binds("argmax", scratch=_argmax_scratch)
def _argmax(node: Tensor, out, srcs, scratch, backend):
    a = rows_of(srcs[0])
    if a is None or not out.flags.c_contiguous:
        return None
    rows, n, lda = a
    chunk, split = _argmax_split(node)
    part, tickets = (ptr(scratch), ptr(backend.tickets(rows))) if split > 1 else (NULL, NULL)
    args = (ptr(srcs[0]), ptr(out), part, tickets, i32(n), i64(lda), i32(chunk))
    return launch_step(node.op, Launch(kernel("elementwise.cu", "argmax_rows"), (rows, split), (ARGMAX_THREADS,), args))
