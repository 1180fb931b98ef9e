"""Compiled attention over the KV cache: flash_attn (no scores tensor; an online softmax over the cells).

Each token attends only the span of each tile of CELLS cells between the first and last cells its mask
leaves visible, so the padded tail of n_kv and the causal future cost nothing. Those spans are found once
per call for every token and tile (tile_spans), before any head is computed: a decode step of many
sequences, each in cells of its own (core/llm/kv_blocks.py), then works on each token's own tiles and
skips every other tile at the cost of one lookup.

Under llama numerics (`act_quant` f16 on the cache) the result is the one llama.cpp's CPU kernel computes
cell by cell: queries rounded to f16, then for each visible cell its score, the running maximum and total,
and its value row added to sums kept rounded to f16 (VKQ16), as ggml does (attend_rounded). Cells are the
outer loop there, so a cell's keys and values of all KV heads are read once where they lie side by side,
and independent heads interleave. From 64 query tokens on, llama.cpp's CPU kernel takes its tiled path
instead (f32 queries and sums), and so do llama numerics here (attention_tiled.py).

Otherwise (f32 numerics) the query heads that share one KV head (GQA) and all tokens of an item meet each
tile of cached keys and values together, the tile converted to f32 once per KV head (attend); products
and the softmax are f32, tile by tile; hidden cells inside a span get weight 0. Work items are KV heads
(runs of them under llama numerics), and blocks of tokens when several threads share the work.
Attention sinks (gpt-oss's) join each row's softmax after its last cell (sinks.fold_sink); without them
the kernels take an empty array and compute what they did.
"""
from __future__ import annotations

import math

import numpy as np
from numba import prange

from ggrun.core.backends.cpu import attention_tiled as tiled
from ggrun.core.backends.cpu import jit
from ggrun.core.backends.cpu.dispatch import binds
from ggrun.core.backends.cpu.jit import kernel
from ggrun.core.backends.cpu.kv_quant import BLOCK, CACHE_TYPES, code_of, hadamard, load_key, load_row, \
    quantize_q8_0, score_cells
from ggrun.core.backends.cpu.sinks import fold_sink
from ggrun.core.backends.cpu.vecmath import as_f32, expf, f16_to_f32, f32_to_f16, fma
from ggrun.core.backends.cpu.warmup import kv, warms
from ggrun.core.dtypes import DType

CELLS = 64  # cache cells per tile: converted to f32 once per tile and KV head


# Dot products over head_dim are summed in SIMD lanes (as ggml's vec_dot), hence `reassoc`. One
# compiled function serves every caller, so a row's result never depends on how tokens were
# batched or shared among threads.
_FLAGS = {"reassoc", "contract"}


@kernel(inline="always")
def _visible(mask, t, c0, nc):
    """The range [lo, hi) of the tile's cells from the first to the last one token t may see
    (lo == hi when the mask hides the whole tile from it). A hidden tile, the usual case in a step of
    many sequences, is known by one count over the tile's mask (no early exit: it vectorizes)."""
    seen = 0
    for c in range(nc):
        seen += as_f32(mask[t, c0 + c]) != -np.inf
    if seen == 0:
        return nc, nc
    lo = 0
    while lo < nc and as_f32(mask[t, c0 + lo]) == -np.inf:
        lo += 1
    hi = nc
    while hi > lo and as_f32(mask[t, c0 + hi - 1]) == -np.inf:
        hi -= 1
    return lo, hi


@kernel(inline="always")
def _spans_of_token(mask, t, spans):
    """spans[t, b] = the visible range [lo, hi) of tile b's cells for token t (lo == hi: all hidden)."""
    n_kv = mask.shape[1]
    for b in range(spans.shape[1]):
        c0 = b * CELLS
        lo, hi = _visible(mask, t, c0, min(CELLS, n_kv - c0))
        spans[t, b, 0] = lo
        spans[t, b, 1] = hi


@kernel
def tile_spans(mask, n_tok, spans):
    """Every token's visible span of every tile of cells (spans int32 [>= n_tok, tiles, 2])."""
    for t in range(n_tok):
        _spans_of_token(mask, t, spans)


@kernel(parallel=True)
def tile_spans_parallel(mask, n_tok, spans):
    for t in prange(n_tok):
        _spans_of_token(mask, t, spans)


def n_tiles(n_kv: int) -> int:
    """Tiles of CELLS cells that cover n_kv cells."""
    return -(-n_kv // CELLS)


# The loops below index arrays element by element (Kf[c, j], not a row view kc = Kf[c]): a view
# made inside a loop costs numba two reference-count calls, more than the arithmetic of a cell.

@kernel(inline="always")
def _convert(k, v, g, c0, lo, hi, Kf, Vf):
    for c in range(lo, hi):
        for j in range(k.shape[2]):
            Kf[c, j] = as_f32(k[c0 + c, g, j])
        for j in range(k.shape[2]):
            Vf[c, j] = as_f32(v[c0 + c, g, j])


@kernel(inline="always")
def _scores(Qr, Kf, lo, hi, S):
    """S[c] = Qr . Kf[c] for c in [lo, hi), four cells at a time (each query load serves four keys)."""
    d = Qr.shape[0]
    c = lo
    while c + 4 <= hi:
        a0 = a1 = a2 = a3 = np.float32(0.0)
        for j in range(d):
            x = Qr[j]
            a0 += x * Kf[c, j]
            a1 += x * Kf[c + 1, j]
            a2 += x * Kf[c + 2, j]
            a3 += x * Kf[c + 3, j]
        S[c] = a0
        S[c + 1] = a1
        S[c + 2] = a2
        S[c + 3] = a3
        c += 4
    while c < hi:
        a = np.float32(0.0)
        for j in range(d):
            a += Qr[j] * Kf[c, j]
        S[c] = a
        c += 1


@kernel(inline="always")
def _accumulate(S, Vf, lo, hi, t, h, out):
    """out[t, h] += sum over c in [lo, hi) of S[c] * Vf[c], four cells per pass over the row."""
    d = out.shape[2]
    c = lo
    while c + 4 <= hi:
        p0, p1, p2, p3 = S[c], S[c + 1], S[c + 2], S[c + 3]
        for j in range(d):
            out[t, h, j] += (p0 * Vf[c, j] + p1 * Vf[c + 1, j]) + (p2 * Vf[c + 2, j] + p3 * Vf[c + 3, j])
        c += 4
    while c < hi:
        p = S[c]
        for j in range(d):
            out[t, h, j] += p * Vf[c, j]
        c += 1


@kernel(inline="always")
def _weigh(s, m, total):
    """Score s of one more cell against a row's running maximum m and total, in llama.cpp's order: a new
    maximum rescales the sums so far by ms = e^(m - s) (ggml_vec_scale) and the cell's value weighs 1;
    else it weighs vs = e^(s - m). Returns the new maximum, the new total, ms and vs."""
    ms = np.float32(1.0)
    vs = np.float32(1.0)
    if s > m:
        ms = np.float32(math.exp(m - s))
        m = s
    else:
        vs = np.float32(math.exp(s - m))
    return m, total * ms + vs, ms, vs


@kernel(inline="always")
def _accumulate_cells(S, Vf, mask, scale, t, h, c0, lo, hi, M, L, out, f16):
    """llama.cpp's own order, cell by cell (_weigh), each value row added times its weight (ggml_vec_mad); the
    scores of cells [lo, hi) are in S. With f16 (an f16 V cache) the running sum is kept rounded to f16
    after every step, as ggml's CPU kernel does (VKQ16); else it stays f32 (VKQ32)."""
    d = out.shape[2]
    for c in range(lo, hi):
        mv = as_f32(mask[t, c0 + c])
        if mv == -np.inf:
            continue
        M[t, h], L[t, h], ms, vs = _weigh(S[c] * scale + mv, M[t, h], L[t, h])
        if ms != 1.0:  # (times 1, the sums stay themselves)
            if f16:
                for j in range(d):
                    out[t, h, j] = f16_to_f32(f32_to_f16(out[t, h, j] * ms))
            else:
                for j in range(d):
                    out[t, h, j] *= ms
        if f16:
            for j in range(d):
                out[t, h, j] = f16_to_f32(f32_to_f16(fma(Vf[c, j], vs, out[t, h, j])))
        else:
            for j in range(d):
                out[t, h, j] = fma(Vf[c, j], vs, out[t, h, j])


@kernel(fastmath=_FLAGS)
def attend(q, k, v, mask, sinks, spans, scale, g, t0, t1, Kf, Vf, S, M, L, out):
    """out[t, h] for tokens t0..t1 and the query heads h sharing KV head g, queries as they are (f32): an
    online softmax over tiles of cells, each token's visible span of a tile in `spans`, then head h's sink
    when sinks is not empty; out holds the running sums, M and L each row's running maximum and total."""
    n_kv, d = k.shape[0], k.shape[2]
    group = q.shape[1] // k.shape[1]
    for t in range(t0, t1):
        for h in range(g * group, (g + 1) * group):
            M[t, h] = -np.inf
            L[t, h] = 0.0
            for j in range(d):
                out[t, h, j] = 0.0
    for c0 in range(0, n_kv, CELLS):
        nc = min(CELLS, n_kv - c0)
        clo, chi = nc, nc  # cells of the tile converted so far: [clo, chi)
        for t in range(t0, t1):
            lo, hi = spans[t, c0 // CELLS, 0], spans[t, c0 // CELLS, 1]
            if lo == hi:
                continue  # the whole tile is hidden from this token
            if clo == chi:
                _convert(k, v, g, c0, lo, hi, Kf, Vf)
                clo, chi = lo, hi
            else:
                if lo < clo:
                    _convert(k, v, g, c0, lo, clo, Kf, Vf)
                    clo = lo
                if hi > chi:
                    _convert(k, v, g, c0, chi, hi, Kf, Vf)
                    chi = hi
            for h in range(g * group, (g + 1) * group):
                _scores(q[t, h], Kf, lo, hi, S)
                m = M[t, h]
                for c in range(lo, hi):  # cells hidden inside [lo, hi) get -inf, hence weight 0
                    S[c] = S[c] * scale + as_f32(mask[t, c0 + c])
                    m = max(m, S[c])
                total = np.float32(0.0)
                for c in range(lo, hi):
                    p = expf(S[c] - m)
                    S[c] = p
                    total += p
                alpha = expf(M[t, h] - m)  # rescales what earlier tiles summed under the old maximum
                M[t, h] = m
                L[t, h] = L[t, h] * alpha + total
                if alpha != 1.0:
                    for j in range(d):
                        out[t, h, j] *= alpha
                _accumulate(S, Vf, lo, hi, t, h, out)
    _finish(sinks, t0, t1, g * group, (g + 1) * group, M, L, out)


@kernel(inline="always")
def _normalize(sinks, t, h, m, total, out):
    """Row (t, h) of running sums out[t, h] with maximum m and total `total`: head h's sink joins (when
    sinks is not empty), then the sums are divided by the total (a row that saw no cell stays 0)."""
    if sinks.shape[0]:
        total = fold_sink(sinks[h], m, total, out[t, h])
    inv = np.float32(1.0) / total if total > 0 else np.float32(0.0)
    for j in range(out.shape[2]):
        out[t, h, j] *= inv


@kernel(inline="always")
def _finish(sinks, t0, t1, h0, h1, M, L, out):
    """_normalize for tokens t0..t1 and heads h0..h1 (maxima M, totals L)."""
    for t in range(t0, t1):
        for h in range(h0, h1):
            _normalize(sinks, t, h, M[t, h], L[t, h], out)


@kernel(fastmath=_FLAGS)
def attend_rounded(q, k, v, mask, sinks, spans, scale, g0, g1, t0, t1, Qr, W, out):
    """out[t, h] for tokens t0..t1 and the query heads h of KV heads g0..g1 as llama.cpp's cell-by-cell
    kernel computes them: the queries rounded to f16 (Qr [heads, d] holds them), then each visible cell in
    turn, its score, its weight (_weigh) and its value row added to sums kept rounded to f16 (VKQ16).

    A token's visible span of each tile (`spans`; the rest is skipped) is done in three passes, each over
    the cells in order and, for each cell, over the heads: the scores (W[0]), then each head's running
    maximum and total (W[3, h, 0] and W[3, h, 1]: a worker's own, as all of W), which give every cell's
    weight (W[1]) and, where the maximum grew, the factor rescaling the sums before it (W[2]), then the
    value rows. Each pass reads a cell's keys or values of all those KV heads once, where they lie side by
    side, and the heads' chains of dependent steps interleave; each head's arithmetic, step by step, is
    ggml's."""
    d = k.shape[2]
    group = q.shape[1] // k.shape[1]
    h0, h1 = g0 * group, g1 * group
    for t in range(t0, t1):
        for h in range(h0, h1):
            W[3, h, 0] = -np.inf
            W[3, h, 1] = 0.0
            for j in range(d):
                out[t, h, j] = 0.0
                Qr[h, j] = f16_to_f32(f32_to_f16(q[t, h, j]))
        for b in range(spans.shape[1]):
            c0 = b * CELLS
            lo, hi = spans[t, b, 0], spans[t, b, 1]
            for c in range(lo, hi):
                mv = as_f32(mask[t, c0 + c])
                if mv == -np.inf:
                    continue
                for h in range(h0, h1):
                    g = h // group
                    a = np.float32(0.0)
                    for j in range(d):
                        a += Qr[h, j] * as_f32(k[c0 + c, g, j])
                    W[0, h, c] = a * scale + mv
            for c in range(lo, hi):
                if as_f32(mask[t, c0 + c]) == -np.inf:
                    continue
                for h in range(h0, h1):
                    W[3, h, 0], W[3, h, 1], W[2, h, c], W[1, h, c] = _weigh(W[0, h, c], W[3, h, 0], W[3, h, 1])
            for c in range(lo, hi):
                if as_f32(mask[t, c0 + c]) == -np.inf:
                    continue
                for h in range(h0, h1):
                    g = h // group
                    ms, vs = W[2, h, c], W[1, h, c]
                    if ms != 1.0:  # (times 1, the sums stay themselves)
                        for j in range(d):
                            out[t, h, j] = f16_to_f32(f32_to_f16(out[t, h, j] * ms))
                    for j in range(d):
                        out[t, h, j] = f16_to_f32(f32_to_f16(fma(as_f32(v[c0 + c, g, j]), vs, out[t, h, j])))
        for h in range(h0, h1):
            _normalize(sinks, t, h, W[3, h, 0], W[3, h, 1], out)


@kernel
def flash_attn_serial(q, k, v, mask, sinks, scale, q_f16, Kf, Vf, S, Qr, W, ML, spans, out):
    """out [tokens, heads, d] = softmax(q k^T * scale + mask) v for q [tokens, heads, d], k and v
    [n_kv, heads_kv, d] (f16 bits or f32), mask [>= tokens, n_kv], sinks f32 [heads] or empty (none);
    q_f16: llama numerics (attend_rounded); Kf..Qr: one worker's tiles; spans: room for tile_spans."""
    tile_spans(mask, q.shape[0], spans)
    if q_f16:
        attend_rounded(q, k, v, mask, sinks, spans, scale, 0, k.shape[1], 0, q.shape[0], Qr[0], W[0], out)
        return
    for g in range(k.shape[1]):
        attend(q, k, v, mask, sinks, spans, scale, g, 0, q.shape[0], Kf[0], Vf[0], S[0], ML[0], ML[1], out)


@kernel(parallel=True)
def flash_attn_parallel(q, k, v, mask, sinks, scale, q_f16, Kf, Vf, S, Qr, W, ML, spans, out):
    """flash_attn_serial with (KV heads, block of tokens) items dealt round-robin to Kf.shape[0] workers:
    a single KV head each, or under llama numerics a run of neighbouring KV heads each (their cells'
    rows are read whole)."""
    tile_spans_parallel(mask, q.shape[0], spans)
    workers = Kf.shape[0]
    n_tok, n_head_kv = q.shape[0], k.shape[1]
    runs = min(n_head_kv, workers) if q_f16 else n_head_kv
    blocks = max(1, min(n_tok, (2 * workers + runs - 1) // runs))
    per_block = (n_tok + blocks - 1) // blocks
    items = runs * blocks
    for w in prange(workers):
        for item in range(w, items, workers):
            run = item // blocks
            t0 = (item % blocks) * per_block
            t1 = min(n_tok, t0 + per_block)
            if t0 >= t1:
                continue
            if q_f16:
                attend_rounded(q, k, v, mask, sinks, spans, scale, run * n_head_kv // runs,
                               (run + 1) * n_head_kv // runs, t0, t1, Qr[w], W[w], out)
            else:
                attend(q, k, v, mask, sinks, spans, scale, run, t0, t1, Kf[w], Vf[w], S[w], ML[0], ML[1], out)


def _workers(node) -> int:
    """One worker, unless there are threads and enough work to share (a prompt, a long cache). A decode
    step's attention stays on one thread (Qwen3-0.6B's shape, 16 heads over 256 cells: 4096): split, it
    took ~19 instead of ~26 us alone, but ~61 instead of ~33 us inside decode steps on this shared 2-core
    machine, where the partner thread is often behind other processes."""
    q, k = node.srcs[0], node.srcs[1]
    work = q.shape[0] * q.shape[1] * k.shape[1]  # query rows x cells
    return 1 if jit.threads() == 1 or work < 16384 else jit.threads()


def _tiled(node) -> bool:
    """llama numerics (queries meet an f16 cache f16-rounded, cell by cell) on a batch of at least
    tiled.TILE_Q tokens: llama.cpp's CPU kernel takes its tiled path there, and so does ggrun."""
    return node.srcs[1].root.params.get("act_quant") == "f16" and node.srcs[0].shape[1] >= tiled.TILE_Q


def _spans_scratch(node) -> int:
    """int32 elements of the tile spans of a node's tokens."""
    return 2 * node.srcs[0].shape[1] * n_tiles(node.srcs[1].shape[1])


def flash_attn_scratch(node) -> int:
    q = node.srcs[0]
    d, rows = q.shape[2], q.shape[0] * q.shape[1]
    if _tiled(node):
        return 4 * tiled.scratch_floats(_workers(node), d)
    return 4 * (_workers(node) * (2 * CELLS * d + CELLS + q.shape[0] * (d + 4 * CELLS)) + 2 * rows
                + _spans_scratch(node))


def _stored(node, i: int, a: np.ndarray) -> np.ndarray | None:
    """A cache operand [heads_kv, n_kv, d] as [n_kv, heads_kv, d] C-contiguous (f16 as uint16)."""
    dtype = node.srcs[i].dtype
    if dtype not in (DType.F16, DType.F32):
        return None
    t = a.transpose(1, 0, 2)
    if not t.flags.c_contiguous:
        return None
    return t.view(np.uint16) if dtype is DType.F16 else t


def _spans_room(f32: np.ndarray, at: int, n_tok: int, n_kv: int) -> np.ndarray:
    """The tile spans' room in a node's scratch (its f32 view), from element `at`: int32 [n_tok, tiles, 2]."""
    shape = (n_tok, n_tiles(n_kv), 2)
    return f32[at:at + int(np.prod(shape))].view(np.int32).reshape(shape)


def _sinks(node, srcs) -> np.ndarray:
    """The heads' sinks as the kernels take them, f32 [heads], or an empty array for none. Read-only sinks
    (a memory-mapped weight's) are copied: numba compiles read-only arrays as a type of their own."""
    if not node.params.get("sinks"):
        return np.zeros(0, np.float32)
    s = srcs[4]
    return s if s.flags.writeable and s.flags.c_contiguous else np.array(s, np.float32)


@binds("flash_attn", scratch=flash_attn_scratch)
def bind_flash_attn(node, out, srcs, scratch):
    q, k, v, mask = srcs[:4]
    if node.srcs[0].dtype is not DType.F32 or node.srcs[1].dtype is not node.srcs[2].dtype:
        return None
    q3 = q.transpose(1, 0, 2)
    k3, v3 = _stored(node, 1, k), _stored(node, 2, v)
    if k3 is None or v3 is None or not q3.flags.c_contiguous or not out.flags.c_contiguous:
        return None
    mdt = node.srcs[3].dtype
    if mdt not in (DType.F16, DType.F32) or mask.strides[-1] != mask.itemsize:
        return None
    mask = mask.view(np.uint16) if mdt is DType.F16 else mask
    d, rows = q.shape[2], q.shape[0] * q.shape[1]
    workers = _workers(node)
    if scratch is None or scratch.size < flash_attn_scratch(node):
        return None
    f32 = scratch.view(np.float32)
    if _tiled(node):
        return tiled.bind(q3, k3, v3, mask, _sinks(node, srcs), np.float32(node.params["scale"]), workers, f32, out)
    tiles, at = [], 0
    for shape in ((workers, CELLS, d), (workers, CELLS, d), (workers, CELLS), (workers, q3.shape[1], d),
                  (workers, 4, q3.shape[1], CELLS), (2, q3.shape[0], q3.shape[1])):
        n = int(np.prod(shape))
        tiles.append(f32[at:at + n].reshape(shape))
        at += n
    tiles.append(_spans_room(f32, at, q3.shape[0], k3.shape[0]))
    scale = np.float32(node.params["scale"])
    q_f16 = node.srcs[1].root.params.get("act_quant") == "f16"
    sinks = _sinks(node, srcs)
    fn = flash_attn_parallel if workers > 1 else flash_attn_serial
    return lambda: fn(q3, k3, v3, mask, sinks, scale, q_f16, *tiles, out)


# ---- over a block-quantized cache (or K and V of two types): ggml's cell-by-cell order ----------
#
# As ggml's flash_attn_ext_f16_one_chunk computes it: each query row is turned by the rotation the
# K cache's rows were given (llama.cpp's attn_rot) and converted to K's vec_dot type (Q8_0 blocks
# for a Q8_0 or Q4_0 cache, f16 for an f16 one); each visible cell's score is ggml's dot product of
# the two (integer block sums for quantized keys); values are decoded to f32 and summed cell by
# cell in f32 (VKQ32), or in f16 for an f16 V cache (VKQ16); the result is turned back by V's
# rotation. Tiles of cells are decoded once per KV head for all the query rows that share it.

Q_PLAIN, Q_F16, Q_Q8_0 = 0, 1, 2  # how queries meet the keys: as they are, f16-rounded, Q8_0 blocks


@kernel(inline="always")
def _decode_cells(k, v, k_code, v_code, k_at, v_at, c0, lo, hi, Kq, Kd, Vf):
    """Cells [lo, hi) of the tile at c0 (their KV head's bytes from k_at, v_at of each row): keys
    into the columns of Kq, Kd, values into the rows of Vf."""
    for c in range(lo, hi):
        load_key(k_code, k[c0 + c], k_at, Kq, Kd, c)
        load_row(v_code, v[c0 + c], v_at, Vf[c])


@kernel(inline="always")
def _prepare_query(q, t, h, q_round, k_rot, qq, qd):
    """Query row q[t, h] as the keys meet it: rotated by k_rot (0: not), then rounded."""
    for j in range(qq.shape[0]):
        qq[j] = q[t, h, j]
    if k_rot:
        hadamard(qq, k_rot)
    if q_round == Q_Q8_0:
        quantize_q8_0(qq, qq, qd)
        return
    if q_round == Q_F16:
        for j in range(qq.shape[0]):
            qq[j] = f16_to_f32(f32_to_f16(qq[j]))
    for b in range(qd.shape[0]):
        qd[b] = np.float32(1.0)


@kernel(_nrt=False)
def attend_cells(q, k, v, k_code, v_code, n_head_kv, mask, sinks, spans, scale, q_round, v_f16, k_rot, v_rot, g, t0, t1,
                 Kq, Kd, Vf, S, lanes, Qq, Qd, M, L, out):
    """out[t, h] for tokens t0..t1 and the query heads h sharing KV head g, over caches k and v
    given as their stored rows (bytes [n_kv, row bytes] of types k_code and v_code, n_head_kv heads
    side by side), then head h's sink when sinks is not empty. A tile's keys are decoded across cells
    (Kq [d, cells], Kd [d / 32, cells]), its values along them (Vf [cells, d])."""
    n_kv, d = k.shape[0], q.shape[2]
    group = q.shape[1] // n_head_kv
    k_at, v_at = g * (k.shape[1] // n_head_kv), g * (v.shape[1] // n_head_kv)
    for t in range(t0, t1):
        for h in range(g * group, (g + 1) * group):
            M[t, h] = -np.inf
            L[t, h] = 0.0
            for j in range(d):
                out[t, h, j] = 0.0
            _prepare_query(q, t, h, q_round, k_rot, Qq[t, h], Qd[t, h])
    for c0 in range(0, n_kv, CELLS):
        nc = min(CELLS, n_kv - c0)
        clo, chi = nc, nc  # cells of the tile decoded so far: [clo, chi)
        for t in range(t0, t1):
            lo, hi = spans[t, c0 // CELLS, 0], spans[t, c0 // CELLS, 1]
            if lo == hi:
                continue
            if clo == chi:
                _decode_cells(k, v, k_code, v_code, k_at, v_at, c0, lo, hi, Kq, Kd, Vf)
                clo, chi = lo, hi
            else:
                if lo < clo:
                    _decode_cells(k, v, k_code, v_code, k_at, v_at, c0, lo, clo, Kq, Kd, Vf)
                    clo = lo
                if hi > chi:
                    _decode_cells(k, v, k_code, v_code, k_at, v_at, c0, chi, hi, Kq, Kd, Vf)
                    chi = hi
            for h in range(g * group, (g + 1) * group):
                score_cells(Kq, Kd, Qq[t, h], Qd[t, h], lo, hi, lanes, S)
                _accumulate_cells(S, Vf, mask, scale, t, h, c0, lo, hi, M, L, out, v_f16)
    for t in range(t0, t1):
        for h in range(g * group, (g + 1) * group):
            if sinks.shape[0]:
                L[t, h] = fold_sink(sinks[h], M[t, h], L[t, h], out[t, h])
            inv = np.float32(1.0) / L[t, h] if L[t, h] != 0 else np.float32(0.0)
            for j in range(d):
                out[t, h, j] *= inv
            if v_rot:
                hadamard(out[t, h], v_rot)


@kernel
def flash_attn_cells_serial(q, k, v, k_code, v_code, n_head_kv, mask, sinks, scale, q_round, v_f16, k_rot, v_rot,
                            Kq, Kd, Vf, S, lanes, Qq, Qd, ML, spans, out):
    tile_spans(mask, q.shape[0], spans)
    for g in range(n_head_kv):
        attend_cells(q, k, v, k_code, v_code, n_head_kv, mask, sinks, spans, scale, q_round, v_f16, k_rot, v_rot, g, 0,
                     q.shape[0], Kq[0], Kd[0], Vf[0], S[0], lanes[0], Qq, Qd, ML[0], ML[1], out)


@kernel(parallel=True)
def flash_attn_cells_parallel(q, k, v, k_code, v_code, n_head_kv, mask, sinks, scale, q_round, v_f16, k_rot, v_rot,
                              Kq, Kd, Vf, S, lanes, Qq, Qd, ML, spans, out):
    """flash_attn_cells_serial with (KV head, block of tokens) items dealt round-robin to workers."""
    tile_spans_parallel(mask, q.shape[0], spans)
    workers = Kq.shape[0]
    n_tok = q.shape[0]
    blocks = max(1, min(n_tok, (2 * workers + n_head_kv - 1) // n_head_kv))
    per_block = (n_tok + blocks - 1) // blocks
    items = n_head_kv * blocks
    for w in prange(workers):
        for item in range(w, items, workers):
            g = item // blocks
            t0 = (item % blocks) * per_block
            t1 = min(n_tok, t0 + per_block)
            if t0 < t1:
                attend_cells(q, k, v, k_code, v_code, n_head_kv, mask, sinks, spans, scale, q_round, v_f16, k_rot,
                             v_rot, g, t0, t1, Kq[w], Kd[w], Vf[w], S[w], lanes[w], Qq, Qd, ML[0], ML[1], out)


def _cells_case(node) -> bool:
    """Attention the cell-by-cell kernel takes: a quantized cache, or K and V of two types."""
    k, v = node.srcs[1].dtype, node.srcs[2].dtype
    return k in CACHE_TYPES and v in CACHE_TYPES and (k.is_quantized or v.is_quantized or k is not v) \
        and node.srcs[0].shape[2] % BLOCK == 0


def flash_attn_cells_scratch(node) -> int:
    if not _cells_case(node):
        return 0
    q = node.srcs[0]
    d, rows = q.shape[2], q.shape[0] * q.shape[1]
    per_worker = 2 * CELLS * d + CELLS * (d // BLOCK) + CELLS + 8 * CELLS
    return 4 * (_workers(node) * per_worker + rows * (d + d // BLOCK) + 2 * rows + _spans_scratch(node))


def _cache_rows(node, i: int, a: np.ndarray) -> np.ndarray | None:
    """A cache operand [heads_kv, n_kv, d] as the stored rows it reads, bytes [n_kv, row bytes]
    (C-contiguous, so the kernels read them with unit strides), when its heads fill whole rows."""
    t = node.srcs[i]
    n_head, n_kv, d = t.shape
    head_bytes = t.dtype.row_bytes(d)
    if t.strides[0] != head_bytes or t.strides[1] != n_head * head_bytes:
        return None
    if t.dtype.is_quantized:
        return a.reshape(-1)[:n_kv * n_head * head_bytes].reshape(n_kv, n_head * head_bytes)
    rows = a.transpose(1, 0, 2)
    return rows.reshape(n_kv, -1).view(np.uint8) if rows.flags.c_contiguous else None


def _query_rounding(node) -> int:
    act_quant = node.srcs[1].root.params.get("act_quant")
    return {"f16": Q_F16, "q8_0": Q_Q8_0}.get(act_quant, Q_PLAIN)


@binds("flash_attn", scratch=flash_attn_cells_scratch)
def bind_flash_attn_cells(node, out, srcs, scratch):
    q, k, v, mask = srcs[:4]
    if node.srcs[0].dtype is not DType.F32 or not _cells_case(node):
        return None
    q3 = q.transpose(1, 0, 2)
    k2, v2 = _cache_rows(node, 1, k), _cache_rows(node, 2, v)
    if k2 is None or v2 is None or not q3.flags.c_contiguous or not out.flags.c_contiguous:
        return None
    mdt = node.srcs[3].dtype
    if mdt not in (DType.F16, DType.F32) or mask.strides[-1] != mask.itemsize:
        return None
    mask = mask.view(np.uint16) if mdt is DType.F16 else mask
    if scratch is None or scratch.size < flash_attn_cells_scratch(node):
        return None
    d, n_tok, n_head = q3.shape[2], q3.shape[0], q3.shape[1]
    workers = _workers(node)
    f32 = scratch.view(np.float32)
    tiles, at = [], 0
    for shape in ((workers, d, CELLS), (workers, d // BLOCK, CELLS), (workers, CELLS, d), (workers, CELLS),
                  (workers, 8, CELLS), (n_tok, n_head, d), (n_tok, n_head, d // BLOCK), (2, n_tok, n_head)):
        n = int(np.prod(shape))
        tiles.append(f32[at:at + n].reshape(shape))
        at += n
    tiles.append(_spans_room(f32, at, n_tok, k2.shape[0]))
    k_type, v_type = node.srcs[1], node.srcs[2]
    v_f16 = v_type.dtype is DType.F16 and v_type.root.params.get("act_quant") == "f16"
    args = (q3, k2, v2, code_of(k_type.dtype), code_of(v_type.dtype), k_type.shape[0], mask, _sinks(node, srcs),
            np.float32(node.params["scale"]), _query_rounding(node), v_f16,
            int(k_type.root.params.get("hadamard", 0)), int(v_type.root.params.get("hadamard", 0)))
    fn = flash_attn_cells_parallel if workers > 1 else flash_attn_cells_serial
    return lambda: fn(*args, *tiles, out)


# ---- first-run compilation: the signatures a model's graphs meet ---------------------------------

def _warm_flash_attn(lf, dtype: DType, n_tokens: int):
    """Attention over a cache of `dtype` (f16 with q rounded, as llama numerics do): one token (the
    one-thread kernel), a short prompt (the threaded kernel too, when there are threads) and, over an
    f16 cache, a prompt of tiled.TILE_Q tokens (the tiled kernel)."""
    from ggrun.core import ops
    from ggrun.core.tensor import new_tensor

    n_kv, h, d = 256, 4, 16
    caches = []
    for name in ("k", "v"):
        c = lf.ctx.new_tensor(name, dtype, (n_kv, d))
        lf.ctx.backend.set_tensor(c, np.zeros((n_kv, d), dtype.np_dtype))
        if dtype is DType.F16:
            c.params["act_quant"] = "f16"
        caches.append(ops.permute(ops.view(c, (n_kv, 1, d)), (1, 0, 2)))
    mask = new_tensor("mask", DType.F16, (n_tokens, n_kv), is_input=True)
    lf.feeds[mask] = np.zeros((n_tokens, n_kv), np.float16)
    q = ops.permute(lf.input("q", np.ones((n_tokens, h, d), np.float32)), (1, 0, 2))
    return ops.flash_attn(q, caches[0], caches[1], mask, 0.25)


def _warm_flash_attn_cells(lf, n_tokens: int):
    """Attention over a quantized cache (one signature serves every pair of cache types); the
    prompt-sized graph has enough work to compile the threaded kernel where there are threads."""
    from ggrun.core import ops
    from ggrun.core.tensor import new_tensor

    n_kv, h, d = 64, 16, 32
    caches = []
    for name in ("k", "v"):
        c = lf.ctx.new_tensor(name, DType.Q8_0, (n_kv, h * d))
        lf.ctx.backend.set_tensor(c, np.zeros((n_kv, DType.Q8_0.row_bytes(h * d)), np.uint8))
        caches.append(ops.permute(ops.view(c, (n_kv, h, d), (c.strides[0], DType.Q8_0.row_bytes(d), 0)), (1, 0, 2)))
    caches[0].root.params["act_quant"] = "q8_0"
    mask = new_tensor("mask", DType.F16, (n_tokens, n_kv), is_input=True)
    lf.feeds[mask] = np.zeros((n_tokens, n_kv), np.float16)
    q = ops.permute(lf.input("q", np.ones((n_tokens, h, d), np.float32)), (1, 0, 2))
    return ops.flash_attn(q, caches[0], caches[1], mask, 0.25)


for _dtype, _sizes in ((DType.F16, (1, 32, tiled.TILE_Q)), (DType.F32, (1, 32))):
    for _n in _sizes:
        warms(lambda lf, d=_dtype, n=_n: _warm_flash_attn(lf, d, n), needs={kv(_dtype)})
for _n in (1, 64):
    warms(lambda lf, n=_n: _warm_flash_attn_cells(lf, n), needs={kv(DType.Q8_0)})
