"""Attention of a prompt batch over an f16 or f32 cache as llama.cpp's CPU kernel computes it from
GGML_FA_TILE_Q (64) query tokens on (ggml_compute_forward_flash_attn_ext_tiled): a tile of up to 64
query tokens of one head meets tiles of 64 cache cells; the queries stay f32 (not rounded to f16 as in
its cell-by-cell path), the scores of a tile come from one small product, the softmax is online per
tile of cells with f32 sums, and the values are summed into an f32 accumulator.

Work items are (head, tile of tokens); the cache tiles are converted to f32 once per item. Rows are
computed four at a time (a tile's last rows padded with copies of its last token), so that each key
and value row loaded serves four queries, over the span of cells the four see; each row's result is
the same whichever tile holds it. Attention sinks (gpt-oss's) join each row's softmax after its last tile
(sinks.fold_sink).
"""
from __future__ import annotations

import numpy as np
from numba import prange

from ggrun.core.backends.cpu.jit import kernel
from ggrun.core.backends.cpu.sinks import fold_sink
from ggrun.core.backends.cpu.vecmath import as_f32, expf

TILE_Q = 64  # query tokens per tile (GGML_FA_TILE_Q); smaller batches take the cell-by-cell path
CELLS = 64  # cache cells per tile (GGML_FA_TILE_KV)
ROWS = 4  # query rows computed together
_NEG_INF = np.float32(-np.inf)

# Dot products and sums over head_dim run in SIMD lanes (as ggml's simd_gemm), hence `reassoc`.
_FLAGS = {"reassoc", "contract"}


@kernel(inline="always")
def _convert(k, v, g, c0, nc, Kf, Vf):
    """Cells [c0, c0 + nc) of KV head g as f32 rows of Kf and Vf; the rest of the tile is zero."""
    d = k.shape[2]
    for c in range(nc):
        for j in range(d):
            Kf[c, j] = as_f32(k[c0 + c, g, j])
        for j in range(d):
            Vf[c, j] = as_f32(v[c0 + c, g, j])
    for c in range(nc, CELLS):
        for j in range(d):
            Kf[c, j] = 0.0
            Vf[c, j] = 0.0


@kernel(inline="always")
def _scores(q, rows, h, Kf, lo, hi, KQ, r):
    """KQ[r + i, c] = q[rows[r + i], h] . Kf[c] for the four rows i and cells c in [lo, hi) (multiples of 4)."""
    d = Kf.shape[1]
    t0, t1, t2, t3 = rows[r], rows[r + 1], rows[r + 2], rows[r + 3]
    for c in range(lo, hi, 4):
        a00 = a01 = a02 = a03 = np.float32(0.0)
        a10 = a11 = a12 = a13 = np.float32(0.0)
        a20 = a21 = a22 = a23 = np.float32(0.0)
        a30 = a31 = a32 = a33 = np.float32(0.0)
        for j in range(d):
            k0, k1, k2, k3 = Kf[c, j], Kf[c + 1, j], Kf[c + 2, j], Kf[c + 3, j]
            x = q[t0, h, j]
            a00 += x * k0
            a01 += x * k1
            a02 += x * k2
            a03 += x * k3
            x = q[t1, h, j]
            a10 += x * k0
            a11 += x * k1
            a12 += x * k2
            a13 += x * k3
            x = q[t2, h, j]
            a20 += x * k0
            a21 += x * k1
            a22 += x * k2
            a23 += x * k3
            x = q[t3, h, j]
            a30 += x * k0
            a31 += x * k1
            a32 += x * k2
            a33 += x * k3
        KQ[r, c], KQ[r, c + 1], KQ[r, c + 2], KQ[r, c + 3] = a00, a01, a02, a03
        KQ[r + 1, c], KQ[r + 1, c + 1], KQ[r + 1, c + 2], KQ[r + 1, c + 3] = a10, a11, a12, a13
        KQ[r + 2, c], KQ[r + 2, c + 1], KQ[r + 2, c + 2], KQ[r + 2, c + 3] = a20, a21, a22, a23
        KQ[r + 3, c], KQ[r + 3, c + 1], KQ[r + 3, c + 2], KQ[r + 3, c + 3] = a30, a31, a32, a33


@kernel(inline="always")
def _accumulate(KQ, Vf, lo, hi, r, VKQ):
    """VKQ[r + i] += sum over c in [lo, hi) of KQ[r + i, c] * Vf[c] for the four rows i, four cells a pass."""
    d = Vf.shape[1]
    for c in range(lo, hi, 4):
        p00, p01, p02, p03 = KQ[r, c], KQ[r, c + 1], KQ[r, c + 2], KQ[r, c + 3]
        p10, p11, p12, p13 = KQ[r + 1, c], KQ[r + 1, c + 1], KQ[r + 1, c + 2], KQ[r + 1, c + 3]
        p20, p21, p22, p23 = KQ[r + 2, c], KQ[r + 2, c + 1], KQ[r + 2, c + 2], KQ[r + 2, c + 3]
        p30, p31, p32, p33 = KQ[r + 3, c], KQ[r + 3, c + 1], KQ[r + 3, c + 2], KQ[r + 3, c + 3]
        for j in range(d):
            v0, v1, v2, v3 = Vf[c, j], Vf[c + 1, j], Vf[c + 2, j], Vf[c + 3, j]
            VKQ[r, j] += (p00 * v0 + p01 * v1) + (p02 * v2 + p03 * v3)
            VKQ[r + 1, j] += (p10 * v0 + p11 * v1) + (p12 * v2 + p13 * v3)
            VKQ[r + 2, j] += (p20 * v0 + p21 * v1) + (p22 * v2 + p23 * v3)
            VKQ[r + 3, j] += (p30 * v0 + p31 * v1) + (p32 * v2 + p33 * v3)


@kernel(inline="always")
def _softmax_row(KQ, i, mask, t, c0, lo, hi, scale, M, S, VKQ):
    """Row i of the tile's scores (token t, cells [lo, hi) computed) into weights under the row's
    running maximum M[i]: the mask added, the sum of values so far rescaled where the maximum grew,
    S[i] the running total. Cells outside [lo, hi), hidden from every token of the tile, weigh 0."""
    m = _NEG_INF
    for c in range(CELLS):
        x = KQ[i, c] * scale + as_f32(mask[t, c0 + c]) if lo <= c < hi else _NEG_INF
        KQ[i, c] = x
        m = max(m, x)
    if m == -np.inf:  # the whole tile is hidden from this token
        for c in range(CELLS):
            KQ[i, c] = 0.0
        return
    if m > M[i]:
        ms = expf(M[i] - m)
        for j in range(VKQ.shape[1]):
            VKQ[i, j] *= ms
        S[i] *= ms
        M[i] = m
    m = M[i]
    total = np.float32(0.0)
    for c in range(CELLS):
        p = expf(KQ[i, c] - m)
        KQ[i, c] = p
        total += p
    S[i] += total


@kernel(inline="always")
def _span(mask, t0, n, c0, nc):
    """[lo, hi) of the tile's cells from the first to the last that any of tokens t0..t0+n sees, widened
    to multiples of 4 (lo == hi when the tile is hidden from all of them)."""
    lo, hi = nc, 0
    for t in range(t0, t0 + n):
        a = 0
        while a < nc and as_f32(mask[t, c0 + a]) == -np.inf:
            a += 1
        if a == nc:
            continue
        b = nc
        while as_f32(mask[t, c0 + b - 1]) == -np.inf:
            b -= 1
        lo, hi = min(lo, a), max(hi, b)
    if lo >= hi:
        return 0, 0
    return lo - lo % 4, min(CELLS, (hi + 3) // 4 * 4)


@kernel(fastmath=_FLAGS)
def attend_tile(q, k, v, mask, sinks, scale, h, t0, n, Kf, Vf, KQ, VKQ, M, S, rows, out):
    """out[t, h] for the n tokens t0.. of head h (n <= TILE_Q): tiles of cells in order, online softmax, then
    head h's sink when sinks is not empty."""
    n_kv, d = k.shape[0], k.shape[2]
    g = h // (q.shape[1] // k.shape[1])
    n_pad = (n + ROWS - 1) // ROWS * ROWS
    for i in range(n_pad):
        M[i] = -np.inf
        S[i] = 0.0
        rows[i] = t0 + min(i, n - 1)  # padding rows repeat the last token; their results are dropped
        for j in range(d):
            VKQ[i, j] = 0.0
    for c0 in range(0, n_kv, CELLS):
        nc = min(CELLS, n_kv - c0)
        lo, hi = _span(mask, t0, n, c0, nc)
        if lo == hi:
            continue
        _convert(k, v, g, c0, nc, Kf, Vf)
        for r in range(0, n_pad, ROWS):
            # only the cells these four rows see (hidden ones weigh 0 exactly, so this changes no bit)
            lo, hi = _span(mask, t0 + r, min(ROWS, n - r), c0, nc)
            if lo == hi:
                continue
            _scores(q, rows, h, Kf, lo, hi, KQ, r)
            for i in range(r, r + ROWS):
                _softmax_row(KQ, i, mask, rows[i], c0, lo, min(hi, nc), scale, M, S, VKQ)
            _accumulate(KQ, Vf, lo, hi, r, VKQ)
    for i in range(n):
        if sinks.shape[0]:
            S[i] = fold_sink(sinks[h], M[i], S[i], VKQ[i])
        inv = np.float32(1.0) / S[i] if S[i] != 0 else np.float32(0.0)
        for j in range(d):
            out[t0 + i, h, j] = VKQ[i, j] * inv


@kernel
def _item(q, k, v, mask, sinks, scale, item, Kf, Vf, KQ, VKQ, M, S, rows, out):
    """Work item `item`: tiles of tokens outer, heads inner (so items grow with the causal span)."""
    n_head = q.shape[1]
    tile, h = item // n_head, item % n_head
    t0 = tile * TILE_Q
    attend_tile(q, k, v, mask, sinks, scale, h, t0, min(TILE_Q, q.shape[0] - t0), Kf, Vf, KQ, VKQ, M, S, rows, out)


@kernel
def flash_attn_tiled_serial(q, k, v, mask, sinks, scale, Kf, Vf, KQ, VKQ, ML, rows, out):
    """out [tokens, heads, d] = softmax(q k^T * scale + mask) v for q [tokens, heads, d], k and v
    [n_kv, heads_kv, d] (f16 bits or f32), mask [>= tokens, n_kv], sinks f32 [heads] or empty (none);
    Kf..rows: one worker's tiles."""
    items = (q.shape[0] + TILE_Q - 1) // TILE_Q * q.shape[1]
    for item in range(items):
        _item(q, k, v, mask, sinks, scale, item, Kf[0], Vf[0], KQ[0], VKQ[0], ML[0, 0], ML[0, 1], rows[0], out)


@kernel(parallel=True)
def flash_attn_tiled_parallel(q, k, v, mask, sinks, scale, Kf, Vf, KQ, VKQ, ML, rows, out):
    """flash_attn_tiled_serial with the items dealt to Kf.shape[0] workers back and forth (0 1 1 0 0 1 ..),
    so that the growing causal spans of later tiles even out."""
    workers = Kf.shape[0]
    items = (q.shape[0] + TILE_Q - 1) // TILE_Q * q.shape[1]
    for w in prange(workers):
        for item in range(items):
            turn, at = item // workers, item % workers
            if (at if turn % 2 == 0 else workers - 1 - at) == w:
                _item(q, k, v, mask, sinks, scale, item, Kf[w], Vf[w], KQ[w], VKQ[w], ML[w, 0], ML[w, 1], rows[w], out)


def scratch_floats(workers: int, d: int) -> int:
    """f32 elements of work space the tiled kernel needs for `workers` workers and head size d."""
    return workers * (2 * CELLS * d + TILE_Q * CELLS + TILE_Q * d + 3 * TILE_Q)


def bind(q3: np.ndarray, k3: np.ndarray, v3: np.ndarray, mask: np.ndarray, sinks: np.ndarray, scale: np.float32,
         workers: int, scratch: np.ndarray, out: np.ndarray):
    """The call computing out from q3 [tokens, heads, d] and the cache operands k3, v3 [n_kv, heads_kv, d]
    (and the heads' sinks, f32, empty for none) in scratch (f32, at least scratch_floats long)."""
    d = q3.shape[2]
    tiles, at = [], 0
    for shape in ((workers, CELLS, d), (workers, CELLS, d), (workers, TILE_Q, CELLS), (workers, TILE_Q, d),
                  (workers, 2, TILE_Q)):
        size = int(np.prod(shape))
        tiles.append(scratch[at:at + size].reshape(shape))
        at += size
    rows = scratch[at:at + workers * TILE_Q].view(np.int32).reshape(workers, TILE_Q)
    fn = flash_attn_tiled_parallel if workers > 1 else flash_attn_tiled_serial
    return lambda: fn(q3, k3, v3, mask, sinks, scale, *tiles, rows, out)
