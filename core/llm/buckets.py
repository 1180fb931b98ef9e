"""Decode steps of many sequences padded to a few batch sizes, so that a handful of graphs serve them all.

A step that decodes one token of each of B sequences (every row asking logits) gets a graph whose
shapes hold B. Were B itself the shape, every sequence that joins or leaves would build and plan a new
graph. So B is rounded up to a power of two (a bucket: 1, 2, 4, ... up to MAX_BUCKET, or n_ubatch when
smaller), and the rows past B are padding: token 0 at position 0, each writing its key and value into
one free cell of each cache that no token sees (the mask hides free cells), attending to cell 0 only
(finite, whatever it holds, so no NaN), its logits computed and never read. The graph of a bucket is
then reused while B moves within it.

A session of many sequences on a GPU pads its other micro-batches too (pad_mixed): a step where prompts
join decoding sequences, or a burst of prompts, has as many tokens and outputs as its arrivals make, so
each would build and plan a graph of its own (20-30 ms of Python) and run it uncaptured. Their tokens are
padded the same way to a power of two (up to n_ubatch) and their outputs to one too, by repeating the last
output row; a padded output's logits are computed and never read. Where the step's tokens are drawn in the graph
(only their ids come back: `parallel`'s, a server's), the outputs pad to at least a quarter of the padded tokens
(MIXED_OUT_SHARE): 64 clients joining a parallel run make steps of 4, 8, 16 and 32 outputs in 64-256 tokens, each
a graph built for one use (~66 ms of the H200's host), where the quarter costs a few rows of the output head.
Where the logits come back (a prompt's, bench --batched's), the outputs pad no further: the padded rows would come
back too, 64 MB a micro-batch for 128 rows of a 128k vocabulary (bench --batched's S_PP at B = 16 fell to 0.86x
llama.cpp's with them).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from ggrun.core.llm.batch import UBatch
from ggrun.core.llm.inputs import UBatchState
from ggrun.core.llm.kv_cache import KVCache

MAX_BUCKET = 256
# a decode step of fewer sequences reads a shared prefix token by token: the extra launches of reading it once cost
# more than they save there (H200, 16 sequences over a shared 1024-cell prefix: 33 us a layer against 22)
SHARED_MIN_TOKENS = 32
MIXED_OUT_SHARE = 4  # a padded mixed step whose tokens are drawn in the graph: outputs >= 1 / 4 of its tokens


def bucket_size(n: int, n_ubatch: int) -> int:
    """The padded size of a step of n rows: the next power of two, at most n_ubatch (and never below n)."""
    return max(n, min(1 << (n - 1).bit_length(), n_ubatch))


def wants_bucket(ub: UBatch) -> bool:
    """Whether a micro-batch is a decode step of several sequences: 2..MAX_BUCKET rows, each of its own
    sequence and asking logits. Prompts are left as they come (padding them would cost real work)."""
    n = ub.n_tokens
    return 1 < n <= MAX_BUCKET and ub.n_outputs == n and len(np.unique(ub.seq)) == n


def shares_prefix(ub: UBatch, kv: KVCache) -> bool:
    """Whether a micro-batch, a decode step of many sequences padded to its bucket (wants_bucket said so), has its
    attention read a prefix of cells its sequences share once for all of them (GraphParams.shared): where the cache
    may hold shared cells (KVCache.copied: `parallel`'s system prompt, prompts that begin alike), from
    SHARED_MIN_TOKENS tokens on. Which cells the tokens share the device finds each step."""
    return ub.n_tokens >= SHARED_MIN_TOKENS and kv.copied


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def pad_mixed(st: UBatchState, n_ubatch: int, drawn: bool = False, size: int | None = None,
              outs: int | None = None) -> UBatchState:
    """st with a micro-batch that is not a decode step (the caller's wants_bucket said so) padded to powers of
    two: its tokens (at most n_ubatch) and its outputs (at most its padded tokens; with `drawn`, tokens drawn in
    the graph, at least MIXED_OUT_SHARE's share of them), or to `size` tokens and `outs` outputs when given (a
    larger graph's, borrowed: GraphCache.borrow); unchanged for one token, where nothing would change, or where a
    cache has no free cell for padding rows."""
    ub = st.ub
    if ub.n_tokens < 2:
        return st
    n_out = ub.n_outputs
    if size is None or outs is None:
        size = bucket_size(ub.n_tokens, n_ubatch)
        least = size // MIXED_OUT_SHARE if drawn else 1
        outs = min(size, max(_pow2(n_out), least)) if n_out else 0
    if size == ub.n_tokens and outs == n_out:
        return st
    if size > ub.n_tokens:
        padded = _padded_rows(st, size)
        if padded is None:
            return st
        st = padded
    out_rows = np.concatenate([ub.out_rows, np.full(outs - n_out, ub.out_rows[-1] if n_out else 0, np.int32)])
    return replace(st, ub=replace(st.ub, out_rows=out_rows.astype(np.int32), n_out_pad=outs - n_out))


def _padded_rows(st: UBatchState, size: int) -> UBatchState | None:
    """st with rows up to `size` added: token 0 at position 0, each writing one spare cell of each cache (free,
    so no token sees it); None when a cache has no spare cell."""
    ub = st.ub
    n_pad = size - ub.n_tokens
    spare = [c.spare_cell() for c in (st.kv, st.kv_swa) if c is not None]
    if any(cell < 0 for cell in spare):
        return None
    zeros = np.zeros(n_pad, dtype=np.int32)
    padded = replace(ub, tokens=np.concatenate([ub.tokens, zeros]), pos=np.concatenate([ub.pos, zeros]),
                     seq=np.concatenate([ub.seq, zeros]), n_pad=n_pad)
    cells = np.concatenate([st.cells, np.full(n_pad, spare[0], dtype=np.int32)])
    cells_swa = None
    if st.kv_swa is not None:
        cells_swa = np.concatenate([st.cells_swa, np.full(n_pad, spare[1], dtype=np.int32)])
    return replace(st, ub=padded, cells=cells, cells_swa=cells_swa)


def pad_state(st: UBatchState, n_ubatch: int, size: int | None = None) -> UBatchState:
    """st with its micro-batch, a decode step (the caller's wants_bucket said so), padded to its bucket, or to
    `size` rows when given (a larger graph's, borrowed: GraphCache.borrow); unchanged when already that size, or
    a cache has no free cell left for the padding rows."""
    ub = st.ub
    size = bucket_size(ub.n_tokens, n_ubatch) if size is None else size
    if size == ub.n_tokens:
        return st
    padded = _padded_rows(st, size)
    if padded is None:
        return st
    n_pad = size - ub.n_tokens
    return replace(padded, ub=replace(padded.ub, out_rows=np.arange(size, dtype=np.int32), n_out_pad=n_pad))

