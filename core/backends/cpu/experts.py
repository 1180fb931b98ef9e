"""The CPU kernels of a mixture of experts: the router's top-k and weights (moe_topk, moe_weights), and the
experts' products (mul_mat_id) with block-quantized expert matrices under llama numerics. For those, the
activation rows are quantized once to the 8-bit blocks the type's integer kernels read (one row a token for the
gate and up products, one a slot for the down product), grouped by expert (quant/routing.py), and every chosen
expert's rows are dotted with its rows, split over the threads, as ggml's CPU mul_mat_id does; only the chosen
experts' blocks are read. The results come back in the pairs' places. Experts repacked at load (the r16 and r8
layouts: matmul.experts_repacked) are read by those layouts' kernels, the rest as stored.

Other expert matrices (float types, f32 numerics) take the reference kernel.
"""
from __future__ import annotations

import numpy as np

from ggrun.core.backends.cpu import lut4 as L4
from ggrun.core.backends.cpu.dispatch import binds
from ggrun.core.backends.cpu.jit import kernel
from ggrun.core.backends.cpu.matmul import own_act, repacked_rows, split_chunks
from ggrun.core.backends.cpu.quant import activations, avx2, avx2_r8, avx512, codes, lut4_avx2, portable
from ggrun.core.backends.cpu.warmup import experts, readonly, warms
from ggrun.core.dtypes import DType
from ggrun.core.quants import vec_dot_blocks
from ggrun.core.tensor import Tensor


def _shape(node: Tensor) -> tuple[int, int, int, int, int, int, int] | None:
    """(experts, M, K, tokens, slots, activation rows, act blocks) of a mul_mat_id the compiled kernels take, else
    None."""
    w, b, _ = node.srcs
    if w.dtype not in codes.CODES or not w.dtype.is_quantized or b.dtype is not DType.F32:
        return None
    n_expert, m, k = w.shape
    tokens, slots, _ = node.shape
    act = own_act(w, k)
    if act is None or tokens * slots == 0:
        return None
    return n_expert, m, k, tokens, slots, tokens * b.shape[1], act


def _parts(node: Tensor) -> list[int]:
    """Byte sizes of the scratch's parts: the route (starts, used, order), the quantized rows as fed and as
    grouped, the grouped products."""
    n_expert, m, k, tokens, slots, rows, _ = _shape(node)
    pairs = tokens * slots
    return [codes.round64(4 * (n_expert + 1)), codes.round64(4 * (n_expert + 1)), codes.round64(4 * pairs),
            codes.act_arrays_bytes(rows, k), codes.act_arrays_bytes(pairs, k), codes.round64(4 * pairs * m)]


def _scratch(node: Tensor) -> int:
    return sum(_parts(node)) if _shape(node) is not None else 0


def _views(scratch: np.ndarray, node: Tensor) -> tuple:
    """The scratch's parts as the kernels take them: route, xq, gq, og."""
    n_expert, m, k, tokens, slots, rows, _ = _shape(node)
    at, views = 0, []
    for size in _parts(node):
        views.append(scratch[at:at + size])
        at += size
    route = (views[0].view(np.int32)[:n_expert + 1], views[1].view(np.int32)[:n_expert + 1],
             views[2].view(np.int32)[:tokens * slots])
    xq, gq = codes.act_arrays(views[3], rows, k), codes.act_arrays(views[4], tokens * slots, k)
    return route, xq, gq, views[5].view(np.float32)[:tokens * slots * m].reshape(tokens * slots, m)


def _driver(w: Tensor, stored: np.ndarray, shape: tuple, vector: bool) -> tuple:
    """The expert driver of the type's row kernels at this host's level, and its weight arguments (those before
    ids): the experts' repacked groups (matmul.experts_repacked; r16 or r8 kernels) and the groups an expert, or
    the stored rows."""
    n_expert, m, k = shape[:3]
    packed = repacked_rows(w, n_expert * m, k)
    if isinstance(packed, np.ndarray):
        driver = avx512.mul_mat_id_r16 if codes.SIMD == "avx512" else avx2_r8.mul_mat_id_r8
        return driver, (packed, packed.shape[0] // n_expert)
    stored = stored.view()
    stored.flags.writeable = False  # as a memory map gives them: one compiled signature for models and tests
    if w.dtype in L4.TYPES:
        return (lut4_avx2.mul_mat_id_q8 if vector else L4.mul_mat_id_q8), (stored,)
    return (avx2.mul_mat_id_q8_avx2 if vector else portable.mul_mat_id_q8_portable), (stored,)


@binds("mul_mat_id", scratch=_scratch)
def bind_mul_mat_id(node: Tensor, out, srcs: list, scratch):
    shape = _shape(node)
    if shape is None:
        return None
    w, b, ids = srcs
    n_expert, m, k, tokens, slots, rows, act = shape
    if scratch is None or scratch.nbytes < _scratch(node) or w.ndim != 3 or not w.flags.c_contiguous:
        return None
    if not (b.flags.c_contiguous and out.flags.c_contiguous and ids.flags.c_contiguous):
        return None
    route, xq, gq, og = _views(scratch, node)
    x2, out2 = b.reshape(rows, k), out.reshape(tokens * slots, m)
    vector = codes.SIMD != "generic"
    quantize = activations.quantize_rows_avx2 if vector else activations.quantize_rows
    driver, weight = _driver(node.srcs[0], w, shape, vector)
    code = codes.CODES[node.srcs[0].dtype]
    chunks = split_chunks(tokens * slots * m * node.srcs[0].dtype.row_bytes(k))
    per_slot = b.shape[1] > 1

    def call() -> None:
        quantize(act, x2, *xq)
        driver(code, *weight, ids, per_slot, route, xq, gq, og, out2, chunks)
    return call



@kernel
def top_k_rows(probs, out) -> None:
    """out[t] = the indices of probs[t]'s out.shape[1] largest values, largest first, the lower index first among
    equal values (a stable descending sort's order, as the reference kernel's argsort): each pick is the largest
    of the entries ranked below the previous pick."""
    for t in range(probs.shape[0]):
        row = probs[t]
        prev = -1
        for j in range(out.shape[1]):
            best = -1
            for e in range(row.shape[0]):
                v = row[e]
                if prev >= 0 and not (v < row[prev] or (v == row[prev] and e > prev)):
                    continue
                if best < 0 or v > row[best]:
                    best = e
            out[t, j] = best
            prev = best


@kernel
def chosen_weights(probs, ids, norm, out) -> None:
    """out[t, j] = probs[t, ids[t, j]]; with norm, divided by their sum (in f64, then f32, at least 2^-14 as
    llama.cpp clamps it)."""
    for t in range(ids.shape[0]):
        total = 0.0
        for j in range(ids.shape[1]):
            e = ids[t, j]
            if e < 0 or e >= probs.shape[1]:
                raise IndexError("moe_weights: expert id out of range")
            out[t, j] = probs[t, e]
            total += out[t, j]
        if norm:
            d = max(np.float32(total), np.float32(6.103515625e-5))
            for j in range(ids.shape[1]):
                out[t, j] = out[t, j] / d


@binds("moe_topk")
def bind_moe_topk(node: Tensor, out, srcs: list, scratch):
    probs = srcs[0]
    if not (probs.flags.c_contiguous and out.flags.c_contiguous and probs.dtype == np.float32):
        return None
    return lambda: top_k_rows(probs, out)


@binds("moe_weights")
def bind_moe_weights(node: Tensor, out, srcs: list, scratch):
    probs, ids = srcs
    if not all(a.flags.c_contiguous for a in (probs, ids, out)) or probs.dtype != np.float32:
        return None
    norm = bool(node.params["norm"])
    return lambda: chosen_weights(probs, ids, norm, out)


# ---- first-run compilation: a decode step's and a prompt's experts of each block type -------------------

def _warm_experts(lf, dtype: DType, per_slot: bool):
    """Two tokens' products with two of four experts (read-only zero blocks, as a memory map gives them, repacked
    where the host repacks such experts), one activation row a token (gate, up) or a slot (down), plus their rows
    of a bias, gpt-oss's gated unit; then the router's softmax (no mask), top-k and weights."""
    from ggrun.core import ops

    k, m = 256, 16
    raw = np.zeros(4 * m * dtype.row_bytes(k), np.uint8)
    raw.flags.writeable = False
    w = lf.ctx.from_bytes(f"experts_{dtype}", dtype, (4, m, k), raw)
    w.params["act_quant"] = vec_dot_blocks(dtype.name)
    lf.ctx.prepare_weight(w)  # repacked where a model's experts are (matmul.experts_repacked)
    x = lf.input("x", np.ones((2, 2 if per_slot else 1, k), np.float32))
    ids = lf.input("ids", np.array([[0, 3], [1, 3]], np.int32))
    bias = readonly(lf, "bias", DType.F32, np.ones((4, m), np.float32))
    y = ops.mul_mat_id(w, x, ids)  # then gpt-oss's experts add their rows of a bias (blocks.expert_product)
    y = ops.add(y, ops.reshape(ops.get_rows(bias, ops.reshape(ids, (4,))), y.shape))
    y = ops.swiglu_oai(y, y, 1.702, 7.0)  # gpt-oss's gated unit
    probs = ops.soft_max(ops.reshape(y, (2, 2 * m)))  # as the router's softmax: no mask
    return ops.moe_weights(probs, ops.moe_topk(probs, 2), norm=True)


for _dtype in codes.CODES:
    if _dtype.is_quantized:
        for _per_slot in (False, True):
            warms(lambda lf, d=_dtype, p=_per_slot: _warm_experts(lf, d, p), needs={experts(_dtype)})
