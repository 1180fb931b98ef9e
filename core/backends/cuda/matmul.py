"""Which CUDA kernels run `mul_mat`, `mul_mat_multi`, `mul_mat_glu` and `get_rows`.

A weight (a 2-d tensor in any stored type; `mul_mat_multi`: several weights, one after another in
the result) times up to GEMV_MAX_ROWS token rows: the legacy block
types quantize the activations to q8_1 blocks in the node's scratch and take integer dot products
(mmvq, as ggml's CUDA backend); other types decode their blocks inside the product (gemv). Up to
MMQ_MAX_ROWS token rows of a type with a scale per 32 weights: the q8_1 activations meet the weights'
quants on int8 tensor cores (mmq, as ggml's), reading each weight once. Wide weights up to MMQT_MAX_ROWS
(decode steps of many sequences; _mt_serves): the same products in ggml's tile layout (mmqt: a block
of 32 or 64 weight rows by 16..128 token rows, each chunk of K's weights and activations staged in
shared memory once for all its warps; the tile chosen to fill the GPU, _mt_tile), up to three weights of
one type in one launch. More token rows, or other types: the weight is decoded to f16 one tile of rows
at a time into scratch and multiplied by cuBLAS (f32 accumulation; through blas.py, which CUDA graphs
capture), the activations converted to f16 once; an F32 weight is multiplied as it is, in f32. Products of
two float operands (attention without the fused op) run a plain strided kernel. A decode product's kernel also does the bias add after it (bias_adds.py; mmvq_bias, gemv_bias).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
from cupy.cuda import cublas

from ggrun.core.backends.bias_adds import part_bias
from ggrun.core.backends.cuda import blas
from ggrun.core.backends.cuda.binding import (NULL, Launch, Step, binds, estrides, f32, fuses, grid1d, i32, i64,
                                              launch_step, ptr, rows_of, writes_apart)
from ggrun.core.backends.cuda.handoff import Q8_1_BYTES, SLOT_BYTES
from ggrun.core.backends.cuda.launch import TICKETS, multiprocessors
from ggrun.core.backends.cuda.module import (DP4A_TYPES, FLOATS, GEMV_COLS, GLU_ACTS, MMQ_TILES, MMQ_TYPES, MT_TILES,
                                             NO_WEIGHT, TYPE_IDS, kernel)
from ggrun.core.backends.cuda.ops import rope_params, rope_qkv, weight_id
from ggrun.core.ops import ROPE_NEOX
from ggrun.core.dtypes import DType
from ggrun.core.tensor import Tensor

GEMV_MAX_ROWS = 8
MMQ_MAX_ROWS = 16  # token rows up to which mmq serves (past GEMV_MAX_ROWS): on an H200 (llama-1b Q4_0) a decode
# step of 16 sequences went 4,142 -> 4,826 t/s; at 32 and 64 rows decoding to f16 for cuBLAS was faster (-5%, -21%)
# Where mmqt serves, from scripts/bench/bench_mmq_gpu.py on an H200 (llama-1b Q4_0's products, us, mmq / mmqt with
# K split where _mt_split says / f16 tiles and cuBLAS, at 16, 32 and 64 rows): it wins on wide weights (height M at
# least MT_WIDTH times K: q, k and v 3072 x 2048 31/26/42, 40/27/42, 66/27/45; gate and up 16384 x 2048 51/33/65,
# 68/38/67, 129/55/73) and, K split, on tall ones up to MT_TALL_ROWS (ffn_out 2048 x 8192 39/27/40, 44/38/41; at 64
# rows 74/52/42); square ones go to mmq (attn_out 2048 x 2048 at 16 rows 16/27/22) or cuBLAS. At 128 rows cuBLAS
# wins gate and up (74 against 86).
MMQT_MAX_ROWS = 64  # token rows up to which mmqt serves (decode steps of many sequences)
MT_WIDTH = 1.5  # M / K from which mmqt serves
MT_TALL_ROWS = 32  # token rows up to which it serves weights at most half as high as K too (split K)
MT_MAX_SPLIT = 8  # shares of K an mmqt product is split into at most (tall weights: split K)
MT_SPLIT_CHUNKS = 4  # K's chunks of MT_KB blocks (1024 columns) a share takes at least
MT_SPLIT_BELOW = 1.5  # blocks per multiprocessor under which K is split (q, k and v at 64 rows: 192 blocks, 34 -> 27
# us; gate and up at 12 rows: 256 blocks, 33 -> 38 us split, the shares' sums 2 x 12 x 16384 floats)
MQ_WARPS = 8  # warps of an mmq block (matmul.cu)
MT_KB, MT_QLD = 8, 8 * 32 + 16  # mmqt's q8_1 blocks a chunk and bytes of a token's staged quants (matmul.cu)
MT_SMEM3 = 112 << 10  # bytes up to which mmqt's stages are three
MT_BN = (16, 32, 64, 128)  # token rows an mmqt block can take
SUM_Q = ("Q4_K", "Q5_K")  # types whose mins meet the sum of the int8 activations (matmul.cu's MqSumQ)
TILE_BYTES = 32 << 20  # f16 bytes of one decoded weight tile
WARPS = 4
CUDA_R_16F, CUDA_R_32F, CUBLAS_COMPUTE_32F = 2, 0, 68
_ONE, _ZERO = np.ones(1, np.float32), np.zeros(1, np.float32)


@dataclass(frozen=True)
class Part:
    """One weight of a product node: its type and blocks, its height m, the address its product [N, m] goes
    to, and where a bias add after the product is fused in (_product_bias), the bias vector's address and
    where the biased product [N, m] goes (0: none)."""

    qt: DType
    arr: object
    m: int
    out_at: int
    bias: int = 0
    biased_at: int = 0


def _weights(node: Tensor) -> list[Tensor]:
    """The weights a product node multiplies the activations (its last source) by."""
    return list(node.srcs[:-1])


def _weight_case(node: Tensor) -> tuple[list[int], int, int] | None:
    """([M of each weight], K, N) of a weight product this module runs, else None."""
    b = node.srcs[-1]
    ws = _weights(node)
    if b.dtype is not DType.F32:
        return None
    for w in ws:
        if len(w.shape) != 2 or w.dtype.name not in TYPE_IDS or not w.is_contiguous:
            return None
        if w.dtype.is_quantized and w.shape[1] % w.dtype.block_size:
            return None
    k = b.shape[-1]
    return [w.shape[0] for w in ws], k, int(np.prod(b.shape[:-1], dtype=np.int64))


def _tile_rows(m: int, k: int) -> int:
    return min(m, max(256, TILE_BYTES // (2 * k) // 256 * 256))


def _quantizes(node: Tensor, k: int) -> bool:
    """Whether the decode path reads q8_1 activations (some weight takes the __dp4a product)."""
    return k % 32 == 0 and any(w.dtype.name in DP4A_TYPES for w in _weights(node))


def _scratch(node: Tensor) -> int:
    case = _weight_case(node)
    if case is None:
        return 0
    ms, k, n = case
    if n <= GEMV_MAX_ROWS:
        return n * (k // 32) * Q8_1_BYTES if _quantizes(node, k) else 0
    if _mmq_serves(node, k, n):
        return n * (k // 32) * Q8_1_BYTES
    if _mt_serves(node, k, n):
        parts = [Part(w.dtype, None, w.shape[0], 0) for w in _weights(node)]
        shares = max(_mt_split([p.m for p in g], n, k) * sum(p.m for p in g) for g in _same_type_groups(parts))
        return _up16(mt_bytes(n, k, [w.dtype for w in _weights(node)])) + shares * n * 4
    return (max(_tile_rows(m, k) for m in ms) + n) * k * 2


def _mmq_serves(node: Tensor, k: int, n: int) -> bool:
    """Whether mmq runs the product: a few dozen token rows, every weight of a type it reads, not wide enough for
    mmqt (_mt_serves)."""
    return (GEMV_MAX_ROWS < n <= MMQ_MAX_ROWS and k % 32 == 0
            and all(w.dtype.name in MMQ_TYPES for w in _weights(node)) and not _mt_serves(node, k, n))


def _mt_serves(node: Tensor, k: int, n: int) -> bool:
    """Whether mmqt runs the product: past mmvq's token rows up to MMQT_MAX_ROWS, every weight of a type it reads,
    the weights together at least MT_WIDTH times as high as K, or up to MT_TALL_ROWS at most half as high."""
    if not (GEMV_MAX_ROWS < n <= MMQT_MAX_ROWS and k % 32 == 0
            and all(w.dtype.name in MMQ_TYPES for w in _weights(node))):
        return False
    height = sum(w.shape[0] for w in _weights(node))
    return height >= MT_WIDTH * k or (n <= MT_TALL_ROWS and 2 * height <= k)


def _up16(n: int) -> int:
    return -(-n // 16) * 16


def mt_bytes(n: int, k: int, types: list[DType]) -> int:
    """Scratch of mt_quantize's activations for n rows of k: the int8 quants, then the scales with the blocks' sums
    and / or with the k-quants' sum term (the types multiplied say which), 16 bytes of slack to align them."""
    kinds = len({t.name in SUM_Q for t in types})
    return 16 + _up16(n * k) + kinds * _up16(n * (k // 32) * 8)


def mt_quantize(b, ldb: int, at: int, k: int, n: int, types: list[DType]) -> tuple[Launch, int, dict[bool, int]]:
    """The activations b [n, k] (row stride ldb) quantized for mmqt / mmq_idt into scratch at `at` (mt_bytes): the
    launch, the quants' address and the scales' by whether the type's mins meet the int8s' sum (SUM_Q)."""
    q = _up16(at)
    s_at = q + _up16(n * k)
    scales = {}
    for sum_q in sorted({t.name in SUM_Q for t in types}):
        scales[sum_q] = s_at
        s_at += _up16(n * (k // 32) * 8)
    blocks = n * (k // 32)
    args = (ptr(b), np.uint64(q), np.uint64(scales.get(False, 0)), np.uint64(scales.get(True, 0)), i32(k), i64(ldb),
            i32(n))
    return Launch(kernel("matmul.cu", "mt_quantize"), (-(-blocks // 8),), (256,), args), q, scales


def mt_smem(qt: DType, wm: int, nt: int) -> int:
    """Dynamic shared memory of an mmqt / mmq_idt block (matmul.cu's Mt: two or three stages of weights, quants and
    scales)."""
    span = qt.type_size if qt.block_size == 256 else MT_KB * qt.type_size
    ld = 16 * (((span + 30) // 16) | 1)
    bm, bn = 16 * wm, 8 * nt * (8 // wm)
    stage = bm * ld + bn * MT_QLD + MT_KB * bn * 8
    return (3 if 3 * stage <= MT_SMEM3 else 2) * stage


def mt_kernel(name: str, qt: DType, wm: int, nt: int):
    """mmqt / mmq_idt for type qt and tile (wm, nt), allowed the dynamic shared memory it takes."""
    fn = kernel("matmul.cu", f"{name}<{TYPE_IDS[qt.name]}, {wm}, {nt}>")
    smem = mt_smem(qt, wm, nt)
    if fn.max_dynamic_shared_size_bytes < smem:
        fn.max_dynamic_shared_size_bytes = smem
    return fn, smem


def _mt_tile(ms: list[int], n: int) -> tuple[int, int, int]:
    """(WM, NT, BN) of mmqt for weights of heights ms and n token rows. A warp of a larger NT decodes each weight
    fragment for more products, and a block of more rows reads the activations fewer times; of the tiles no wider than
    n needs (up to 128 token rows, more in grid rows), the largest that still gives every multiprocessor a block,
    else the one of the most blocks (small weights: a few long blocks would leave most of the GPU idle)."""
    need = next((b for b in MT_BN if n <= b), MT_BN[-1])
    best = None
    for wm, nt in sorted(MT_TILES, key=lambda t: (-t[1], -t[0])):  # products a decoded fragment feeds, first
        bn = 8 * nt * (8 // wm)
        if bn > need:
            continue
        blocks = sum(-(-m // (16 * wm)) for m in ms) * -(-n // bn)
        if blocks >= multiprocessors():
            return wm, nt, bn
        if best is None or blocks > best[0]:
            best = (blocks, wm, nt, bn)
    return best[1:]


def _mt_split(ms: list[int], n: int, k: int) -> int:
    """Shares of K an mmqt launch for weights of heights ms and n token rows is split into: one, unless its tiles
    (_mt_tile) are under MT_SPLIT_BELOW blocks a multiprocessor, as tall weights' few tiles are (ffn_out, 2048 x 8192:
    64 tiles each walking 32 chunks); then enough to fill the GPU's block slots (two a multiprocessor), each share of
    at least MT_SPLIT_CHUNKS chunks, and no more tiles than the tickets that elect each tile's last block."""
    wm, _, bn = _mt_tile(ms, n)
    blocks = sum(-(-m // (16 * wm)) for m in ms) * -(-n // bn)
    chunks = -(-k // (32 * MT_KB))
    split = min(MT_MAX_SPLIT, chunks // MT_SPLIT_CHUNKS, -(-2 * multiprocessors() // blocks))
    if split <= 1 or blocks >= MT_SPLIT_BELOW * multiprocessors() or blocks > TICKETS:
        return 1
    return -(-chunks // -(-chunks // split))  # no share left empty


def _chunks(n: int) -> list[int]:
    """n token rows as a sum of the row counts the product kernels are built for."""
    out = []
    for c in sorted(GEMV_COLS, reverse=True):
        while n >= c:
            out.append(c)
            n -= c
    return out


def reads_q8(node: Tensor) -> bool:
    """Whether a product's bound kernels read its activations as q8_1 blocks, which the node before
    it may write for it (handoff.py)."""
    case = _weight_case(node)
    if case is None or not node.srcs[-1].is_contiguous:
        return False
    _, k, n = case
    if not 0 < n <= GEMV_MAX_ROWS:
        return False
    return _glu_fused(node, k, n) if node.op == "mul_mat_glu" else _quantizes(node, k)


def _bind_products(node: Tensor, out, srcs, scratch, backend):
    """out holds each weight's product [N, M_i] with the activations, one after another."""
    case = _weight_case(node)
    b = rows_of(srcs[-1])
    if case is None or b is None or not out.flags.c_contiguous:
        return None
    ms, k, n = case
    parts = _parts(node, srcs, out.data.ptr, ms, n)
    if n <= GEMV_MAX_ROWS:
        return _gemv(node, parts, srcs[-1], b[2], scratch, k, n, _fed_at(node, backend))
    if _mmq_serves(node, k, n):
        return _mmq(parts, srcs[-1], b[2], scratch, k, n)
    if _mt_serves(node, k, n):
        return _mmqt(parts, srcs[-1], b[2], scratch, k, n, backend)
    return _gemm(parts, srcs[-1], b[2], scratch, backend, k, n)


def _parts(node: Tensor, srcs, at: int, ms: list[int], n: int) -> list[Part]:
    """The node's weights, their products [n, m] one after another from address `at`."""
    parts = []
    for w, arr, m in zip(_weights(node), srcs[:-1], ms):
        parts.append(Part(w.dtype, arr, m, at))
        at += n * m * 4
    return parts


binds("mul_mat", scratch=_scratch)(_bind_products)
binds("mul_mat_multi", scratch=_scratch)(_bind_products)


MMVQ_WEIGHTS = 3  # weights one mmvq launch serves


def _fed_at(node: Tensor, backend) -> int | None:
    """Address of the q8_1 activations the node before wrote for this product (handoff.py), if any."""
    slot = backend.handoffs.fed(node)
    return backend.q8_slot(slot) if slot is not None else None


def quantize_launch(b, ldb: int, y: int, k: int, n: int) -> Launch:
    """Activation rows b [n, k] (row stride ldb) to q8_1 blocks at address y."""
    blocks = n * (k // 32)
    return Launch(kernel("matmul.cu", "quantize_q8_1"), (-(-blocks // 8),), (256,),
                  (ptr(b), np.uint64(y), i32(k), i64(ldb), i32(n)))


def _gemv(node: Tensor, parts: list, b, ldb: int, scratch, k: int, n: int, fed_at: int | None = None,
          q8_at: int | None = None) -> Step:
    """Decode products: the activations quantized once to q8_1 in scratch, or at q8_at (when a weight takes
    __dp4a; unless the node before wrote them at `fed_at`), then per chunk of token rows one mmvq launch for
    up to three __dp4a weights of one type, and a gemv launch for each other weight. A part with a bias
    also stores its biased product (mmvq_bias, gemv_bias)."""
    launches = []
    quantized = _quantizes(node, k)
    y = fed_at
    if quantized and fed_at is None:
        y = q8_at if q8_at is not None else scratch.data.ptr
        launches.append(quantize_launch(b, ldb, y, k, n))
    dp4a = [p for p in parts if quantized and p.qt.name in DP4A_TYPES]
    others = [p for p in parts if not (quantized and p.qt.name in DP4A_TYPES)]
    groups = _same_type_groups(dp4a)
    row0 = 0
    for c in _chunks(n):
        for group in groups:
            launches.append(_mmvq(group, y, k, row0, c))
        for p in others:
            launches.append(_gemv_launch(p, b, ldb, k, row0, c))
        row0 += c
    return launch_step(node.op, *launches)


def _gemv_launch(p: Part, b, ldb: int, k: int, row0: int, c: int) -> Launch:
    """One gemv launch: token rows [row0, row0 + c) of b (f32, row stride ldb) through one weight."""
    m, qt = p.m, p.qt
    o = np.uint64(p.out_at + row0 * m * 4)
    x = np.uint64(b.data.ptr + row0 * ldb * 4)
    if p.bias:
        args = (ptr(p.arr), x, np.uint64(p.bias), o, np.uint64(p.biased_at + row0 * m * 4), i32(k),
                i64(qt.row_bytes(k)), i64(ldb), i32(m), i64(m))
        fn = kernel("matmul.cu", f"gemv_bias<{TYPE_IDS[qt.name]}, {c}>")
    else:
        args = (ptr(p.arr), x, o, i32(k), i64(qt.row_bytes(k)), i64(ldb), i32(m), i64(m))
        fn = kernel("matmul.cu", f"gemv<{TYPE_IDS[qt.name]}, {c}>")
    return Launch(fn, (-(-m // WARPS),), (32 * WARPS,), args)


@fuses("mul_mat", "add")
@fuses("mul_mat_multi", "add")
def _product_bias(nodes: list[Tensor], outs: list, srcs: list, backend):
    """A decode product and the add of a bias vector to (one of) its weights' products after it (attention's q, k,
    v and output biases, a router's) in one launch: the mmvq (or, for a float weight, gemv) kernel stores the
    biased product after the product. The q8_1 activations go to an idle hand-off slot (handoff.py) unless the
    node before wrote them: the product's scratch is free once it is done, and the planner may give it to the add."""
    prod, add = nodes
    case = _weight_case(prod)
    x = srcs[0][-1]
    b = rows_of(x)
    if case is None or b is None or not all(o.flags.c_contiguous for o in outs) or not 0 < case[2] <= GEMV_MAX_ROWS:
        return None
    ms, k, n = case
    found = part_bias(add, prod, ms)
    if found is None:
        return None
    j = found[0]
    parts = _parts(prod, srcs[0], outs[0].data.ptr, ms, n)
    quantized = _quantizes(prod, k)
    p = parts[j]
    if not (quantized and p.qt.name in DP4A_TYPES) and p.qt.name not in FLOATS:  # gemv_bias: float weights
        return None
    parts[j] = replace(p, bias=int(srcs[1][1].data.ptr), biased_at=int(outs[1].data.ptr))
    reads_x = any(not (quantized and q.qt.name in DP4A_TYPES) for q in parts)  # gemv reads the f32 rows
    if not writes_apart(outs, [srcs[1][1]] + ([x] if reads_x else [])):
        return None
    fed_at, q8_at = _fed_at(prod, backend), None
    if quantized and fed_at is None:
        slot = backend.handoffs.idle(prod)
        if slot is None or n * (k // 32) * Q8_1_BYTES > SLOT_BYTES:
            return None
        q8_at = backend.q8_slot(slot)
    step = _gemv(prod, parts, x, b[2], None, k, n, fed_at, q8_at)
    return replace(step, name=f"{prod.op}+bias")


@fuses("mul_mat_multi", "rope", "rope_set_rows", "set_rows")
def _qkv_rope(nodes: list[Tensor], outs: list, srcs: list, backend):
    """One token's q, k and v products and the layer's RoPE and cache writes after them (rope_qkv) in one
    mmvq_rope_qkv launch, after the activations' quantization unless the node before wrote them: llama's
    rotation (ROPE_NORMAL) without a head norm, its pairs in consecutive rows of one block."""
    qkv, rq, rk, sv = nodes
    case = _weight_case(qkv)
    if case is None or len(case[0]) != 3 or case[2] != 1 or not reads_q8(qkv):
        return None
    (m0, m1, m2), k, _ = case
    qt = qkv.srcs[0].dtype
    views = ((rq.srcs[0], 0), (rk.srcs[1], m0), (sv.srcs[1], m0 + m1))
    d, n_dims = rk.srcs[1].shape[-1], rq.params["n_dims"]
    if (qt.name not in DP4A_TYPES or any(w.dtype is not qt for w in _weights(qkv))
            or any(a.root is not qkv or a.view_offset != at * 4 for a, at in views)
            or rq.params["mode"] == ROPE_NEOX or "yarn" in rq.params or weight_id(rq, 2) != NO_WEIGHT
            or d % 2 or n_dims % 2
            or m0 % d or rope_qkv(nodes[1:], outs[1:], srcs[1:], backend) is None):
        return None
    launches = []
    y = _fed_at(qkv, backend)
    if y is None:
        y = backend.array(qkv.scratch).data.ptr
        launches.append(quantize_launch(srcs[0][-1], k, y, k, 1))
    q_out, k_out, v_out = outs[1:]
    base = outs[0].data.ptr
    dims_arg, d_arg, _, _, theta_scale, freq_scale = rope_params(rk, d, 1, 1.0)[:6]  # as rope_qkv takes them
    args = (*(ptr(w) for w in srcs[0][:3]), np.uint64(base), np.uint64(base + m0 * 4), np.uint64(base + (m0 + m1) * 4),
            i32(m0), i32(m1), np.uint64(y), i32(k), i64(qt.row_bytes(k)), i32(m0 + m1 + m2), ptr(srcs[1][1]),
            ptr(srcs[2][2]), ptr(q_out), ptr(k_out), ptr(v_out), i64(estrides(k_out)[0]), i64(estrides(v_out)[0]),
            f32(rq.params.get("out_scale", 1.0)), dims_arg, d_arg, theta_scale, freq_scale, i32(0))
    fn = kernel("matmul.cu", f"mmvq_rope_qkv<{TYPE_IDS[qt.name]}, {TYPE_IDS[rk.dtype.name]}>")
    launches.append(Launch(fn, (-(-(m0 + m1 + m2) // WARPS),), (32 * WARPS,), args, prologue=True))
    return launch_step("mmvq_rope_qkv", *launches)


def _same_type_groups(parts: list) -> list[list]:
    """parts in runs of up to MMVQ_WEIGHTS sharing one weight type, in order."""
    groups: list[list] = []
    for p in parts:
        if groups and groups[-1][0].qt is p.qt and len(groups[-1]) < MMVQ_WEIGHTS:
            groups[-1].append(p)
        else:
            groups.append([p])
    return groups


def _mmvq(group: list, y0: int, k: int, row0: int, c: int) -> Launch:
    """One mmvq launch: token rows [row0, row0 + c) through every weight of the group (mmvq_bias where a
    weight has a bias: its biased product too)."""
    qt = group[0].qt
    ws = [ptr(p.arr) for p in group]
    outs = [np.uint64(p.out_at + row0 * p.m * 4) for p in group]
    ms = [p.m for p in group]
    pad = MMVQ_WEIGHTS - len(group)
    ws, outs = ws + [ws[-1]] * pad, outs + [outs[-1]] * pad
    rows = sum(ms)
    m0, m1 = (ms + [0, 0])[:2]
    y = np.uint64(y0 + row0 * (k // 32) * Q8_1_BYTES)
    name = "mmvq"
    if any(p.bias for p in group):
        name = "mmvq_bias"
        biases = [np.uint64(p.bias) for p in group] + [NULL] * pad
        biased = [np.uint64(p.biased_at + row0 * p.m * 4 if p.bias else 0) for p in group] + [NULL] * pad
        outs += biases + biased
    args = (*ws, *outs, i32(m0), i32(m1), y, i32(k), i64(qt.row_bytes(k)), i32(rows), i32(0))
    return Launch(kernel("matmul.cu", f"{name}<{TYPE_IDS[qt.name]}, {c}>"), (-(-rows // WARPS),), (32 * WARPS,), args,
                  prologue=True)


def _mmq(parts: list, b, ldb: int, scratch, k: int, n: int) -> Step:
    """A few dozen token rows: the activations quantized to q8_1 in scratch once, then an mmq launch per weight
    (16 weight rows by up to 64 token rows a block)."""
    y = scratch.data.ptr
    launches = [quantize_launch(b, ldb, y, k, n)]
    nt = next(t for t in MMQ_TILES if n <= 8 * t)
    for p in parts:
        qt, m = p.qt, p.m
        fn = kernel("matmul.cu", f"mmq<{TYPE_IDS[qt.name]}, {nt}>")
        args = (ptr(p.arr), np.uint64(y), np.uint64(p.out_at), i32(k), i64(qt.row_bytes(k)), i32(m), i32(n), i64(m))
        launches.append(Launch(fn, (-(-m // 16), -(-n // (8 * nt))), (32 * MQ_WARPS,), args))
    return launch_step("mul_mat (mmq)", *launches)


def _mmqt(parts: list, b, ldb: int, scratch, k: int, n: int, backend) -> Step:
    """Dozens to hundreds of token rows: the activations quantized once (mt_quantize), then an mmqt launch for each
    run of up to three weights of one type (q, k and v; gate and up), tiles sized by _mt_tile, K split into shares
    by _mt_split (their sums in scratch past the activations)."""
    quantize, q, scales = mt_quantize(b, ldb, scratch.data.ptr, k, n, [p.qt for p in parts])
    part = scratch.data.ptr + _up16(mt_bytes(n, k, [p.qt for p in parts]))
    launches = [quantize]
    for group in _same_type_groups(parts):
        qt = group[0].qt
        ms = [p.m for p in group]
        wm, nt, bn = _mt_tile(ms, n)
        split = _mt_split(ms, n, k)
        fn, smem = mt_kernel("mmqt", qt, wm, nt)
        pad = MMVQ_WEIGHTS - len(group)
        ws = [ptr(p.arr) for p in group] + [ptr(group[-1].arr)] * pad
        outs = [np.uint64(p.out_at) for p in group] + [np.uint64(group[-1].out_at)] * pad
        heights = ms + [0] * pad
        tiles = sum(-(-m // (16 * wm)) for m in ms)
        tickets = ptr(backend.tickets(tiles * -(-n // bn))) if split > 1 else NULL
        args = (*ws, *outs, *map(i32, heights), np.uint64(q), np.uint64(scales[qt.name in SUM_Q]), i32(k),
                i64(qt.row_bytes(k)), i32(n), np.uint64(part if split > 1 else 0), i64(n * sum(ms)), tickets)
        launches.append(Launch(fn, (tiles, -(-n // bn), split), (256,), args, smem))
    return launch_step("mul_mat (mmqt)", *launches)


def _gemm(parts: list, b, ldb: int, scratch, backend, k: int, n: int) -> Step:
    """Prompt products by cuBLAS: out [n, m] = b [n, k] w^T. An F32 weight meets the f32 activations as they are
    (ggml's CUDA and CPU backends both multiply F32 weights in f32; in f16, the tiny F32 family models' greedy
    tokens on an H100 agreed with the CPU's at 96.8-99.2%, now at 99.2-100%); any other is decoded to f16 tile by
    tile against the activations converted to f16 once."""
    tile = max(_tile_rows(p.m, k) for p in parts)
    w16 = scratch.data.ptr
    b16 = scratch.data.ptr + tile * k * 2
    per = 8 if k % 8 == 0 else 1  # elements a dequantizing thread writes
    name = "dequant_f16_x8" if per == 8 else "dequant_f16"
    steps = []  # launches, and for cuBLAS (weight rows, their type and stride, activations, theirs, rows, out, m)
    if any(p.qt is not DType.F32 for p in parts):
        grid, block = grid1d(n * k)
        steps.append(Launch(kernel("matmul.cu", "f32_to_f16"), grid, block,
                            (ptr(b), np.uint64(b16), i32(k), i64(ldb), i64(n))))
    for p in parts:
        qt, a, m, out_at = p.qt, p.arr, p.m, p.out_at
        if qt is DType.F32:
            steps.append((a.data.ptr, CUDA_R_32F, k, b.data.ptr, CUDA_R_32F, ldb, m, out_at, m))
            continue
        dequant = kernel("matmul.cu", f"{name}<{TYPE_IDS[qt.name]}>")
        for r0 in range(0, m, tile):
            rows = min(tile, m - r0)
            grid, block = grid1d(rows * k // per)
            args = (ptr(a), np.uint64(w16), i32(k), i64(qt.row_bytes(k)), i64(r0), i64(rows))
            steps.append(Launch(dequant, grid, block, args))
            steps.append((w16, CUDA_R_16F, k, b16, CUDA_R_16F, k, rows, out_at + r0 * 4, m))

    def run() -> None:
        for s in steps:
            if isinstance(s, Launch):
                s()
                continue
            w, w_type, ldw, x, x_type, ldx, rows, out_at, m = s
            # column-major: C (rows x n, ld m) = W^T (rows x k) . B (k x n)
            blas.gemm_ex(backend.stream.ptr, cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, rows, n, k, _ONE.ctypes.data,
                         w, w_type, ldw, x, x_type, ldx, _ZERO.ctypes.data, out_at, CUDA_R_32F, m,
                         CUBLAS_COMPUTE_32F)
    return Step(run, capturable=blas.available(), name="mul_mat (cuBLAS)")


def _glu_fused(node: Tensor, k: int, n: int) -> bool:
    """Whether mmvq_glu serves a mul_mat_glu: few token rows, gate and up of one __dp4a type."""
    gate, up = _weights(node)
    return n <= GEMV_MAX_ROWS and k % 32 == 0 and gate.dtype is up.dtype and gate.dtype.name in DP4A_TYPES


def _glu_scratch(node: Tensor) -> int:
    """mmvq_glu: the q8_1 activations; otherwise both products [N, M] and their own work space."""
    case = _weight_case(node)
    if case is None:
        return 0
    ms, k, n = case
    if _glu_fused(node, k, n):
        return n * (k // 32) * Q8_1_BYTES
    return 2 * n * ms[0] * 4 + _scratch(node)


@binds("mul_mat_glu", scratch=_glu_scratch)
def _bind_glu(node: Tensor, out, srcs, scratch, backend):
    """glu(x gate^T, x up^T) into out: for decode one mmvq_glu launch per chunk of token rows after the
    activations' quantization; otherwise the two products into scratch and a gated launch."""
    case = _weight_case(node)
    b = rows_of(srcs[-1])
    if case is None or b is None or not out.flags.c_contiguous:
        return None
    ms, k, n = case
    m, act = ms[0], GLU_ACTS[node.params["glu"]]
    if _glu_fused(node, k, n):
        return _mmvq_glu(node, srcs, b[2], scratch, out, act, k, n, m, backend)
    g_at, u_at = scratch.data.ptr, scratch.data.ptr + n * m * 4
    parts = [Part(w.dtype, arr, m, at) for w, arr, at in zip(_weights(node), srcs[:2], (g_at, u_at))]
    work = scratch[2 * n * m:]  # scratch is f32: past both products
    if n <= GEMV_MAX_ROWS:
        step = _gemv(node, parts, srcs[-1], b[2], work, k, n)
    elif _mmq_serves(node, k, n):
        step = _mmq(parts, srcs[-1], b[2], work, k, n)
    elif _mt_serves(node, k, n):
        step = _mmqt(parts, srcs[-1], b[2], work, k, n, backend)
    else:
        step = _gemm(parts, srcs[-1], b[2], work, backend, k, n)
    grid, block = grid1d(n * m)
    gated = Launch(kernel("elementwise.cu", f"gated<{act}>"), grid, block,
                   (np.uint64(g_at), np.uint64(u_at), ptr(out), i32(m), i64(n), i64(m), i64(m)))

    def run() -> None:
        step()
        gated()
    return Step(run, step.capturable, f"{node.op} ({step.name})")


def _mmvq_glu(node: Tensor, srcs, ldb: int, scratch, out, act: int, k: int, n: int, m: int, backend) -> Step:
    """Decode rows through mmvq_glu: its activations quantized first unless the node before wrote
    them; where the next product takes q8_1 blocks of the result (handoff.py), the kernel writes
    them too, 32 warps a block."""
    qt = node.srcs[0].dtype
    launches = []
    y0 = _fed_at(node, backend)
    if y0 is None:
        y0 = scratch.data.ptr
        launches.append(quantize_launch(srcs[-1], ldb, y0, k, n))
    slot = backend.handoffs.dest(node) if m % 32 == 0 else None
    q8 = backend.q8_slot(slot) if slot is not None else 0
    warps = 32 if slot is not None else WARPS
    row0 = 0
    for c in _chunks(n):
        y = np.uint64(y0 + row0 * (k // 32) * Q8_1_BYTES)
        o = np.uint64(out.data.ptr + row0 * m * 4)
        q = np.uint64(q8 + row0 * (m // 32) * Q8_1_BYTES if q8 else 0)
        fn = kernel("matmul.cu", f"mmvq_glu<{TYPE_IDS[qt.name]}, {c}, {act}>")
        launches.append(Launch(fn, (-(-m // warps),), (32 * warps,),
                               (ptr(srcs[0]), ptr(srcs[1]), y, o, i32(k), i64(qt.row_bytes(k)), i32(m), q, i32(0)),
                               prologue=True))
        row0 += c
    if slot is not None:
        backend.handoffs.wrote(node)
    return launch_step(node.op, *launches)


@binds("mul_mat")
def _float_product(node: Tensor, out, srcs, scratch, backend):
    """out[b, n, m] = sum_k a[b // r, m, k] * b[b, n, k] for float operands of up to 3 axes."""
    if len(srcs) != 2:
        return None
    a, b = srcs
    ta, tb = node.srcs[0].dtype, node.srcs[1].dtype
    if ta.is_quantized or a.ndim not in (2, 3) or b.ndim != a.ndim or not out.flags.c_contiguous:
        return None
    if ta.name not in ("F32", "F16", "BF16") or tb.name not in ("F32", "F16", "BF16"):
        return None
    sa, sb = estrides(a), estrides(b)
    if a.ndim == 2:
        sa, sb = (0,) + sa, (0,) + sb
    nb = b.shape[0] if b.ndim == 3 else 1
    na = a.shape[0] if a.ndim == 3 else 1
    m, kk, n = a.shape[-2], a.shape[-1], b.shape[-2]
    fn = kernel("matmul.cu", f"mul_mat_float<{TYPE_IDS[ta.name]}, {TYPE_IDS[tb.name]}>")
    grid, block = grid1d(nb * n * m)
    args = (ptr(a), ptr(b), ptr(out), i32(m), i32(n), i32(kk), i32(nb), i32(nb // na),
            *map(i64, sa), *map(i64, sb))
    return launch_step("mul_mat", Launch(fn, grid, block, args))


@binds("get_rows")
def _get_rows(node: Tensor, out, srcs, scratch, backend):
    a, ids = srcs
    at = node.srcs[0].dtype
    if len(node.srcs[0].shape) != 2 or at.name not in TYPE_IDS or out.ndim != 2 or not out.flags.c_contiguous:
        return None
    if not node.srcs[0].is_contiguous or ids.ndim != 1:
        return None
    n, ncols = out.shape
    row_bytes = at.row_bytes(ncols)
    fn = kernel("matmul.cu", f"get_rows<{TYPE_IDS[at.name]}>")
    grid, block = grid1d(n * ncols)
    return launch_step("get_rows", Launch(fn, grid, block, (ptr(a), ptr(ids), ptr(out), i32(ncols), i64(row_bytes),
                                                            i64(n), i64(ncols))))
