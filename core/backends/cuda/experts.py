"""Which CUDA kernels run a mixture of experts' ops: the routing (`moe_topk`, `moe_weights`) and the experts'
products (`mul_mat_id`, ggml's op of that name; kernels in matmul.cu and elementwise.cu).

A decode step's few slots (token, chosen expert) each read only their expert's blocks: the activations are
quantized to q8_1 once and mmvq_id takes a warp per weight row and a block row per slot, as ggml's mmvq
with ids. A prompt's slots are grouped by expert on the device (moe_group: counts, offsets, the slots of
each expert), then one grouped GEMM multiplies each expert's weights by its slots' activations: for a type
with a scale per 32 weights (MMQ_TYPES) mmq_idt meets the weights' quants with the q8_1 activations on int8
tensor cores in ggml's tile layout (matmul.cu's mmqt: 128 rows of an expert by 16 or 32 of its slots a block, each
chunk of K staged in shared memory once), as ggml's mmq with ids (it replaced mmq_id, 16 rows a block, 3-4x
slower on an H200); other types' weight tiles are decoded to f16 against f16 activations (mmid_tc). Every
launch has a fixed grid, so the step is captured in a CUDA graph like any other: mmq_idt's blocks take the
tiles of moe_group's list (an expert's slots BN at a time, however many it holds) and blocks past its end
return at once; mmid_tc's blocks past an expert's slots return at once. (mmid_tc decoded each weight element
alone and took 0.85 ms for one qwen3-30b-a3b layer's gate product of 512 tokens on an H200, ~7 TFLOP/s.) A decode step's experts' bias rows
(gpt-oss: get_rows of the bias by the ids, then add; bias_adds.py) are added by mmvq_id's kernel as it stores,
and gate and up with theirs by one kernel with the gated unit after them. A prompt's gate and up products share
one quantization of the activations and one grouping of the slots (the step mmq_idt_pair).
"""
from __future__ import annotations

import numpy as np

from ggrun.core.backends.bias_adds import ExpertBias, expert_bias
from ggrun.core.backends.cuda.binding import (TABLE, Launch, binds, disjoint, estrides, f32, fuses, grid1d, i32, i64,
                                              launch_step, launches_of, ptr, rows_of, writes_apart)
from ggrun.core.backends.cuda.handoff import Q8_1_BYTES, SLOT_BYTES
from ggrun.core.backends.cuda.matmul import (GEMV_MAX_ROWS, WARPS, mt_bytes, mt_kernel, mt_quantize,
                                             quantize_launch)
from ggrun.core.backends.cuda.module import (DP4A_TYPES, EXPERT_GLU_ACTS, GLU_ACTS, MMQ_TYPES, MT_ID_TILES,
                                             TYPE_IDS, kernel)
from ggrun.core.dtypes import DType
from ggrun.core.tensor import Tensor

ID_M, ID_N = 64, 64  # weight rows and slots of an mmid_tc block (matmul.cu's ID_M, ID_N)
MAX_EXPERTS = 1024  # moe_topk's rows (a lane holds 32 of them) and moe_group's shared counts
MAX_USED = 16  # experts a token uses, up to which moe_sum fuses the weighting and the sum
ALIGN = 256


def _case(node: Tensor) -> tuple[int, int, int, int, int, int] | None:
    """(n_expert, M, K, tokens, k, rows of b per token) of a mul_mat_id the kernels here run, else None."""
    w, b, ids = node.srcs
    n_expert, m, k_cols = w.shape
    if (b.dtype is not DType.F32 or w.dtype.name not in TYPE_IDS or not w.is_contiguous
            or (w.dtype.is_quantized and k_cols % w.dtype.block_size) or n_expert > MAX_EXPERTS):
        return None
    t, k = ids.shape
    return n_expert, m, k_cols, t, k, b.shape[1]


def _decodes(node: Tensor, case: tuple) -> bool:
    """Whether the slots go through mmvq_id (few tokens, a __dp4a type) rather than the grouped GEMM."""
    _, _, k_cols, t, _, _ = case
    return t <= GEMV_MAX_ROWS and k_cols % 32 == 0 and node.srcs[0].dtype.name in DP4A_TYPES


def _up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


ID_MIN_SLOTS = 16  # the fewest slots of an mmq_idt tile (MT_ID_TILES), which bounds moe_group's tile list


def _max_tiles(n_expert: int, slots: int, bn: int = ID_MIN_SLOTS) -> int:
    """The most tiles of bn slots the slots can make grouped by expert (each expert's last tile may be partial)."""
    return -(-slots // bn) + n_expert


def _group_bytes(n_expert: int, slots: int) -> int:
    """moe_group's ints: offsets (n_expert + 1), cursors (n_expert), the grouped slots, and mmq_idt's tile list (a
    count, then an expert and a first slot per tile)."""
    return _up((2 * n_expert + 1 + slots + 1 + 2 * _max_tiles(n_expert, slots)) * 4)


def _scratch(node: Tensor) -> int:
    case = _case(node)
    if case is None:
        return 0
    n_expert, _, k_cols, t, k, b1 = case
    if _decodes(node, case):
        return t * b1 * (k_cols // 32) * Q8_1_BYTES
    return _group_bytes(n_expert, t * k) + max(t * b1 * k_cols * 2, mt_bytes(t * b1, k_cols, [node.srcs[0].dtype]))


@binds("mul_mat_id", scratch=_scratch)
def _mul_mat_id(node: Tensor, out, srcs, scratch, backend):
    """out [tokens, k, M]: each slot's expert matrix times its activation row."""
    case = _case(node)
    w, b, ids = srcs
    rows = rows_of(b)
    if case is None or rows is None or not out.flags.c_contiguous or ids.strides[1] != ids.itemsize:
        return None
    n_expert, m, k_cols, t, k, b1 = case
    qt = node.srcs[0].dtype
    row_bytes = qt.row_bytes(k_cols)
    ldb, ldi = rows[2], estrides(ids)[0]
    if _decodes(node, case):
        y = scratch.data.ptr
        fn = kernel("matmul.cu", f"mmvq_id<{TYPE_IDS[qt.name]}>")
        args = (ptr(w), np.uint64(y), ptr(ids), ptr(out), i32(k_cols), i64(row_bytes), i64(m * row_bytes), i32(m),
                i32(k), i64(ldi), i32(b1 != 1))
        return launch_step(node.op, quantize_launch(b, ldb, y, k_cols, t * b1),
                           Launch(fn, (-(-m // WARPS), t * k), (32 * WARPS,), args))
    if k_cols % 8:
        return None
    grouped = _grouped_mmq(node, out, srcs, scratch)
    if grouped is not None:
        return launch_step(node.op, *grouped)
    offs = scratch.data.ptr
    slots = offs + (2 * n_expert + 1) * 4
    x16 = offs + _group_bytes(n_expert, t * k)
    grid, block = grid1d(t * b1 * k_cols)
    convert = Launch(kernel("matmul.cu", "f32_to_f16"), grid, block,
                     (ptr(b), np.uint64(x16), i32(k_cols), i64(ldb), i64(t * b1)))
    fn = kernel("matmul.cu", f"mmid_tc<{TYPE_IDS[qt.name]}>")
    args = (ptr(w), np.uint64(x16), np.uint64(offs), np.uint64(slots), ptr(out), i32(k_cols), i64(row_bytes),
            i64(m * row_bytes), i32(m), i32(k), i32(b1 != 1))
    # tiles of slots per expert: sized for a token's experts being distinct (moe_topk's); more loop in a block
    grouped = Launch(fn, (-(-m // ID_M), n_expert, -(-t // ID_N)), (128,), args)
    return launch_step(node.op, convert, _group(node, ids, scratch, 0), grouped)


def _group(node: Tensor, ids, scratch, bn: int) -> Launch:
    """moe_group into the node's scratch: the slots grouped by expert, and with bn the list of mmq_idt's tiles of bn
    slots too."""
    n_expert, _, _, t, k, _ = _case(node)
    offs = scratch.data.ptr
    cursor, slots = offs + (n_expert + 1) * 4, offs + (2 * n_expert + 1) * 4
    return Launch(kernel("matmul.cu", "moe_group"), (1,), (1024,),
                  (ptr(ids), np.uint64(offs), np.uint64(cursor), np.uint64(slots), i32(t), i32(k),
                   i64(estrides(ids)[0]), i32(n_expert), i32(bn), np.uint64(slots + t * k * 4 if bn else 0)),
                  n_expert * 4)


def _grouped_mmq(node: Tensor, out, srcs, scratch) -> tuple[Launch, Launch, Launch] | None:
    """A prompt's experts on int8 tensor cores, for a weight type with a scale per 32 (MMQ_TYPES): the activations
    quantized into the scratch, the slots grouped (with mmq_idt's tile list), and mmq_idt over the tiles; None for
    other types and widths."""
    n_expert, m, k_cols, t, k, b1 = _case(node)
    qt = node.srcs[0].dtype
    if k_cols % 32 or qt.name not in MMQ_TYPES:
        return None
    w, b, _ = srcs
    offs = scratch.data.ptr
    slots = offs + (2 * n_expert + 1) * 4
    quantize, q, scales = mt_quantize(b, rows_of(b)[2], offs + _group_bytes(n_expert, t * k), k_cols, t * b1, [qt])
    wm, nt = _id_tile(t * k / n_expert)
    bn = 8 * nt * (8 // wm)
    fn, smem = mt_kernel("mmq_idt", qt, wm, nt)
    row_bytes = qt.row_bytes(k_cols)
    args = (ptr(w), np.uint64(q), np.uint64(next(iter(scales.values()))), np.uint64(offs), np.uint64(slots),
            np.uint64(slots + t * k * 4), ptr(out), i32(k_cols), i64(row_bytes), i64(m * row_bytes), i32(m), i32(k),
            i32(b1 != 1))
    return (quantize, _group(node, srcs[2], scratch, bn),
            Launch(fn, (-(-m // (16 * wm)), _max_tiles(n_expert, t * k, bn)), (256,), args, smem))


def _id_tile(per_expert: float) -> tuple[int, int]:
    """mmq_idt's tile (MT_ID_TILES: 128 weight rows by 16 or 32 slots): the fewest slots that hold an expert's
    average share."""
    return next(((wm, nt) for wm, nt in MT_ID_TILES if per_expert <= 8 * nt * (8 // wm)), MT_ID_TILES[-1])


@fuses("mul_mat_id", "mul_mat_id", "swiglu")
@fuses("mul_mat_id", "mul_mat_id", "geglu")
def _gated_experts(nodes: list[Tensor], outs: list, srcs: list, backend):
    """A decode step's gate and up experts' products and the gated unit after them (qwen3moe's) in one
    mmvq_id_glu launch, after the activations' quantization: each weight row's two products in one warp. The
    q8_1 activations go to an idle hand-off slot (_q8_room), not the gate's scratch, which the planner may give
    to the up product's or the gated unit's result (it did in a 48-layer Qwen3-30B-A3B-shaped model's decode
    graph, where every layer's three nodes ran unfused). A prompt's: _prompt_gated_experts."""
    gate, up, glu = nodes
    case = _case(gate)
    if (case is None or _case(up) != case or glu.srcs != (gate, up)
            or up.srcs[1] is not gate.srcs[1] or up.srcs[2] is not gate.srcs[2]
            or up.srcs[0].dtype is not gate.srcs[0].dtype or not all(o.flags.c_contiguous for o in outs)):
        return None
    w, b, ids = srcs[0]
    rows = rows_of(b)
    if rows is None or ids.strides[1] != ids.itemsize:
        return None
    if not _decodes(gate, case):
        return _prompt_gated_experts(nodes, outs, srcs, backend)
    y = _q8_room(gate, case, backend)
    if y is None or not writes_apart(outs, [ids]):
        return None
    _, m, k_cols, t, k, b1 = case
    qt = gate.srcs[0].dtype
    row_bytes = qt.row_bytes(k_cols)
    fn = kernel("matmul.cu", f"mmvq_id_glu<{TYPE_IDS[qt.name]}, {GLU_ACTS[glu.op]}>")
    args = (ptr(w), ptr(srcs[1][0]), np.uint64(y), ptr(ids), ptr(outs[0]), ptr(outs[1]), ptr(outs[2]), i32(k_cols),
            i64(row_bytes), i64(m * row_bytes), i32(m), i32(k), i64(estrides(ids)[0]), i32(b1 != 1))
    return launch_step("mmvq_id_glu", quantize_launch(b, rows[2], y, k_cols, t * b1),
                       Launch(fn, (-(-m // WARPS), t * k), (32 * WARPS,), args))


def _prompt_gated_experts(nodes: list[Tensor], outs: list, srcs: list, backend):
    """A prompt's gate and up experts' products (mmq_idt each) over one quantization of the activations and one
    grouping of the slots, then the gated unit: the up node's scratch holds them, as its own would. The planner
    keeps it apart from the gate's result (alive until the gated unit) and from the up's (written beside it);
    the gated unit's result may take it, and is written after both products have read it."""
    gate, up, glu = nodes
    scratch = backend.array(up.scratch) if up.scratch is not None else None
    if scratch is None or scratch.nbytes < _scratch(up) or not all(disjoint(scratch, o) for o in outs[:2]):
        return None
    first = _grouped_mmq(gate, outs[0], srcs[0], scratch)
    second = _grouped_mmq(up, outs[1], srcs[1], scratch)
    unit = TABLE.bind(glu, outs[2], srcs[2], None, backend)
    gated = launches_of([unit]) if unit is not None else [None]
    if first is None or second is None or None in gated:
        return None
    return launch_step("mmq_idt_pair", *first, second[2], *gated)


def _decode_case(node: Tensor, srcs: list) -> tuple | None:
    """(n_expert, M, K, tokens, k, rows of b per token) of a decode mul_mat_id (mmvq_id) whose activations are rows
    and ids contiguous (the bias rows are gathered by the flattened ids), else None."""
    case = _case(node)
    if case is None or not _decodes(node, case) or rows_of(srcs[1]) is None or not srcs[2].flags.c_contiguous:
        return None
    return case


def _q8_room(node: Tensor, case: tuple, backend) -> int | None:
    """Where a fused experts' kernel's q8_1 activations go: an idle hand-off slot (handoff.py), which no result the
    kernel writes can overlap (its node's scratch is free once the node is done, and the planner may give it to a
    later node of the run); None when no slot is idle or the activations do not fit in one."""
    _, _, k_cols, t, _, b1 = case
    slot = backend.handoffs.idle(node)
    if slot is None or t * b1 * (k_cols // 32) * Q8_1_BYTES > SLOT_BYTES:
        return None
    return backend.q8_slot(slot)


def _bias_of(nodes: list[Tensor], srcs: list) -> ExpertBias | None:
    """The bias add of the experts' product nodes[0] done by nodes[1] (get_rows) and nodes[2] (add), with f32
    contiguous arrays; else None."""
    found = expert_bias(*nodes)
    if found is None or not all(a.flags.c_contiguous for a in (srcs[1][0], srcs[2][1])):
        return None
    return found


@fuses("mul_mat_id", "get_rows", "add", "mul_mat_id", "get_rows", "add", "swiglu_oai")
@fuses("mul_mat_id", "get_rows", "add", "mul_mat_id", "get_rows", "add", "swiglu")
@fuses("mul_mat_id", "get_rows", "add", "mul_mat_id", "get_rows", "add", "geglu")
def _gated_experts_bias(nodes: list[Tensor], outs: list, srcs: list, backend):
    """gpt-oss's decode experts' first half in one mmvq_id_glu_bias launch, after the activations' quantization:
    the gate and up products, each plus its experts' bias rows (get_rows of the bias by the ids, then add), and the
    gated unit of the two sums. Every node's result is stored, in the nodes' order."""
    gate, up, glu = nodes[0], nodes[3], nodes[6]
    case = _decode_case(gate, srcs[0])
    gb, ub = _bias_of(nodes[:3], srcs[:3]), _bias_of(nodes[3:6], srcs[3:6])
    if (case is None or gb is None or ub is None or _case(up) != case or glu.srcs != (gb.add, ub.add)
            or up.srcs[1] is not gate.srcs[1] or up.srcs[2] is not gate.srcs[2]
            or up.srcs[0].dtype is not gate.srcs[0].dtype or glu.params.get("f16_table")
            or not all(o.flags.c_contiguous for o in outs)):
        return None
    w, b, ids = srcs[0]
    bias_g, bias_u = srcs[1][0], srcs[4][0]
    y = _q8_room(gate, case, backend)
    if y is None or not writes_apart(outs, [ids, bias_g, bias_u]):
        return None
    _, m, k_cols, t, k, b1 = case
    qt = gate.srcs[0].dtype
    row_bytes = qt.row_bytes(k_cols)
    fn = kernel("matmul.cu", f"mmvq_id_glu_bias<{TYPE_IDS[qt.name]}, {EXPERT_GLU_ACTS[glu.op]}>")
    args = (ptr(w), ptr(srcs[3][0]), np.uint64(y), ptr(ids), ptr(bias_g), ptr(bias_u), *(ptr(o) for o in outs),
            i32(k_cols), i64(row_bytes), i64(m * row_bytes), i32(m), i32(k), i64(estrides(ids)[0]), i32(b1 != 1),
            f32(glu.params.get("alpha", 0.0)), f32(glu.params.get("limit", 0.0)))
    return launch_step("mmvq_id_glu+bias", quantize_launch(b, rows_of(b)[2], y, k_cols, t * b1),
                       Launch(fn, (-(-m // WARPS), t * k), (32 * WARPS,), args))


@fuses("mul_mat_id", "get_rows", "add")
def _experts_bias(nodes: list[Tensor], outs: list, srcs: list, backend):
    """A decode experts' product and its experts' bias rows added (gpt-oss's: get_rows of the bias by the ids, then
    add) in one mmvq_id_bias launch after the activations' quantization; the three nodes' results are stored."""
    prod = nodes[0]
    case = _decode_case(prod, srcs[0])
    found = _bias_of(nodes, srcs)
    if case is None or found is None or not all(o.flags.c_contiguous for o in outs):
        return None
    w, b, ids = srcs[0]
    bias = srcs[1][0]
    y = _q8_room(prod, case, backend)
    if y is None or not writes_apart(outs, [ids, bias]):
        return None
    _, m, k_cols, t, k, b1 = case
    qt = prod.srcs[0].dtype
    row_bytes = qt.row_bytes(k_cols)
    fn = kernel("matmul.cu", f"mmvq_id_bias<{TYPE_IDS[qt.name]}>")
    args = (ptr(w), np.uint64(y), ptr(ids), ptr(bias), *(ptr(o) for o in outs), i32(k_cols), i64(row_bytes),
            i64(m * row_bytes), i32(m), i32(k), i64(estrides(ids)[0]), i32(b1 != 1))
    return launch_step("mmvq_id+bias", quantize_launch(b, rows_of(b)[2], y, k_cols, t * b1),
                       Launch(fn, (-(-m // WARPS), t * k), (32 * WARPS,), args))


@binds("moe_topk")
def _moe_topk(node: Tensor, out, srcs, scratch, backend):
    p = rows_of(srcs[0])
    if p is None or not out.flags.c_contiguous or p[1] > MAX_EXPERTS:
        return None
    rows, n, ldp = p
    args = (ptr(srcs[0]), ptr(out), i32(n), i32(node.params["k"]), i64(ldp), i32(rows))
    return launch_step(node.op, Launch(kernel("elementwise.cu", "moe_topk"), (-(-rows // WARPS),), (32 * WARPS,), args))


@binds("moe_weights")
def _moe_weights(node: Tensor, out, srcs, scratch, backend):
    p, ids = rows_of(srcs[0]), rows_of(srcs[1])
    if p is None or ids is None or not out.flags.c_contiguous or ids[1] > 32:
        return None
    rows, k = ids[0], ids[1]
    args = (ptr(srcs[0]), ptr(srcs[1]), ptr(out), i32(k), i64(p[2]), i64(ids[2]), i32(rows),
            i32(bool(node.params["norm"])))
    return launch_step(node.op, Launch(kernel("elementwise.cu", "moe_weights"), (-(-rows // WARPS),), (32 * WARPS,),
                                       args))


def _moe_sum(nodes: list[Tensor], outs: list, srcs: list, backend):
    """blocks.ffn_moe's end in one launch: the experts' rows [tokens, k, M] times their weights (the mul node),
    then summed one after another (k - 1 add nodes, each adding the mul's next row to the sum so far).
    moe_sum writes the last sum alone: the mul's result and the partial sums feed only these adds (the
    graph of blocks.weighted_sum), and the planner may place the sum over the mul's result."""
    mul, adds = nodes[0], nodes[1:]
    if mul.dtype is not DType.F32 or len(mul.shape) != 3 or mul.shape[1] != len(nodes):
        return None
    t, k, m = mul.shape
    e, w = srcs[0]
    if (any(x.dtype is not DType.F32 for x in mul.srcs) or mul.srcs[1].shape != (t, k, 1)
            or not (e.flags.c_contiguous and w.flags.c_contiguous and outs[-1].flags.c_contiguous)
            or (t > 1 and not disjoint(outs[-1], e))):  # token t's sum would land on rows others still read
        return None
    for j, add in enumerate(adds, 1):
        first, row = add.srcs
        want_first = (first.root is mul and first.view_offset == 0) if j == 1 else first is adds[j - 2]
        if not want_first or row.root is not mul or row.view_offset != j * m * 4 or add.shape != (t, m):
            return None
    grid, block = grid1d(t * m)
    args = (ptr(e), ptr(w), ptr(outs[-1]), i32(m), i32(k), i64(t))
    return launch_step("moe_sum", Launch(kernel("elementwise.cu", "moe_sum"), grid, block, args))


for _k in range(MAX_USED, 1, -1):  # the longest runs first: a shorter one would match a longer run's start
    fuses("mul", *("add",) * (_k - 1))(_moe_sum)
