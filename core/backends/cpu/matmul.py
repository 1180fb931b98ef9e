"""CPU binders for products with stored weights (mul_mat of a 2-d block-quantized, f16, bf16 or
f32 weight with activation rows; mul_mat_multi, several such weights with one input; mul_mat_glu,
a feed-forward's gate and up products and their GLU) and for get_rows from them; the compiled
kernels are in the quant/ package (lut4.py for IQ4_NL, IQ4_XS and MXFP4, which are read as stored).

Three ways to compute out[N, M] = x[N, K] @ w[M, K]^T, chosen per node when it is bound:
- "q8": with llama numerics (the weight's `act_quant`), x's rows are quantized once to the 8-bit
  blocks of the weight type's ggml vec_dot, then every weight row is read once and dotted with
  all N rows in integers (decode steps and short batches);
- "f32": without act_quant, each weight row is decoded once and dotted with the f32 rows;
- "blas": for long batches, the weight is decoded a tile of rows at a time into scratch and
  multiplied with numpy's sgemm into a slice of out, against x rounded exactly as "q8" rounds it.
Every work array is a view of the node's planned scratch; results are written into `out`.

Decode-step products read a weight fastest in a repacked layout made once at load: the engine
calls `repack(dtype, raw)` for each 2-d weight kept in its GGUF blocks and, where it returns an
array, keeps it in the weight tensor's params under REPACKED; the "q8" path then reads it, for
batches too (four activation rows at a time). Which layout and kernels depends on the CPU's level
(quant.codes.SIMD, isa.py): "r16" for AVX-512 (quant/avx512.py), "r8" for AVX2, "ri64" for the portable
kernels. A mul_mat_multi whose weights are all repacked and read the same activation blocks is one
such call: x is quantized once for all of them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import numba
import numpy as np

from ggrun.core.backends.cpu import jit, vecmath
from ggrun.core.backends.cpu import lut4 as L4
from ggrun.core.backends.cpu.dispatch import binds
from ggrun.core.backends.cpu.elementwise import f16_gelu_table
from ggrun.core.backends.cpu.quant import (
    activations, avx2, avx2_r8, avx512, codes, decode, layouts, lut4_avx2, portable,
)
from ggrun.core.backends.cpu.warmup import THREADS, product, warms
from ggrun.core.dtypes import DType
from ggrun.core.tensor import Tensor

# Activation rounding that a weight's `act_quant` asks for (as the reference kernel reads it).
_ROUNDING = {"q8_0": codes.ACT_Q8_0, "q8_k": codes.ACT_Q8_K}

# Largest N (rows of x) for which the integer row kernels beat decoding tiles for numpy's sgemm,
# measured on one core of an AMD Zen 5 (AVX2 kernels, machine idle) for SmolLM2's shapes (576x576,
# 192x576, 1536x576, 576x1536 Q4_1, 49152x576 Q8_0) and gemma-3-270m's (640x2048 Q4_K/Q5_K/Q6_K,
# 2048x640 Q5_0). Reading the stored blocks, the integer kernels win up to N = 8 and sgemm from
# N = 16 (1536x576 Q4_0: 0.77 vs 0.64 ms at 16). On the r8 layout they win much longer: Q4_0,
# Q4_1 and Q4_K at every N measured (1536x576 Q4_1 at N = 512: 9.8 vs 12.4 ms; 640x2048 Q4_K:
# 14.0 vs 19.3 ms), Q8_0 to N ~ 256 (the 49152x576 head: 146 vs 148 ms at 189, 426 vs 367 at
# 512), Q5_1 to 128, Q5_0 and Q5_K to 64 (2048x640 Q5_0: 2.43 vs 2.54 ms at 64, 4.9 vs 4.6 at
# 128), Q6_K to 32 (1.56 vs 1.59 ms; 3.1 vs 2.7 at 64). Without act_quant (f32 numerics)
# decoding rows for f32 dots wins up to N = 4 (1536x576 Q4_1: 0.35 vs 0.38 ms at 4, 0.69 vs 0.50
# at 8).
Q8_MAX_N = 8
# Repacked weights take the integer path at every batch size up to these: sgemm on decoded tiles
# measured faster from 256 (Q8_0), 128 (Q5_1), 64 (Q5_0, Q5_K) and 32 rows (Q6_K) on an idle machine,
# but its float sums move with BLAS's thread count, and gemma-3-270m's perplexity with them (5.78
# with one thread, 5.92 with two); integer block sums are what ggml computes, whatever the threads.
R8_MAX_N = {dtype: 4096 for dtype in (DType.Q4_0, DType.Q4_1, DType.Q4_K, DType.Q8_0, DType.Q5_1,
                                       DType.Q5_0, DType.Q5_K, DType.Q6_K)}
F32_MAX_N = 4

REPACKED = "cpu_repacked"  # params key of a weight's repacked rows (see `repack`)

TILE_BYTES = 1 << 20  # f32 bytes of one decoded weight tile (stays in L2 between sgemm passes)
# Stored weight bytes x rows of x from which a product splits across the threads: splitting only pays
# where it saves more than the other threads take to start. Polling (threads.py, --poll above 0) they
# start in microseconds, and products from POLL_SPLIT_BYTES split: a Qwen3-0.6B-shaped Q4_K decode
# step's layer products (1.2-3.5 MB) then share the cores (48-55 -> 60-72 t/s at -t 2 here while the
# machine was quiet). Sleeping (--poll 0) they take ~60 us for an empty region at -t 2 here, and
# products split from PARALLEL_MIN_BYTES only; one thread reads ~1 MB of r8 weights in ~55 us (SmolLM2
# decode at -t 2 with sleeping threads: 88-108 t/s splitting from 512 KB, 157-162 from 4 MB, 140 at -t 1).
PARALLEL_MIN_BYTES = 4 << 20
POLL_SPLIT_BYTES = 1 << 19


def split_min_bytes() -> int:
    """Bytes x rows from which products split, for the poll level in force."""
    return POLL_SPLIT_BYTES if jit.poll() > 0 else PARALLEL_MIN_BYTES


@dataclass(frozen=True)
class _Plan:
    path: str        # "q8" | "f32" | "blas"
    dtype: DType     # the weight's stored type
    act: int | None  # 8-bit activation format (q8 path) or rounding (blas path), None for plain f32
    n: int
    m: int
    k: int

    @property
    def code(self) -> int:
        return codes.CODES[self.dtype]

    @property
    def weight_bytes(self) -> int:
        return self.m * (self.dtype.row_bytes(self.k) if self.dtype.is_quantized else self.k * self.dtype.itemsize)

    @property
    def min_columns(self) -> bool:
        """BLAS path of a Q4_1/Q5_1 weight with 8-bit activations: one more column per block
        carries the weight's min against the f16 rounding of ggml's s (see quant.round_rows_s)."""
        return self.path == "blas" and self.act == codes.ACT_Q8_0 and self.dtype in (DType.Q4_1, DType.Q5_1)

    @property
    def cols(self) -> int:
        return self.k + self.k // 32 if self.min_columns else self.k

    @property
    def tile_rows(self) -> int:
        return max(1, min(self.m, TILE_BYTES // (4 * self.cols)))

    def scratch_bytes(self) -> int:
        if self.path == "q8":
            return codes.act_arrays_bytes(self.n, self.k) + _work_bytes()
        if self.path == "f32":
            return codes.round64(numba.config.NUMBA_NUM_THREADS * self.k * 4)
        size = 0
        if self.act is not None:  # the quantized rows, then the f32 values they hold
            size += codes.act_arrays_bytes(self.n, self.k) + codes.round64(self.n * self.cols * 4)
        if self.dtype is not DType.F32:
            size += codes.round64(self.tile_rows * self.cols * 4)
        return size


def _plan(a: Tensor, b: Tensor) -> _Plan | None:
    """How the product of weight a with activation rows b runs here, or None where the reference
    kernel must (attention over the KV cache, f16/bf16 activations, unknown rounding)."""
    if a.dtype not in codes.CODES or len(a.shape) != 2 or b.dtype is not DType.F32:
        return None
    m, k = a.shape
    n = math.prod(b.shape[:-1])
    if n == 0 or m == 0:
        return None
    act_quant = a.root.params.get("act_quant")
    act = None
    if act_quant is not None:
        act = _ROUNDING.get(act_quant)
        if act is None:
            return None
        if k % codes.ACT_BLOCK[act]:  # the reference leaves such rows unrounded
            act = None
    if not a.dtype.is_quantized and act is not None:
        # no ggml type quantizes activations for a float weight: leave such a pairing to the reference
        return None
    if a.dtype is DType.F32:
        return _Plan("blas", a.dtype, act, n, m, k)
    own = own_act(a, k)
    if own is not None:
        repacked = a.view_src is None and a.params.get(REPACKED) is not None  # checked when bound
        if n <= (R8_MAX_N.get(a.dtype, Q8_MAX_N) if repacked else Q8_MAX_N):
            return _Plan("q8", a.dtype, own, n, m, k)
        return _Plan("blas", a.dtype, act, n, m, k)
    if act is None and n <= F32_MAX_N:
        return _Plan("f32", a.dtype, None, n, m, k)
    return _Plan("blas", a.dtype, act, n, m, k)


def own_act(a: Tensor, k: int) -> int | None:
    """The 8-bit activation blocks weight a's integer kernels read (codes.ACT_OF), where llama numerics round
    its activations (`act_quant`) to blocks of the same length and rows of k values are whole blocks; else None
    (f32 numerics, or a rounding those kernels do not make)."""
    act = _ROUNDING.get(a.root.params.get("act_quant"))
    own = codes.ACT_OF.get(a.dtype)
    if act is None or own is None or k % codes.ACT_BLOCK[act] or (act == codes.ACT_Q8_K) != (own == codes.ACT_Q8_K):
        return None
    return own


_RI64_TYPES = (DType.Q4_0, DType.Q4_1, DType.Q5_0, DType.Q5_1, DType.Q8_0)


def _avx2() -> bool:
    """Whether the AVX2 kernels may run (levels avx2 and avx512)."""
    return codes.SIMD != "generic"


def _group_rows() -> int:
    """Rows per group of the interleaved layout of this level: r16 (AVX-512) or r8 (AVX2)."""
    return layouts.R16 if codes.SIMD == "avx512" else layouts.R8


def _group_bytes(code: int) -> int:
    """Bytes per group and block of the interleaved layout of this level."""
    return layouts.r16_block_bytes(code) if codes.SIMD == "avx512" else layouts.r8_block_bytes(code)


def repack(dtype: DType, raw: np.ndarray) -> np.ndarray | layouts.RI64 | None:
    """A 2-d weight's stored rows (uint8 [M, row bytes], GGUF blocks) in the layout the decode
    kernels of this level read fastest (AVX-512: "r16", AVX2: "r8", uint8 arrays; generic: "ri64"),
    or None where they read the stored blocks directly.

    Made once per weight at load (about 0.1 s for 30 MB); the caller keeps the result in the
    weight tensor's params under REPACKED. The stored bytes stay in use too (get_rows, batches).
    """
    if dtype not in codes.CODES or not dtype.is_quantized:
        return None
    raw = np.asarray(raw)
    if raw.ndim != 2 or raw.dtype != np.uint8 or raw.shape[1] % dtype.type_size:
        raise ValueError(f"repack: {dtype} rows must be uint8 [rows, row bytes], got {raw.dtype} {raw.shape}")
    code = codes.CODES[dtype]
    if codes.SIMD == "avx512":
        return layouts.repack_r16(code, raw) if code in layouts.R16_TYPES else None
    if codes.SIMD == "avx2":
        return layouts.repack_r8(code, raw) if code in layouts.R8_TYPES else None
    return layouts.repack_ri64(code, raw) if dtype in _RI64_TYPES else None


def repacked_bytes(dtype: DType, shape: tuple[int, int]) -> int:
    """Bytes `repack` adds for a weight of this type and shape on this host (for `ggrun measure`,
    which has no weight data)."""
    if dtype not in codes.CODES or not dtype.is_quantized:
        return 0
    m, k = shape
    blocks = k // dtype.block_size
    code = codes.CODES[dtype]
    if _avx2():
        rows = _group_rows()
        return (m + rows - 1) // rows * blocks * _group_bytes(code) if code in layouts.R8_TYPES else 0
    if dtype not in _RI64_TYPES:
        return 0
    groups = (m + layouts.RI - 1) // layouts.RI
    return sum(a.nbytes for a in layouts.repack_ri64(code, np.zeros((1, dtype.row_bytes(k)), np.uint8))) * groups


def _repacked(a: Tensor, plan: _Plan):
    """Weight a's repacked rows when the engine made them in this host's layout for its shape."""
    return repacked_rows(a, plan.m, plan.k)


def repacked_rows(a: Tensor, m: int, k: int):
    """Weight a's repacked rows when the engine made them in this host's layout for m rows of k values (an
    experts' weight: all its experts' rows in a run), else None."""
    packed = a.params.get(REPACKED) if a.view_src is None else None
    blocks = k // a.dtype.block_size
    code = codes.CODES.get(a.dtype)
    if isinstance(packed, np.ndarray) and _avx2() and code in layouts.R8_TYPES:
        groups = (m + _group_rows() - 1) // _group_rows()
        ok = packed.shape == (groups, blocks * _group_bytes(code)) and packed.dtype == np.uint8
        return packed if ok else None
    if isinstance(packed, layouts.RI64) and not _avx2() and a.dtype in _RI64_TYPES:
        groups = (m + layouts.RI - 1) // layouts.RI
        ok = packed.q.shape[:2] == (groups, blocks) and packed.d.shape == (groups, blocks, layouts.RI)
        return packed if ok else None
    return None


def experts_repacked(dtype: DType, shape: tuple[int, ...]) -> bool:
    """Whether experts' matrices [n_expert, M, K] of this type are repacked, as one weight of n_expert * M rows, on
    this host: the r8 and r16 layouts (AVX2 and above) of the types they hold, each expert's rows whole groups, so
    that its groups follow the previous expert's (experts.py's drivers read them so)."""
    return (len(shape) == 3 and dtype.is_quantized and _avx2() and codes.CODES.get(dtype) in layouts.R8_TYPES
            and shape[1] % _group_rows() == 0)


def _work_bytes() -> int:
    """The ri64 kernels' per-thread accumulators: f32 [threads, 2, 64]."""
    return numba.config.NUMBA_NUM_THREADS * 2 * layouts.RI * 4


def _scratch(node: Tensor) -> int:
    plan = _plan(*node.srcs) if node.dtype is DType.F32 else None
    return plan.scratch_bytes() if plan is not None else 0


def _rows2d(arr: np.ndarray, rows: int, cols: int) -> np.ndarray | None:
    """arr as a [rows, cols] view with unit inner stride, or None where that needs a copy."""
    view = arr.reshape(rows, cols)  # a view where the strides allow one, else a copy
    if not np.shares_memory(view, arr):
        return None
    return view if view.strides[1] == view.itemsize else None


def _stored_rows(w: np.ndarray, dtype: DType, m: int, k: int) -> np.ndarray | None:
    """A weight's stored rows as bytes [M, row bytes] (the kernels' view of every type but F32)."""
    row_bytes = dtype.row_bytes(k) if dtype.is_quantized else k * dtype.itemsize
    if w.ndim != 2 or w.shape[0] != m or w.strides[-1] != w.itemsize or w.shape[1] * w.itemsize != row_bytes:
        return None
    return w.view(np.uint8)


def _chunks(plan: _Plan, weight_bytes: int | None = None) -> int:
    """Threads for a row kernel: all of them where the weights are large enough to pay for waking them."""
    return split_chunks((plan.weight_bytes if weight_bytes is None else weight_bytes) * plan.n)


def split_chunks(work: int) -> int:
    """Threads for a product of `work` weight bytes times activation rows: all of them where that pays for
    waking them, else one."""
    threads = jit.threads()
    return threads if threads > 1 and work >= split_min_bytes() else 1


@binds("mul_mat", scratch=_scratch)
def bind_mul_mat(node: Tensor, out, srcs: list, scratch):
    plan = _plan(*node.srcs) if node.dtype is DType.F32 else None
    if plan is None:
        return None
    x = _rows2d(srcs[1], plan.n, plan.k)
    out2 = _rows2d(out, plan.n, plan.m)
    if x is None or out2 is None or not out2.flags.c_contiguous or x.dtype != np.float32:
        return None
    return _bind_product(plan, node.srcs[0], srcs[0], x, out2, scratch)


def _bind_product(plan: _Plan, a: Tensor, w, x, out2, scratch):
    """The call computing out2 = x @ w^T as `plan` says (w: weight a's stored array), or None."""
    need = plan.scratch_bytes()
    if need and (scratch is None or scratch.nbytes < need):  # planned without this binder's sizes
        return None
    if plan.path == "blas":
        return _bind_blas(plan, w, x, out2, scratch)
    w = _stored_rows(w, plan.dtype, plan.m, plan.k)
    if w is None:
        return None
    chunks = _chunks(plan)
    vector = _avx2()
    if plan.dtype in L4.TYPES:
        return _bind_lut4(plan, w, x, out2, scratch, chunks)
    if plan.path == "q8":
        qs, d, s, sums = codes.act_arrays(scratch, plan.n, plan.k)
        packed = _repacked(a, plan)
        if isinstance(packed, layouts.RI64):
            at = codes.act_arrays_bytes(plan.n, plan.k)
            work = scratch[at:at + _work_bytes()].view(np.float32).reshape(-1, 2, layouts.RI)
            chunks = min(chunks, packed.q.shape[0], work.shape[0])
            args = (plan.code, plan.act, packed.q, packed.d, packed.m, x, qs, d, s, sums, out2, work)
            if chunks > 1:
                return partial(portable.mul_mat_ri_portable_par, *args, chunks)
            return partial(portable.mul_mat_ri_portable, *args)
        if packed is not None:
            return _bind_r8([plan], [packed], x, [out2], scratch)
        if chunks > 1:
            fn = avx2.mul_mat_q8_avx2_par if vector else portable.mul_mat_q8_portable_par
            return partial(fn, plan.code, plan.act, w, x, qs, d, s, sums, out2, chunks)
        fn = avx2.mul_mat_q8_avx2 if vector else portable.mul_mat_q8_portable
        return partial(fn, plan.code, plan.act, w, x, qs, d, s, sums, out2)
    n_bufs = numba.config.NUMBA_NUM_THREADS
    bufs = scratch[:n_bufs * plan.k * 4].view(np.float32).reshape(n_bufs, plan.k)
    if chunks > 1:
        fn = avx2.mul_mat_f32_avx2_par if vector else portable.mul_mat_f32_portable_par
        return partial(fn, plan.code, w, x, bufs, out2, min(chunks, n_bufs))
    fn = avx2.mul_mat_f32_avx2 if vector else portable.mul_mat_f32_portable
    return partial(fn, plan.code, w, x, bufs, out2)


def _bind_lut4(plan: _Plan, w, x, out2, scratch, chunks: int):
    """The "q8" or "f32" path of an IQ4_NL, IQ4_XS or MXFP4 weight (stored rows w): lut4.py's kernels (q8:
    quant/lut4_avx2.py's where AVX2 runs), after quant/activations.py's quantizer has made x's 8-bit blocks."""
    if plan.path == "q8":
        qs, d, s, sums = codes.act_arrays(scratch, plan.n, plan.k)
        quantize = partial(activations.quantize_rows_avx2 if _avx2() else activations.quantize_rows, plan.act, x,
                           qs, d, s, sums)
        kernels = lut4_avx2 if _avx2() else L4
        if chunks > 1:
            dots = partial(kernels.mul_mat_q8_par, plan.code, w, qs, d, out2, chunks)
        else:
            dots = partial(kernels.mul_mat_q8, plan.code, w, qs, d, out2)

        def call() -> None:
            quantize()
            dots()
        return call
    n_bufs = numba.config.NUMBA_NUM_THREADS
    bufs = scratch[:n_bufs * plan.k * 4].view(np.float32).reshape(n_bufs, plan.k)
    if chunks > 1:
        return partial(L4.mul_mat_f32_par, plan.code, w, x, bufs, out2, min(chunks, n_bufs))
    return partial(L4.mul_mat_f32, plan.code, w, x, bufs, out2)


def _bind_r8(plans: list[_Plan], packs: list, x, outs: list, scratch):
    """One call of the r8 (or r16) kernel for one to layouts.MAX_PARTS weights that read the same
    activation blocks: x is quantized once, then each weight's rows are dotted with it into its
    own result."""
    plan = plans[0]
    qs, d, s, sums = codes.act_arrays(scratch, plan.n, plan.k)
    n = len(plans)
    type_codes = _slots([p.code for p in plans])
    packs, outs = _slots(packs), _slots(outs)
    chunks = min(_chunks(plan, sum(p.weight_bytes for p in plans)), sum(p.shape[0] for p in packs[:n]))
    r16 = codes.SIMD == "avx512"
    if chunks > 1:
        fn = avx512.mul_mat_r16_par if r16 else avx2_r8.mul_mat_r8_avx2_par
        return partial(fn, type_codes, plan.act, packs, n, x, qs, d, s, sums, outs, chunks)
    fn = avx512.mul_mat_r16 if r16 else avx2_r8.mul_mat_r8_avx2
    return partial(fn, type_codes, plan.act, packs, n, x, qs, d, s, sums, outs)


def _slots(items: list) -> tuple:
    """items padded to the kernel's layouts.MAX_PARTS slots by repeating the first."""
    return tuple(items) + (items[0],) * (layouts.MAX_PARTS - len(items))


def _multi_plans(node: Tensor) -> list[_Plan] | None:
    *ws, b = node.srcs
    plans = [_plan(w, b) for w in ws]
    return None if node.dtype is not DType.F32 or None in plans else plans


def _fused(plans: list[_Plan], ws: list[Tensor]) -> list | None:
    """The weights' r8 arrays when one kernel call can serve them all (each repacked, read with
    the same activation blocks), else None."""
    if len(plans) > layouts.MAX_PARTS or any(p.path != "q8" or p.act != plans[0].act for p in plans):
        return None
    packs = [_repacked(w, p) for w, p in zip(ws, plans)]
    return packs if all(isinstance(p, np.ndarray) for p in packs) else None


def _multi_scratch(node: Tensor) -> int:
    plans = _multi_plans(node)
    return max(p.scratch_bytes() for p in plans) if plans else 0


@binds("mul_mat_multi", scratch=_multi_scratch)
def bind_mul_mat_multi(node: Tensor, out, srcs: list, scratch):
    """Several weights' products with one input: one r8 kernel call that quantizes the input
    once where every weight allows it, else each product's own call, one after another."""
    plans = _multi_plans(node)
    if plans is None:
        return None
    n, k = plans[0].n, plans[0].k
    x = _rows2d(srcs[-1], n, k)
    flat = out.reshape(-1) if out.flags.c_contiguous else None
    if x is None or flat is None or x.dtype != np.float32:
        return None
    outs, at = [], 0
    for p in plans:
        outs.append(flat[at:at + n * p.m].reshape(n, p.m))
        at += n * p.m
    ws = list(node.srcs[:-1])
    packs = _fused(plans, ws)
    if packs is not None:
        if scratch is None or scratch.nbytes < plans[0].scratch_bytes():
            return None
        return _bind_r8(plans, packs, x, outs, scratch)
    calls = [_bind_product(p, w, arr, x, o, scratch) for p, w, arr, o in zip(plans, ws, srcs, outs)]
    if None in calls:
        return None

    def call() -> None:
        for one in calls:
            one()
    return call


# ---- mul_mat_glu: the gate's and the up's products and their GLU, one node ------------------------
# Three ways, chosen per node: "r8" (both weights repacked and read with the same activation blocks:
# one kernel call, x quantized once, the GLU applied to each step of rows as soon as both products
# have them); "blas" (both on the BLAS path with the same tiles: per weight tile, the gate's sgemm
# into the result, the up's into a scratch tile, then the GLU of that tile); "whole" (anything
# else: each product's own call, the up's into scratch, then the GLU over the whole result).
GLU_TILE_BYTES = 128 << 10  # f32 bytes of the up's rows per step of the r8 way (in L2 with the gate's)
_NO_TABLE = np.zeros(1, np.float32)  # the table argument where the GLU reads none


def _glu_plans(node: Tensor) -> tuple[_Plan, _Plan] | None:
    gate, up, b = node.srcs
    plans = (_plan(gate, b), _plan(up, b))
    return None if node.dtype is not DType.F32 or None in plans else plans


def _glu_way(node: Tensor, plans: tuple[_Plan, _Plan]) -> tuple[str, list | None]:
    """("r8", the weights' r8 arrays), ("blas", None) or ("whole", None)."""
    packs = _fused(list(plans), list(node.srcs[:2]))
    if packs is not None:
        return "r8", packs
    g, u = plans
    if g.path == u.path == "blas" and g.dtype is not DType.F32 and u.dtype is not DType.F32 and \
            (g.act, g.cols, g.min_columns) == (u.act, u.cols, u.min_columns):
        return "blas", None
    return "whole", None


def _glu_step(plan: _Plan) -> int:
    """Groups per step: the up's rows of one step fill at most GLU_TILE_BYTES (one group at least)."""
    return max(1, GLU_TILE_BYTES // (4 * plan.n * _group_rows()))


def _glu_tile_bytes(plan: _Plan) -> int:
    """One thread's tile of the r8 way: the up's rows of one step."""
    return codes.round64(4 * plan.n * min(_group_rows() * _glu_step(plan), plan.m))


def _glu_scratch(node: Tensor) -> int:
    plans = _glu_plans(node)
    if plans is None:
        return 0
    g, u = plans
    way, _ = _glu_way(node, plans)
    if way == "r8":
        return codes.act_arrays_bytes(g.n, g.k) + numba.config.NUMBA_NUM_THREADS * _glu_tile_bytes(g)
    if way == "blas":
        return g.scratch_bytes() + codes.round64(4 * g.n * g.tile_rows)
    return codes.round64(4 * g.n * g.m) + max(g.scratch_bytes(), u.scratch_bytes())


def _glu_kind(node: Tensor) -> tuple[int, np.ndarray]:
    """The compiled GLU's kind and the table it reads (ggml's f16 GELU table for llama numerics)."""
    if node.params["glu"] == "swiglu":
        return vecmath.GLU_SWIGLU, _NO_TABLE
    if node.params.get("f16_table"):
        return vecmath.GLU_GEGLU_TABLE, f16_gelu_table()
    return vecmath.GLU_GEGLU, _NO_TABLE


@binds("mul_mat_glu", scratch=_glu_scratch)
def bind_mul_mat_glu(node: Tensor, out, srcs: list, scratch):
    """glu(x @ gate^T, x @ up^T) into out [N, M], in one of the three ways above."""
    plans = _glu_plans(node)
    if plans is None:
        return None
    g, u = plans
    x = _rows2d(srcs[2], g.n, g.k)
    out2 = _rows2d(out, g.n, g.m)
    if x is None or out2 is None or not out2.flags.c_contiguous or x.dtype != np.float32:
        return None
    if scratch is None or scratch.nbytes < _glu_scratch(node):  # planned without this binder's sizes
        return None
    kind, table = _glu_kind(node)
    way, packs = _glu_way(node, plans)
    if way == "r8":
        return _bind_glu_r8(plans, packs, x, out2, scratch, kind, table)
    if way == "blas":
        return _bind_glu_blas(plans, srcs[:2], x, out2, scratch, kind, table)
    return _bind_glu_whole(plans, node.srcs[:2], srcs[:2], x, out2, scratch, kind, table)


def _bind_glu_whole(plans: tuple[_Plan, _Plan], ws: tuple, arrays: list, x, out2, scratch, kind: int, table):
    """Each product's own call (the gate's into out, the up's into scratch), then the GLU of all."""
    g, u = plans
    up = scratch[:4 * g.n * g.m].view(np.float32).reshape(g.n, g.m)
    rest = scratch[codes.round64(4 * g.n * g.m):]  # the products' own scratch, used by one after the other
    calls = (_bind_product(g, ws[0], arrays[0], x, out2, rest), _bind_product(u, ws[1], arrays[1], x, up, rest))
    if None in calls:
        return None

    def call() -> None:
        calls[0]()
        calls[1]()
        portable.glu_rows(kind, table, out2, up)
    return call


def _bind_glu_r8(plans: tuple[_Plan, _Plan], packs: list, x, out2, scratch, kind: int, table):
    """One call of the r8 GLU kernel, its groups split over threads as mul_mat_multi splits its parts'."""
    g, u = plans
    qs, d, s, sums = codes.act_arrays(scratch, g.n, g.k)
    at = codes.act_arrays_bytes(g.n, g.k)
    size = _glu_tile_bytes(g)
    tiles = scratch[at:at + numba.config.NUMBA_NUM_THREADS * size].view(np.float32).reshape(-1, size // 4)
    step = _glu_step(g)
    args = ((g.code, u.code), g.act, packs[0], packs[1], kind, table, x, qs, d, s, sums, out2, tiles, step)
    chunks = min(_chunks(g, g.weight_bytes + u.weight_bytes), packs[0].shape[0], tiles.shape[0])
    r16 = codes.SIMD == "avx512"
    if chunks > 1:
        return partial(avx512.mul_mat_glu_r16_par if r16 else avx2_r8.mul_mat_glu_r8_avx2_par, *args, chunks)
    return partial(avx512.mul_mat_glu_r16 if r16 else avx2_r8.mul_mat_glu_r8_avx2, *args)


def _bind_glu_blas(plans: tuple[_Plan, _Plan], ws: list, x, out2, scratch, kind: int, table):
    """Per weight tile: the gate's sgemm into out's columns, the up's into a scratch tile, their GLU.
    Both plans round x alike, so they share the rounded rows and the decoded tile."""
    g, u = plans
    shared = scratch[:g.scratch_bytes()]
    gate, up = _blas_parts(g, ws[0], x, shared), _blas_parts(u, ws[1], x, shared)
    if gate is None or up is None:
        return None
    prepare, lhs, gate_tiles = gate
    flat = scratch[g.scratch_bytes():].view(np.float32)
    steps = [(out2[:, m0:m1], load_g, rhs_g, load_u, rhs_u, flat[:g.n * (m1 - m0)].reshape(g.n, m1 - m0))
             for (m0, m1, load_g, rhs_g), (_, _, load_u, rhs_u) in zip(gate_tiles, up[2])]

    def call() -> None:
        prepare()
        for dst, load_g, rhs_g, load_u, rhs_u, up_tile in steps:
            load_g()
            np.matmul(lhs, rhs_g.T, out=dst)
            load_u()
            np.matmul(lhs, rhs_u.T, out=up_tile)
            portable.glu_rows(kind, table, dst, up_tile)
    return call


def _bind_blas(plan: _Plan, w, x, out2, scratch):
    """Decode the weight tile by tile into scratch; sgemm each tile into its columns of out."""
    parts = _blas_parts(plan, w, x, scratch)
    if parts is None:
        return None
    prepare, lhs, tiles = parts

    def call() -> None:
        prepare()
        for m0, m1, load, rhs in tiles:
            load()
            np.matmul(lhs, rhs.T, out=out2[:, m0:m1])
    return call


def _blas_parts(plan: _Plan, w, x, scratch):
    """The BLAS path's pieces, or None where the weight's array does not suit it: (prepare, lhs,
    tiles). prepare() rounds x into scratch as the plan asks (lhs is then that, else x itself);
    each tile (m0, m1, load, rhs): load() decodes weight rows m0..m1 into rhs (the weight itself
    for F32), and lhs @ rhs^T is out[:, m0:m1]. Plans alike in `cols` and `act` lay out the same
    scratch, so two weights' tiles may share it and one prepare()."""
    at = 0
    prepare, lhs = _nothing, x
    if plan.act is not None:
        q_bytes = codes.act_arrays_bytes(plan.n, plan.k)
        act_arrays = codes.act_arrays(scratch[:q_bytes], plan.n, plan.k)
        lhs = scratch[q_bytes:q_bytes + plan.n * plan.cols * 4].view(np.float32).reshape(plan.n, plan.cols)
        at = q_bytes + codes.round64(plan.n * plan.cols * 4)
        if plan.min_columns:
            prepare = partial(activations.round_rows_s, x, *act_arrays, lhs)
        else:
            prepare = partial(activations.round_rows, plan.act, x, *act_arrays, lhs)
    if plan.dtype is DType.F32:
        if w.ndim != 2 or w.shape != (plan.m, plan.k):
            return None
        return prepare, lhs, [(0, plan.m, _nothing, w)]
    w = _stored_rows(w, plan.dtype, plan.m, plan.k)
    if w is None:
        return None
    rows = plan.tile_rows
    tile = scratch[at:at + rows * plan.cols * 4].view(np.float32).reshape(rows, plan.cols)
    tiles = []
    for m0 in range(0, plan.m, rows):
        m1 = min(plan.m, m0 + rows)
        rhs = tile[:m1 - m0]
        tiles.append((m0, m1, _tile_loader(plan, w, m0, m1, rhs), rhs))
    return prepare, lhs, tiles


def _nothing() -> None:
    pass


def _tile_loader(plan: _Plan, w, m0: int, m1: int, rhs):
    """The call decoding weight rows m0..m1 into rhs (and, for the min columns, their block mins)."""
    threads = jit.threads()
    vector = _avx2()
    values, mins = rhs[:, :plan.k], rhs[:, plan.k:]
    if threads > 1:
        rows = partial(decode.dequantize_rows_avx2_par if vector else decode.dequantize_rows_par,
                         plan.code, w, m0, m1, values, threads)
    else:
        rows = partial(decode.dequantize_rows_avx2 if vector else decode.dequantize_rows, plan.code, w, m0, m1, values)
    if not plan.min_columns:
        return rows

    def load() -> None:
        rows()
        decode.block_mins(plan.code, w, m0, m1, mins)
    return load


def _warm_glu(lf, n_tokens: int, act_quant: bool, large: bool) -> Tensor:
    """A mul_mat_glu of Q4_0 weights, read-only as a memory map gives them (see warmup.py)."""
    from ggrun.core import ops

    rows = 8 * (PARALLEL_MIN_BYTES // (8 * DType.Q4_0.row_bytes(256) * n_tokens) + 1) if large else 16
    ws = []
    for name in ("gate", "up"):
        raw = np.zeros(rows * DType.Q4_0.row_bytes(256), np.uint8)
        raw.flags.writeable = False
        w = lf.ctx.from_bytes(name, DType.Q4_0, (rows, 256), raw)
        if act_quant:
            w.params["act_quant"] = "q8_0"
        lf.ctx.prepare_weight(w)
        ws.append(w)
    return ops.mul_mat_glu(*ws, lf.input("x", np.ones((n_tokens, 256), np.float32)), "geglu", act_quant)


# the ways models meet: r8 on one thread and on all (decode, prompts), whole and BLAS (f32 numerics)
for _case in ((1, True, False), (64, True, True), (1, False, False), (64, False, False)):
    warms(lambda lf, c=_case: _warm_glu(lf, *c), needs={product(None, True, _case[1])} | ({THREADS} if _case[2] else set()))


@binds("get_rows")
def bind_get_rows(node: Tensor, out, srcs: list, scratch):
    a = node.srcs[0]
    code = codes.CODES.get(a.dtype)
    if code is None or a.dtype is DType.F32 or len(a.shape) != 2 or out.ndim != 2 or out.dtype != np.float32:
        return None
    w = _stored_rows(srcs[0], a.dtype, a.shape[0], a.shape[1])
    ids = srcs[1]
    if w is None or ids.ndim != 1:
        return None
    return partial(decode.get_rows_avx2 if _avx2() else decode.get_rows, code, w, ids, out)
