"""Decode steps of many sequences padded to a few batch sizes, so that a handful of graphs serve them all.

A step that decodes one token of each of B sequences (every row asking logits) gets a graph whose
shapes hold B. Were B itself the shape, every sequence that joins or leaves would build and plan a new
graph. So B is rounded up to a power of two (a bucket: 1, 2, 4, ... up to MAX_BUCKET, or n_ubatch when
smaller), and the rows past B are padding: token 0 at position 0, each writing its key and value into
one free cell of each cache that no token sees (the mask hides free cells), attending to cell 0 only
(finite, whatever it holds, so no NaN), its logits computed and never read. The graph of a bucket is
then reused while B moves within it.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from ggrun.core.llm.batch import UBatch
from ggrun.core.llm.inputs import UBatchState

MAX_BUCKET = 256


def bucket_size(n: int, n_ubatch: int) -> int:
    """The padded size of a step of n rows: the next power of two, at most n_ubatch (and never below n)."""
    return max(n, min(1 << (n - 1).bit_length(), n_ubatch))


def wants_bucket(ub: UBatch) -> bool:
    """Whether a micro-batch is a decode step of several sequences: 2..MAX_BUCKET rows, each of its own
    sequence and asking logits. Prompts are left as they come (padding them would cost real work)."""
    n = ub.n_tokens
    return 1 < n <= MAX_BUCKET and ub.n_outputs == n and len(np.unique(ub.seq)) == n


def pad_state(st: UBatchState, n_ubatch: int) -> UBatchState:
    """st with its micro-batch padded to its bucket (unchanged when it is not a decode step, already a
    bucket's size, or a cache has no free cell left for the padding rows to write into)."""
    ub = st.ub
    if not wants_bucket(ub):
        return st
    size = bucket_size(ub.n_tokens, n_ubatch)
    n_pad = size - ub.n_tokens
    if n_pad == 0:
        return st
    spare = [c.spare_cell() for c in (st.kv, st.kv_swa) if c is not None]
    if any(cell < 0 for cell in spare):
        return st
    zeros = np.zeros(n_pad, dtype=np.int32)
    padded = UBatch(np.concatenate([ub.tokens, zeros]), np.concatenate([ub.pos, zeros]),
                    np.concatenate([ub.seq, zeros]), np.arange(size, dtype=np.int32), ub.first, n_pad)
    cells = np.concatenate([st.cells, np.full(n_pad, spare[0], dtype=np.int32)])
    cells_swa = None
    if st.kv_swa is not None:
        cells_swa = np.concatenate([st.cells_swa, np.full(n_pad, spare[1], dtype=np.int32)])
    return replace(st, ub=padded, cells=cells, cells_swa=cells_swa)

