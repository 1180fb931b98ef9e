"""Graph construction: each function here checks its operands and returns a new deferred
tensor recording the op. Nothing is computed and no memory is taken here.

Ops that write into an existing tensor (`cpy`, `set_rows`) return a view of it, so that
later readers depend on the write through a data edge rather than on Python line order.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from ggrun.core.dtypes import DType
from ggrun.core.errors import GraphError
from ggrun.core.tensor import Tensor, contiguous_strides, new_tensor


@dataclass(frozen=True)
class OpInfo:
    """What the allocator and scheduler need to know about an op."""

    inplace: bool = False  # the result may reuse the memory of a same-sized source it last reads
    view: bool = False  # the result shares its source's memory and needs no kernel
    writes_into: bool = False  # the result is a view of a tensor the kernel writes into


OPS: dict[str, OpInfo] = {
    "view": OpInfo(view=True),
    "reshape": OpInfo(view=True),
    "permute": OpInfo(view=True),
    "transpose": OpInfo(view=True),
    "cpy": OpInfo(writes_into=True),
    "set_rows": OpInfo(writes_into=True),
    "cont": OpInfo(),
    "cast": OpInfo(),
    "get_rows": OpInfo(),
    "concat": OpInfo(),
    "mul_mat": OpInfo(),
    "mul_mat_multi": OpInfo(),
    "mul_mat_glu": OpInfo(),
    "add": OpInfo(inplace=True),
    "mul": OpInfo(inplace=True),
    "scale": OpInfo(inplace=True),
    "softcap": OpInfo(inplace=True),
    "silu": OpInfo(inplace=True),
    "gelu": OpInfo(inplace=True),
    "swiglu": OpInfo(inplace=True),
    "swiglu_oai": OpInfo(inplace=True),
    "geglu": OpInfo(inplace=True),
    "rms_norm": OpInfo(inplace=True),
    "rms_norm_mul": OpInfo(inplace=True),
    "add_rms_norm": OpInfo(),
    "norm": OpInfo(inplace=True),
    "rope": OpInfo(inplace=True),
    "rope_set_rows": OpInfo(writes_into=True),
    "rope_shift": OpInfo(writes_into=True),
    "soft_max": OpInfo(inplace=True),
    "argmax": OpInfo(),
    "sample": OpInfo(),
    "sample_logprobs": OpInfo(),
    "moe_topk": OpInfo(),
    "moe_weights": OpInfo(),
    "mul_mat_id": OpInfo(),
    "flash_attn": OpInfo(),
    "kq_mask": OpInfo(),
    "copy": OpInfo(),  # a scheduler copy of a tensor into another backend's memory
}

ROPE_NORMAL = 0
ROPE_NEOX = 2
ROW_PARTS = "row_parts"  # a matrix split by rows (core/rowsplit.py's handle) keeps its parts here; no op takes one
RUN_ON = "run_on"  # a node's params: the backend (by name) the scheduler must run it on
_FLOATS = (DType.F32, DType.F16, DType.BF16)
_counter = itertools.count()


def _node(op: str, dtype: DType, shape: tuple[int, ...], srcs: tuple[Tensor, ...], name: str | None, **params) -> Tensor:
    return new_tensor(name or f"{op}-{next(_counter)}", dtype, shape, op=op, srcs=srcs, params=params)


def _fail(op: str, msg: str, *tensors: Tensor) -> GraphError:
    return GraphError(f"{op}: {msg} ({', '.join(t.describe() for t in tensors)})")


def _need_float(op: str, *tensors: Tensor) -> None:
    for t in tensors:
        if t.dtype not in _FLOATS:
            raise _fail(op, f"expects a float tensor, got {t.dtype}", t)


def _view_of(op: str, a: Tensor, shape: tuple[int, ...], strides: tuple[int, ...], offset: int, name: str | None) -> Tensor:
    """A tensor sharing a's memory; its view_src is always the memory-owning root."""
    t = Tensor(
        name=name or f"{a.name}.{op}",
        dtype=a.dtype,
        shape=tuple(int(d) for d in shape),
        strides=tuple(int(s) for s in strides),
        op=op,
        srcs=(a,),
        view_src=a.root,
        view_offset=a.view_offset + offset,
    )
    if t.n_elements and t.view_offset + t.nbytes > a.root.nbytes:
        raise _fail(op, "view reaches past the end of its source", t, a.root)
    return t


def view(a: Tensor, shape: tuple[int, ...], strides: tuple[int, ...] | None = None, offset: int = 0, name: str | None = None) -> Tensor:
    """A view of a at byte `offset` (relative to a's first element) with the given shape and byte strides."""
    strides = contiguous_strides(tuple(shape), a.dtype) if strides is None else strides
    if len(strides) != len(shape):
        raise _fail("view", "strides and shape differ in length", a)
    return _view_of("view", a, tuple(shape), tuple(strides), offset, name)


def reshape(a: Tensor, shape: tuple[int, ...], name: str | None = None) -> Tensor:
    """Same elements, new shape; a must be contiguous. One dimension may be -1."""
    shape = tuple(shape)
    if -1 in shape:
        known = math.prod(d for d in shape if d != -1)
        shape = tuple(a.n_elements // known if d == -1 else d for d in shape)
    if math.prod(shape) != a.n_elements:
        raise _fail("reshape", f"cannot reshape to {list(shape)}", a)
    if not a.is_contiguous:
        raise _fail("reshape", "source is not contiguous; use cont first", a)
    return _view_of("reshape", a, shape, contiguous_strides(shape, a.dtype), 0, name)


def permute(a: Tensor, axes: tuple[int, ...], name: str | None = None) -> Tensor:
    """Reorder axes as numpy's transpose does: result axis i is a's axis axes[i]."""
    if sorted(axes) != list(range(len(a.shape))):
        raise _fail("permute", f"axes {axes} are not a permutation", a)
    return _view_of("permute", a, tuple(a.shape[i] for i in axes), tuple(a.strides[i] for i in axes), 0, name)


def transpose(a: Tensor, name: str | None = None) -> Tensor:
    """Swap the last two axes."""
    axes = list(range(len(a.shape)))
    axes[-1], axes[-2] = axes[-2], axes[-1]
    return _view_of("transpose", a, tuple(a.shape[i] for i in axes), tuple(a.strides[i] for i in axes), 0, name)


def cont(a: Tensor, name: str | None = None) -> Tensor:
    """A contiguous copy of a (which may be any view)."""
    return _node("cont", a.dtype, a.shape, (a,), name)


def cast(a: Tensor, dtype: DType, name: str | None = None) -> Tensor:
    """A contiguous copy of a converted to dtype."""
    _need_float("cast", a)
    return _node("cast", dtype, a.shape, (a,), name)


def cpy(src: Tensor, dst: Tensor, name: str | None = None) -> Tensor:
    """Write src's elements into dst (converting dtype); returns dst's view for later readers."""
    if src.n_elements != dst.n_elements:
        raise _fail("cpy", "element counts differ", src, dst)
    t = _view_of("cpy", dst, dst.shape, dst.strides, 0, name)
    t.srcs = (src, dst)
    return t


def set_rows(dst: Tensor, src: Tensor, idx: Tensor, name: str | None = None) -> Tensor:
    """dst[idx[i]] = src[i] for each row i; returns dst's view for later readers (the KV cache write)."""
    if idx.dtype is not DType.I32 or len(idx.shape) != 1:
        raise _fail("set_rows", "row indices must be a 1-d i32 tensor", idx)
    if len(dst.shape) != 2 or len(src.shape) != 2 or src.shape != (idx.shape[0], dst.shape[1]):
        raise _fail("set_rows", "expects dst [rows, n], src [k, n] and k indices", dst, src, idx)
    t = _view_of("set_rows", dst, dst.shape, dst.strides, 0, name)
    t.srcs = (dst, src, idx)
    return t


def get_rows(a: Tensor, ids: Tensor, name: str | None = None) -> Tensor:
    """Rows of a 2-d tensor picked by a 1-d i32 tensor of row numbers, as f32."""
    if ids.dtype is not DType.I32 or len(ids.shape) != 1:
        raise _fail("get_rows", "row ids must be a 1-d i32 tensor", ids)
    if len(a.shape) != 2:
        raise _fail("get_rows", "source must be 2-d", a)
    return _node("get_rows", DType.F32, (ids.shape[0], a.shape[1]), (a, ids), name)


def concat(a: Tensor, b: Tensor, axis: int, name: str | None = None) -> Tensor:
    """a and b joined along axis."""
    axis %= len(a.shape)
    if len(a.shape) != len(b.shape) or any(x != y for i, (x, y) in enumerate(zip(a.shape, b.shape)) if i != axis):
        raise _fail("concat", f"shapes differ outside axis {axis}", a, b)
    if a.dtype != b.dtype:
        raise _fail("concat", "dtypes differ", a, b)
    shape = list(a.shape)
    shape[axis] += b.shape[axis]
    return _node("concat", a.dtype, tuple(shape), (a, b), name, axis=axis)


def _broadcasts(b: tuple[int, ...], a: tuple[int, ...]) -> bool:
    """True when shape b broadcasts to shape a without changing a."""
    if len(b) > len(a):
        return False
    return all(x == 1 or x == y for x, y in zip(reversed(b), reversed(a)))


def _binary(op: str, a: Tensor, b: Tensor, name: str | None) -> Tensor:
    _need_float(op, a, b)
    if not _broadcasts(b.shape, a.shape):
        raise _fail(op, "second operand does not broadcast to the first", a, b)
    return _node(op, DType.F32, a.shape, (a, b), name)


def add(a: Tensor, b: Tensor, name: str | None = None) -> Tensor:
    """a + b, with b broadcast to a's shape."""
    return _binary("add", a, b, name)


def mul(a: Tensor, b: Tensor, name: str | None = None) -> Tensor:
    """a * b, with b broadcast to a's shape."""
    return _binary("mul", a, b, name)


def _unary(op: str, a: Tensor, name: str | None, **params) -> Tensor:
    _need_float(op, a)
    return _node(op, DType.F32, a.shape, (a,), name, **params)


def scale(a: Tensor, s: float, name: str | None = None) -> Tensor:
    return _unary("scale", a, name, s=float(s))


def softcap(a: Tensor, cap: float, name: str | None = None) -> Tensor:
    """cap * tanh(a / cap): values squeezed into (-cap, cap), as ggml's scale, tanh, scale (gemma2's
    soft-capping of attention scores and final logits)."""
    if not cap > 0:
        raise _fail("softcap", f"cap {cap} must be positive", a)
    return _unary("softcap", a, name, cap=float(cap))


def silu(a: Tensor, name: str | None = None) -> Tensor:
    return _unary("silu", a, name)


def gelu(a: Tensor, name: str | None = None, f16_table: bool = False) -> Tensor:
    """GELU, tanh approximation; f16_table: as ggml's CPU table of f16 inputs and results."""
    return _unary("gelu", a, name, f16_table=f16_table)


def rms_norm(a: Tensor, eps: float, name: str | None = None) -> Tensor:
    """a / sqrt(mean(a^2) + eps) over the last axis."""
    return _unary("rms_norm", a, name, eps=float(eps))


def _check_norm_weight(op: str, a: Tensor, w: Tensor) -> None:
    _need_float(op, w)
    if not _broadcasts(w.shape, a.shape) or w.shape[-1] != a.shape[-1]:
        raise _fail(op, "the weight must span the last axis and broadcast over the rest", a, w)


def rms_norm_mul(a: Tensor, w: Tensor, eps: float, name: str | None = None) -> Tensor:
    """rms_norm(a) * w in one pass (w spans the last axis: a norm's weight, per channel or per head dim)."""
    _need_float("rms_norm_mul", a)
    _check_norm_weight("rms_norm_mul", a, w)
    return _node("rms_norm_mul", DType.F32, a.shape, (a, w), name, eps=float(eps))


def add_rms_norm(x: Tensor, h: Tensor, w: Tensor, eps: float, post: Tensor | None = None,
                 name: str | None = None) -> Tensor:
    """The residual add fused with the next norm: [2, *x.shape] holding s = x + h and rms_norm(s) * w.

    With `post`, h is first normalised by its own weight: s = x + rms_norm(h) * post (gemma3's
    norms after attention and feed-forward). Index 0 is the residual stream, 1 its normalised form.
    """
    _need_float("add_rms_norm", x, h)
    if x.shape != h.shape:
        raise _fail("add_rms_norm", "the stream and the added tensor differ in shape", x, h)
    _check_norm_weight("add_rms_norm", x, w)
    srcs = (x, h, w)
    if post is not None:
        _check_norm_weight("add_rms_norm", h, post)
        srcs += (post,)
    return _node("add_rms_norm", DType.F32, (2,) + x.shape, srcs, name, eps=float(eps))


def norm(a: Tensor, eps: float, name: str | None = None) -> Tensor:
    """(a - mean) / sqrt(var + eps) over the last axis."""
    return _unary("norm", a, name, eps=float(eps))


def _gated(op: str, gate: Tensor, up: Tensor, name: str | None) -> Tensor:
    _need_float(op, gate, up)
    if gate.shape != up.shape:
        raise _fail(op, "gate and up shapes differ", gate, up)
    return _node(op, DType.F32, gate.shape, (gate, up), name)


def swiglu(gate: Tensor, up: Tensor, name: str | None = None) -> Tensor:
    """silu(gate) * up, fused."""
    return _gated("swiglu", gate, up, name)


def swiglu_oai(gate: Tensor, up: Tensor, alpha: float, limit: float, name: str | None = None) -> Tensor:
    """gpt-oss's gated unit (ggml_swiglu_oai): x = min(gate, limit), x * sigmoid(alpha * x) *
    (clamp(up, -limit, limit) + 1), fused."""
    t = _gated("swiglu_oai", gate, up, name)
    t.params.update(alpha=float(alpha), limit=float(limit))
    return t


def geglu(gate: Tensor, up: Tensor, name: str | None = None, f16_table: bool = False) -> Tensor:
    """gelu(gate) * up, fused (f16_table as in gelu)."""
    t = _gated("geglu", gate, up, name)
    t.params["f16_table"] = f16_table
    return t


def mul_mat(a: Tensor, b: Tensor, name: str | None = None) -> Tensor:
    """ggml's mul_mat: a [..., M, K], b [..., N, K] -> [..., N, M] = b @ a^T.

    a's batch dimensions may divide b's (grouped-query attention: b's head h reads a's head
    h // (b_heads / a_heads)). a may be block-quantized (a weight as its file stores it, or the heads
    of a quantized K cache). A matrix split by rows over backends takes rowsplit.mul_mat instead.
    """
    if ROW_PARTS in a.params:
        raise _fail("mul_mat", "a matrix split by rows multiplies through core/rowsplit.py's mul_mat", a, b)
    if a.dtype.is_quantized:
        _need_float("mul_mat", b)
    else:
        _need_float("mul_mat", a, b)
    if len(a.shape) < 2 or len(b.shape) < 2 or a.shape[-1] != b.shape[-1]:
        raise _fail("mul_mat", "inner dimensions differ", a, b)
    ab, bb = a.shape[:-2], b.shape[:-2]
    if len(ab) > len(bb) or any(y % x for x, y in zip(reversed(ab), reversed(bb))):
        raise _fail("mul_mat", "batch dimensions of the first do not divide the second's", a, b)
    return _node("mul_mat", DType.F32, bb + (b.shape[-2], a.shape[-2]), (a, b), name)


def _check_weights(op: str, ws: tuple[Tensor, ...], b: Tensor) -> None:
    """b [N, K] f32/f16/bf16 and each w a 2-d weight [M, K] (block-quantized or float)."""
    if len(b.shape) != 2:
        raise _fail(op, "expects b [N, K]", b, *ws)
    _need_float(op, b)
    for w in ws:
        if len(w.shape) != 2 or w.shape[1] != b.shape[1]:
            raise _fail(op, "each weight must be [M, K] with b's K", w, b)
        if not w.dtype.is_quantized:
            _need_float(op, w)


def mul_mat_multi(ws: tuple[Tensor, ...], b: Tensor, names: tuple[str, ...], name: str | None = None) -> list[Tensor]:
    """mul_mat(w, b) of one b [N, K] with each 2-d weight w [M_i, K] of ws, in one node; returns the
    products [N, M_i] as views named `names`.

    The node's result holds the products one after another (flat f32 [N * sum M_i]), so that each
    view is contiguous whatever N is. It serves a layer that reads one activation with several
    matrices (attention's q, k and v; a feed-forward's gate and up): one kernel call instead of
    several, and the CPU quantizes b to 8-bit blocks once for all of them.
    """
    if not ws or len(names) != len(ws):
        raise _fail("mul_mat_multi", "expects one name per weight", b, *ws)
    _check_weights("mul_mat_multi", ws, b)
    n = b.shape[0]
    node = _node("mul_mat_multi", DType.F32, (n * sum(w.shape[0] for w in ws),), tuple(ws) + (b,), name)
    views, at = [], 0
    for w, part in zip(ws, names):
        views.append(view(node, (n, w.shape[0]), offset=at, name=part))
        at += n * w.shape[0] * 4
    return views


GLUS = ("swiglu", "geglu")


def mul_mat_glu(gate: Tensor, up: Tensor, b: Tensor, glu: str, f16_table: bool = False,
                name: str | None = None) -> Tensor:
    """A gated feed-forward's first half in one node: [N, M] f32 = glu(b @ gate^T, b @ up^T), where
    b is [N, K], gate and up are 2-d weights [M, K], and glu is "swiglu" (silu(g) * u) or "geglu"
    (gelu(g) * u; f16_table as in gelu).

    It equals mul_mat_multi((gate, up), b) followed by swiglu or geglu of its two views, bit for bit:
    it is that pair computed without the products living past the node (the CPU applies the GLU
    to each chunk of rows as soon as both products have it). Sources: (gate, up, b).
    """
    if glu not in GLUS:
        raise _fail("mul_mat_glu", f"glu must be one of {GLUS}, got {glu!r}", gate, up)
    _check_weights("mul_mat_glu", (gate, up), b)
    if gate.shape != up.shape:
        raise _fail("mul_mat_glu", "gate and up shapes differ", gate, up)
    return _node("mul_mat_glu", DType.F32, (b.shape[0], gate.shape[0]), (gate, up, b), name, glu=glu,
                 f16_table=bool(f16_table))


def _check_rope(op: str, a: Tensor, pos: Tensor, n_dims: int) -> None:
    _need_float(op, a)
    if len(a.shape) != 3 or pos.dtype is not DType.I32 or pos.shape != (a.shape[0],):
        raise _fail(op, "expects a [tokens, heads, dim] and i32 positions [tokens]", a, pos)
    if n_dims % 2 or n_dims > a.shape[2]:
        raise _fail(op, f"n_dims {n_dims} must be even and at most the head size", a)


@dataclass(frozen=True)
class Yarn:
    """YaRN's context extension of a RoPE (ggml_rope_ext's last parameters): dimensions that turn fast keep
    their angles, slow ones take the interpolated (freq_scale) angles, those between a ramp of both,
    between the corrections of beta_fast and beta_slow rotations over n_ctx_orig positions; cos and sin
    are scaled by attn_factor * (1 + 0.1 ln(1 / freq_scale)) where ext_factor is not 0."""

    ext_factor: float
    attn_factor: float
    beta_fast: float
    beta_slow: float
    n_ctx_orig: int


def _rope_yarn(yarn: Yarn | None) -> dict:
    return {} if yarn is None else {"yarn": yarn}


def _rope_norm(op: str, a: Tensor, norm: Tensor | None, eps: float) -> tuple[tuple[Tensor, ...], dict]:
    """The extra source and params of a RoPE that first RMS-normalises each head by `norm`."""
    if norm is None:
        return (), {}
    _check_norm_weight(op, a, norm)
    return (norm,), {"eps": float(eps)}


def rope(a: Tensor, pos: Tensor, n_dims: int, mode: int = ROPE_NORMAL, freq_base: float = 10000.0,
         freq_scale: float = 1.0, name: str | None = None, out_scale: float = 1.0,
         norm: Tensor | None = None, eps: float = 0.0, yarn: Yarn | None = None,
         factors: Tensor | None = None) -> Tensor:
    """Rotary position embedding of a [tokens, heads, head_dim] at positions pos [tokens] (i32).

    mode ROPE_NORMAL rotates adjacent pairs (llama); ROPE_NEOX rotates the two halves.
    Only the first n_dims of each head rotate. Fused around it: with `norm`, each head is first
    rms_norm'ed and multiplied by norm [head_dim] (gemma3's q/k norms); the result is multiplied
    by out_scale (gemma3 scales its queries right after RoPE). With `yarn`, YaRN's angles (Yarn).
    With `factors` (f32 [n_dims / 2], ggml_rope_ext's freq_factors: Phi-3's LongRoPE), pair i's angle
    is divided by factors[i]; they are the node's last source.
    """
    _check_rope("rope", a, pos, n_dims)
    extra, params = _rope_norm("rope", a, norm, eps)
    return _node("rope", DType.F32, a.shape, (a, pos) + extra + _rope_factors("rope", a, n_dims, factors), name,
                 n_dims=n_dims, mode=mode, freq_base=float(freq_base), freq_scale=float(freq_scale),
                 out_scale=float(out_scale), **params, **_rope_yarn(yarn), **_factors_param(factors))


def _rope_factors(op: str, a: Tensor, n_dims: int, factors: Tensor | None) -> tuple[Tensor, ...]:
    """The extra source of a RoPE whose angles are divided by frequency factors, checked."""
    if factors is None:
        return ()
    if factors.dtype is not DType.F32 or factors.shape != (n_dims // 2,):
        raise _fail(op, f"frequency factors must be f32 [{n_dims // 2}] (n_dims / 2)", a, factors)
    return (factors,)


def _factors_param(factors: Tensor | None) -> dict:
    """The param that says a RoPE's last source is its frequency factors."""
    return {} if factors is None else {"factors": True}


def rope_set_rows(dst: Tensor, a: Tensor, idx: Tensor, pos: Tensor, n_dims: int, mode: int = ROPE_NORMAL,
                  freq_base: float = 10000.0, freq_scale: float = 1.0, name: str | None = None,
                  norm: Tensor | None = None, eps: float = 0.0, yarn: Yarn | None = None) -> Tensor:
    """rope(a, pos, ..., norm, eps) of a [tokens, heads, head_dim], each token's heads written as one
    row of dst [rows, heads * head_dim] at row idx[token]: the keys' RoPE fused with the KV cache
    write. Returns dst's view for later readers, as set_rows does."""
    _check_rope("rope_set_rows", a, pos, n_dims)
    if idx.dtype is not DType.I32 or idx.shape != (a.shape[0],):
        raise _fail("rope_set_rows", "row indices must be i32 [tokens]", a, idx)
    if len(dst.shape) != 2 or dst.shape[1] != a.shape[1] * a.shape[2]:
        raise _fail("rope_set_rows", "dst rows must hold one token's heads", dst, a)
    extra, params = _rope_norm("rope_set_rows", a, norm, eps)
    t = _view_of("rope_set_rows", dst, dst.shape, dst.strides, 0, name)
    t.srcs = (dst, a, idx, pos) + extra
    t.params.update(n_dims=n_dims, mode=mode, freq_base=float(freq_base), freq_scale=float(freq_scale), **params,
                    **_rope_yarn(yarn))
    return t


def rope_shift(dst: Tensor, shift: Tensor, head_dim: int, n_dims: int, mode: int = ROPE_NORMAL,
               freq_base: float = 10000.0, freq_scale: float = 1.0, name: str | None = None,
               yarn: Yarn | None = None, factors: Tensor | None = None) -> Tensor:
    """Re-rotate every row of a block-quantized K cache dst [rows, heads * head_dim] in place by its
    position delta shift[row] (i32): decoded to f32, RoPE, quantized back (llama.cpp's K-shift of a
    quantized cache). Returns dst's view for later readers, as set_rows does. `factors` as rope's."""
    if not dst.dtype.is_quantized or len(dst.shape) != 2 or dst.shape[1] % head_dim:
        raise _fail("rope_shift", "expects a block-quantized cache [rows, heads * head_dim]", dst)
    if shift.dtype is not DType.I32 or shift.shape != (dst.shape[0],):
        raise _fail("rope_shift", "shifts must be i32 [rows]", dst, shift)
    if n_dims % 2 or n_dims > head_dim:
        raise _fail("rope_shift", f"n_dims {n_dims} must be even and at most the head size", dst)
    t = _view_of("rope_shift", dst, dst.shape, dst.strides, 0, name)
    t.srcs = (dst, shift) + _rope_factors("rope_shift", dst, n_dims, factors)
    t.params.update(head_dim=head_dim, n_dims=n_dims, mode=mode, freq_base=float(freq_base),
                    freq_scale=float(freq_scale), **_rope_yarn(yarn), **_factors_param(factors))
    return t


def soft_max(a: Tensor, mask: Tensor | None = None, scale: float = 1.0, name: str | None = None,
             sinks: Tensor | None = None) -> Tensor:
    """softmax(a * scale + mask) over the last axis; mask [rows >= a's rows, cols] broadcasts over heads.
    With sinks f32 [heads] (a [heads, rows, cols]; gpt-oss's attention sinks, ggml_soft_max_add_sinks), head
    h's rows are normalised as if each held one more logit, sinks[h], whose share is dropped."""
    _need_float("soft_max", a)
    srcs: tuple[Tensor, ...] = (a,)
    if mask is not None:
        _need_float("soft_max", mask)
        if len(mask.shape) != 2 or mask.shape[1] != a.shape[-1] or mask.shape[0] < a.shape[-2]:
            raise _fail("soft_max", "mask must be [rows >= a's rows, a's last dim]", a, mask)
        srcs = (a, mask)
    if sinks is None:
        return _node("soft_max", DType.F32, a.shape, srcs, name, scale=float(scale))
    if mask is None or sinks.dtype is not DType.F32 or len(a.shape) != 3 or sinks.shape != (a.shape[0],):
        raise _fail("soft_max", "sinks must be f32 [heads] of a [heads, rows, cols], with a mask", a, sinks)
    return _node("soft_max", DType.F32, a.shape, srcs + (sinks,), name, scale=float(scale), sinks=True)


def kq_mask(cell_pos: Tensor, cell_seqs: Tensor, tok_pos: Tensor, tok_seq: Tensor, window: int | None = None,
            name: str | None = None) -> Tensor:
    """f16 [tokens, cells]: the KQ mask of a micro-batch made from the cache's cells, where attention runs,
    instead of filled on the host: 0 where token t may see cell c (c holds t's sequence, at a position from 0
    up to t's own, and with a window fewer than `window` positions back), else -inf. A token of sequence -1
    (a padding row, core/llm/buckets.py) sees cell 0 only.

    cell_pos i32 [cells] holds each cell's position (-1 free); cell_seqs i32 [cells, words] each cell's
    sequences as bits (sequence s: bit s % 32 of word s // 32); tok_pos and tok_seq i32 [tokens]. A step of
    many sequences sends these (a few bytes a cell) rather than a mask of tokens x cells, which the host
    took milliseconds to fill for 64 sequences.
    """
    if cell_pos.dtype is not DType.I32 or len(cell_pos.shape) != 1:
        raise _fail("kq_mask", "expects i32 cell positions [cells]", cell_pos)
    if cell_seqs.dtype is not DType.I32 or len(cell_seqs.shape) != 2 or cell_seqs.shape[0] != cell_pos.shape[0]:
        raise _fail("kq_mask", "expects i32 sequence bits [cells, words] beside the positions", cell_pos, cell_seqs)
    if any(t.dtype is not DType.I32 or t.shape != tok_pos.shape or len(t.shape) != 1 for t in (tok_pos, tok_seq)):
        raise _fail("kq_mask", "expects i32 token positions and sequences [tokens]", tok_pos, tok_seq)
    return _node("kq_mask", DType.F16, (tok_pos.shape[0], cell_pos.shape[0]), (cell_pos, cell_seqs, tok_pos, tok_seq),
                 name, window=int(window or 0))


def argmax(a: Tensor, name: str | None = None) -> Tensor:
    """i32 [rows]: each row's index of its largest value in a f32 [rows, n] (the first of equal maxima, as
    np.argmax), or -1 where the row holds NaN or infinity.

    Greedy sampling where the logits are computed: only the ids travel back. The -1 rule keeps the
    numerics guard: argmax would pick some token from non-finite logits, which must stop decoding instead.
    """
    if a.dtype is not DType.F32 or len(a.shape) != 2 or a.shape[1] < 1:
        raise _fail("argmax", "expects f32 rows [rows, n >= 1]", a)
    return _node("argmax", DType.I32, (a.shape[0],), (a,), name)


SAMPLE_ON_HOST = -2  # ops.sample's mark of a row a backend's kernel leaves to the host (see there)
SAMPLE_PARAMS = ("temp", "top_k", "top_p", "min_p", "repeat_penalty", "frequency_penalty", "presence_penalty")


def sample(logits: Tensor, params: Tensor, draws: Tensor, recent: Tensor, bias_ids: Tensor, bias_vals: Tensor,
           name: str | None = None) -> Tensor:
    """i32 [rows]: a token drawn from each row of f32 logits [rows, n] by llama.cpp's sampler chain (logit
    bias, penalties, top-k, top-p, min-p, temperature, then the draw; the argmax at temperature 0), or -1
    where the row holds NaN or infinity (the numerics guard, as ops.argmax).

    params f32 [rows, 7] holds each row's SAMPLE_PARAMS; draws i32 [rows, 2] the bits of each row's
    uniform draw in [0, 1) as a float64 (a seeded generator's, made by the caller); recent i32 [rows, W]
    the tokens the penalties count (-1: none); bias_ids i32 and bias_vals f32 [rows, NB] the logit bias
    (id -1: none). Sampling where the logits are computed: only the ids travel back. A backend's kernel may
    mark a row SAMPLE_ON_HOST (-2) where it does not serve that row's settings (the GPU's: more top-k
    candidates than it sorts); the caller then samples that row from its logits.
    """
    rows = logits.shape[0] if len(logits.shape) == 2 else -1
    if logits.dtype is not DType.F32 or rows < 0 or logits.shape[1] < 1:
        raise _fail("sample", "expects f32 logits [rows, n >= 1]", logits)
    for t, dtype, cols in ((params, DType.F32, len(SAMPLE_PARAMS)), (draws, DType.I32, 2), (recent, DType.I32, None),
                           (bias_ids, DType.I32, None), (bias_vals, DType.F32, None)):
        if t.dtype is not dtype or len(t.shape) != 2 or t.shape[0] != rows or (cols is not None and t.shape[1] != cols):
            raise _fail("sample", f"expects {dtype} [{rows}, {cols or 'k'}] beside the logits", logits, t)
    if bias_ids.shape != bias_vals.shape:
        raise _fail("sample", "bias ids and values must have one shape", bias_ids, bias_vals)
    return _node("sample", DType.I32, (rows,), (logits, params, draws, recent, bias_ids, bias_vals), name)


def sample_logprobs(logits: Tensor, ids: Tensor, n_probs: int, name: str | None = None) -> Tensor:
    """f32 [rows, 1 + 2 n_probs]: for each row of f32 logits [rows, n], the log-probability of token ids[row]
    (i32 [rows], as ops.sample draws them) under the model's distribution (the log-softmax of the raw logits,
    what llama.cpp's server reports with n_probs), then the n_probs likeliest tokens as (id, log-probability)
    pairs, likeliest first (equal logits: lower id first; ids are exact in f32). A row whose id is negative
    (ops.sample's marks) gets NaN for its own entry. Only these values travel back, not the logits."""
    rows = logits.shape[0] if len(logits.shape) == 2 else -1
    if logits.dtype is not DType.F32 or rows < 0 or not 0 <= n_probs <= logits.shape[1]:
        raise _fail("sample_logprobs", f"expects f32 logits [rows, n >= n_probs] (n_probs = {n_probs})", logits)
    if ids.dtype is not DType.I32 or ids.shape != (rows,):
        raise _fail("sample_logprobs", f"expects i32 ids [{rows}] beside the logits", logits, ids)
    return _node("sample_logprobs", DType.F32, (rows, 1 + 2 * n_probs), (logits, ids), name, n_probs=int(n_probs))


def moe_topk(probs: Tensor, k: int, name: str | None = None) -> Tensor:
    """i32 [tokens, k]: each row's k largest entries of probs f32 [tokens, n_expert], largest first (ggml's
    argsort_top_k): the experts a mixture-of-experts layer routes each token to."""
    if probs.dtype is not DType.F32 or len(probs.shape) != 2 or not 1 <= k <= probs.shape[1]:
        raise _fail("moe_topk", f"expects f32 [tokens, n_expert >= k] (k = {k})", probs)
    return _node("moe_topk", DType.I32, (probs.shape[0], k), (probs,), name, k=int(k))


def moe_weights(probs: Tensor, ids: Tensor, norm: bool, name: str | None = None) -> Tensor:
    """f32 [tokens, k]: probs [tokens, n_expert] at each token's chosen experts ids [tokens, k]; with norm,
    divided by their sum (at least 2^-14, as llama.cpp clamps it): the weights of the experts' outputs."""
    if ids.dtype is not DType.I32 or len(ids.shape) != 2 or ids.shape[0] != probs.shape[0]:
        raise _fail("moe_weights", "expects ids i32 [tokens, k] for probs [tokens, n_expert]", probs, ids)
    return _node("moe_weights", DType.F32, ids.shape, (probs, ids), name, norm=bool(norm))


def mul_mat_id(w: Tensor, b: Tensor, ids: Tensor, name: str | None = None) -> Tensor:
    """ggml's mul_mat_id: out[t, j] = w[ids[t, j]] @ b[t, j] for the experts' matrices w [n_expert, M, K]
    (block-quantized or float), b [tokens, 1 or k, K] (one row for every slot, or one per slot) and
    ids i32 [tokens, k]; the result is [tokens, k, M]. Only the chosen experts' matrices are read."""
    if len(w.shape) != 3 or len(b.shape) != 3 or w.shape[2] != b.shape[2]:
        raise _fail("mul_mat_id", "expects w [n_expert, M, K] and b [tokens, 1 or k, K]", w, b)
    if ids.dtype is not DType.I32 or len(ids.shape) != 2 or ids.shape[0] != b.shape[0] \
            or b.shape[1] not in (1, ids.shape[1]):
        raise _fail("mul_mat_id", "ids must be i32 [tokens, k] with b [tokens, 1 or k, K]", b, ids)
    _need_float("mul_mat_id", b)
    if not w.dtype.is_quantized:
        _need_float("mul_mat_id", w)
    return _node("mul_mat_id", DType.F32, (ids.shape[0], ids.shape[1], w.shape[1]), (w, b, ids), name)


def flash_attn(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float, name: str | None = None,
               sinks: Tensor | None = None) -> Tensor:
    """Fused attention: softmax(q k^T * scale + mask) v without materialising the scores.

    q [heads, tokens, dim], k and v [heads_kv, n_kv, dim] (heads_kv divides heads; either may be a
    block-quantized cache's heads), mask [rows >= tokens, n_kv]; the result is [tokens, heads, dim],
    ready to merge heads. With sinks f32 [heads] (gpt-oss's attention sinks, ggml_flash_attn_ext_add_sinks),
    as soft_max's: head h's rows are normalised as if each held one more logit, sinks[h], with no value.
    """
    _need_float("flash_attn", q, mask)
    _need_float("flash_attn", *(t for t in (k, v) if not t.dtype.is_quantized))
    hq, t, d = q.shape
    hk, n_kv, dk = k.shape
    if len(q.shape) != 3 or k.shape != v.shape or d != dk or hq % hk:
        raise _fail("flash_attn", "expects q [heads, tokens, dim] and k, v [heads_kv, n_kv, dim]", q, k, v)
    if len(mask.shape) != 2 or mask.shape[1] != n_kv or mask.shape[0] < t:
        raise _fail("flash_attn", "mask must be [rows >= tokens, n_kv]", q, mask)
    if sinks is None:
        return _node("flash_attn", DType.F32, (t, hq, d), (q, k, v, mask), name, scale=float(scale))
    if sinks.dtype is not DType.F32 or sinks.shape != (hq,):
        raise _fail("flash_attn", "sinks must be f32 [heads] of q [heads, tokens, dim]", q, sinks)
    return _node("flash_attn", DType.F32, (t, hq, d), (q, k, v, mask, sinks), name, scale=float(scale), sinks=True)


def copy_to(src: Tensor, name: str | None = None) -> Tensor:
    """A scheduler copy: src's elements, contiguous, to be placed on another backend. It keeps
    the source's `act_quant`, so a product computes the same on either side."""
    t = _node("copy", src.dtype, src.shape, (src,), name or f"{src.name}#copy")
    if "act_quant" in src.root.params:
        t.params["act_quant"] = src.root.params["act_quant"]
    return t
