"""Compiled sampling (ops.sample): every row of logits through llama.cpp's sampler chain at once, rows
shared among the threads, only token ids written.

Each row is computed as core/llm/sampling.py's Sampler (and the reference kernel) computes it: the
logit bias added in order, the penalties over the distinct recent tokens, the top-k candidates best
first (a heap of k, so a step costs about one pass over the vocabulary; equal logits keep the lower
id first), probabilities in f32 normalized by numpy's pairwise sum, top-p and min-p cuts, the
temperature, and the draw through a float64 cumulative sum as numpy's Generator.choice does it. The
only departures possible are last-bit differences of exp between numpy's and the C library's (a draw
that lands within an ulp of a boundary) and the order of exactly equal logits.
"""
from __future__ import annotations

import math

import numpy as np
from numba import prange

from ggrun.core.backends.cpu import jit
from ggrun.core.backends.cpu.dispatch import binds
from ggrun.core.backends.cpu.jit import kernel

PW_BLOCK = 128  # numpy's pairwise summation block


@kernel
def _block_sum(a, lo, n):
    """numpy's pairwise_sum of at most PW_BLOCK values: in order below 8, else in eight lanes."""
    if n < 8:
        res = np.float32(-0.0)
        for i in range(lo, lo + n):
            res += a[i]
        return res
    r0, r1, r2, r3 = a[lo], a[lo + 1], a[lo + 2], a[lo + 3]
    r4, r5, r6, r7 = a[lo + 4], a[lo + 5], a[lo + 6], a[lo + 7]
    i = 8
    while i < n - (n % 8):
        r0 += a[lo + i]
        r1 += a[lo + i + 1]
        r2 += a[lo + i + 2]
        r3 += a[lo + i + 3]
        r4 += a[lo + i + 4]
        r5 += a[lo + i + 5]
        r6 += a[lo + i + 6]
        r7 += a[lo + i + 7]
        i += 8
    res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < n:
        res += a[lo + i]
        i += 1
    return res


@kernel
def pairwise_sum(a, lo, n):
    """numpy's sum of n f32 values a[lo:lo + n] (its pairwise_sum: halves, cut at multiples of 8, down to
    blocks of PW_BLOCK), walked with a stack of its own: numba's cache mishandles recursive kernels."""
    if n <= PW_BLOCK:
        return _block_sum(a, lo, n)
    f_lo = np.empty(128, dtype=np.int64)  # pending halves: (first, count, 1 when both halves are summed)
    f_n = np.empty(128, dtype=np.int64)
    f_join = np.empty(128, dtype=np.int64)
    sums = np.empty(128, dtype=np.float32)
    top, depth = 0, 0
    f_lo[0], f_n[0], f_join[0] = lo, n, 0
    top = 1
    while top:
        top -= 1
        at, cnt, join = f_lo[top], f_n[top], f_join[top]
        if join:
            depth -= 1
            sums[depth - 1] = sums[depth - 1] + sums[depth]
        elif cnt <= PW_BLOCK:
            sums[depth] = _block_sum(a, at, cnt)
            depth += 1
        else:
            n2 = cnt // 2
            n2 -= n2 % 8
            f_lo[top], f_n[top], f_join[top] = at, cnt, 1
            f_lo[top + 1], f_n[top + 1], f_join[top + 1] = at + n2, cnt - n2, 0
            f_lo[top + 2], f_n[top + 2], f_join[top + 2] = at, n2, 0
            top += 3
    return sums[0]


@kernel(inline="always")
def _before(xa, ia, xb, ib):
    """Whether candidate (xa, ia) ranks before (xb, ib): a larger logit, or an equal one at a lower id."""
    return xa > xb or (xa == xb and ia < ib)


@kernel
def _sift_down(hv, hi, k, at):
    """Restore the heap (lowest-ranked candidate at the root) below `at`."""
    while True:
        low = at
        for child in (2 * at + 1, 2 * at + 2):
            if child < k and _before(hv[low], hi[low], hv[child], hi[child]):
                low = child
        if low == at:
            return
        hv[at], hv[low] = hv[low], hv[at]
        hi[at], hi[low] = hi[low], hi[at]
        at = low


@kernel
def top_candidates(x, k, vals, ids):
    """The k best of x into vals / ids, best first (a heap of the k best seen; ties: lower id first)."""
    for i in range(k):
        vals[i] = x[i]
        ids[i] = i
    for at in range(k // 2 - 1, -1, -1):
        _sift_down(vals, ids, k, at)
    for i in range(k, len(x)):
        if x[i] > vals[0]:  # an equal logit ranks after the root: every id in the heap is lower
            vals[0] = x[i]
            ids[0] = i
            _sift_down(vals, ids, k, 0)
    for end in range(k - 1, 0, -1):  # pop the lowest to the back: best first in the end
        vals[0], vals[end] = vals[end], vals[0]
        ids[0], ids[end] = ids[end], ids[0]
        _sift_down(vals, ids, end, 0)


@kernel
def _penalize(x, recent, rp, fp, pp):
    """llama.cpp's penalties over the distinct tokens of `recent` (-1: none) with their counts."""
    toks = np.sort(recent[recent >= 0])
    i = 0
    while i < len(toks):
        j = i
        while j < len(toks) and toks[j] == toks[i]:
            j += 1
        t = toks[i]
        v = x[t]
        v = v * rp if v <= 0 else v / rp
        x[t] = v - np.float32(j - i) * fp - pp
        i = j


@kernel
def sample_row(logits, params, u, recent, bias_ids, bias_vals):
    """One row's token (-1 for logits holding NaN or infinity)."""
    n = logits.shape[0]
    spread = np.float32(0.0)
    for i in range(n):  # x - x is 0 for finite x and NaN otherwise: one branch-free pass
        spread += logits[i] - logits[i]
    if spread != 0:
        return -1
    x = logits.copy()
    for j in range(len(bias_ids)):
        if bias_ids[j] >= 0:
            x[bias_ids[j]] += bias_vals[j]
    temp, top_k, top_p, min_p = params[0], params[1], params[2], params[3]
    rp, fp, pp = params[4], params[5], params[6]
    if rp != 1 or fp != 0 or pp != 0:
        _penalize(x, recent, rp, fp, pp)
    if temp <= 0:
        best = 0
        for i in range(1, n):
            if x[i] > x[best]:
                best = i
        return best
    k = int(top_k) if 0 < int(top_k) < n else n
    vals = np.empty(k, dtype=np.float32)
    ids = np.empty(k, dtype=np.int64)
    if k < n:
        top_candidates(x, k, vals, ids)
    else:
        order = np.argsort(-x, kind="mergesort")
        for i in range(n):
            ids[i] = order[i]
            vals[i] = x[order[i]]
    probs = np.empty(k, dtype=np.float32)
    for i in range(k):
        probs[i] = np.float32(math.exp(vals[i] - vals[0]))
    total = pairwise_sum(probs, 0, k)
    for i in range(k):
        probs[i] /= total
    keep = k
    if top_p < 1:
        acc = np.float32(0.0)
        for i in range(k):
            acc += probs[i]
            if acc >= top_p:
                keep = min(keep, i + 1)
                break
    if min_p > 0:
        floor = min_p * probs[0]
        count = 0
        for i in range(k):
            if probs[i] >= floor:
                count += 1
        keep = min(keep, max(1, count))
    for i in range(keep):
        probs[i] = np.float32(math.exp((vals[i] - vals[0]) / temp))
    total = pairwise_sum(probs, 0, keep)
    cdf = np.empty(keep, dtype=np.float64)
    acc64 = 0.0
    for i in range(keep):
        acc64 += np.float64(probs[i] / total)
        cdf[i] = acc64
    last = cdf[keep - 1]
    for i in range(keep):
        if cdf[i] / last > u:
            return ids[i]
    return ids[keep - 1]


@kernel(parallel=True)
def sample_rows(logits, params, u, recent, bias_ids, bias_vals, out):
    for r in prange(logits.shape[0]):
        out[r] = sample_row(logits[r], params[r], u[r], recent[r], bias_ids[r], bias_vals[r])


@kernel
def sample_rows_serial(logits, params, u, recent, bias_ids, bias_vals, out):
    for r in range(logits.shape[0]):
        out[r] = sample_row(logits[r], params[r], u[r], recent[r], bias_ids[r], bias_vals[r])


@binds("sample")
def bind_sample(node, out, srcs, scratch):
    logits, params, draws, recent, bias_ids, bias_vals = srcs
    if not all(a.flags.c_contiguous for a in (logits, draws)):
        return None
    u = draws.view(np.float64)[:, 0]
    fn = sample_rows if jit.threads() > 1 and logits.shape[0] > 1 else sample_rows_serial
    return lambda: fn(logits, params, u, recent, bias_ids, bias_vals, out)


@kernel
def logprobs_row(x, own, n_probs, vals, ids, out):
    """One row of ops.sample_logprobs into out: the log-softmax after the row's maximum, its exponentials
    summed in f64, the top n_probs from top_candidates (equal logits: lower id first)."""
    n = x.shape[0]
    mx = x[0]
    for i in range(1, n):
        if x[i] > mx:
            mx = x[i]
    total = 0.0
    for i in range(n):
        total += np.float64(np.float32(math.exp(np.float32(x[i] - mx))))
    lse = np.float32(math.log(total))
    out[0] = np.float32(x[own] - mx) - lse if 0 <= own < n else np.nan
    if n_probs:
        top_candidates(x, n_probs, vals, ids)
        for j in range(n_probs):
            out[1 + 2 * j] = np.float32(ids[j])
            out[2 + 2 * j] = np.float32(vals[j] - mx) - lse


@kernel(parallel=True)
def logprobs_rows(logits, own, n_probs, out):
    for r in prange(logits.shape[0]):
        vals = np.empty(max(n_probs, 1), dtype=np.float32)
        ids = np.empty(max(n_probs, 1), dtype=np.int64)
        logprobs_row(logits[r], own[r], n_probs, vals, ids, out[r])


@binds("sample_logprobs")
def bind_sample_logprobs(node, out, srcs, scratch):
    logits, own = srcs
    if not out.flags.c_contiguous:
        return None
    n = node.params["n_probs"]
    return lambda: logprobs_rows(logits, own, n, out)
