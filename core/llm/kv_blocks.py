"""Cells for the tokens of many sequences, kept in blocks of their own (a paged layout in one cache).

Attention reads the cache in tiles of cells and skips a tile the mask hides from a token. When every
sequence's tokens are spread one per decode step over the whole cache, each token's visible cells
span all of them and hidden cells in between cost as much as visible ones. So a sequence's next token
goes right after the last cell it took, while that block of BLOCK cells has room; otherwise it takes
the first wholly free block; only when none is left does it take the lowest free cell. Each
token's cells then fill whole tiles of its own sequence, which other sequences' tokens skip.

A decode step (one token of each of B sequences) is placed with array operations, no loop over
the sequences; batches holding several tokens of a sequence (prompts) go sequence by sequence.
"""
from __future__ import annotations

import numpy as np

BLOCK = 64  # cells per block: a tile of the CPU's attention kernel (cpu/attention.py CELLS)


def find_cells(pos: np.ndarray, seqs: np.ndarray, tail: np.ndarray, seq: np.ndarray) -> np.ndarray | None:
    """Free cells for tokens of sequences `seq` (in batch order), or None when too few are free.

    pos: each cell's position (-1 free); seqs: [cells, sequences] flags; tail: the last cell each
    sequence was given (-1 none; a hint, checked against the cells before it is used)."""
    free = pos < 0
    if np.count_nonzero(free) < len(seq):
        return None
    if len(seq) == len(np.unique(seq)):
        return _one_each(free, seqs, tail, seq)
    return _by_sequence(free, seqs, tail, seq)


def _next_in_block(free: np.ndarray, seqs: np.ndarray, tail: np.ndarray, seq: np.ndarray) -> np.ndarray:
    """For each sequence the cell after its last one where that cell is free, in the same block, and
    the last one still its own; else -1."""
    last = tail[seq]
    nxt = last + 1
    ok = (last >= 0) & (nxt % BLOCK != 0) & (nxt < len(free))
    idx = np.flatnonzero(ok)
    ok[idx] = free[nxt[idx]] & seqs[last[idx], seq[idx]]
    return np.where(ok, nxt, -1).astype(np.int32)


def _free_blocks(free: np.ndarray) -> np.ndarray:
    """First cells of the blocks whose every cell is free, lowest first."""
    n = len(free) // BLOCK * BLOCK
    whole = free[:n].reshape(-1, BLOCK).all(axis=1)
    starts = np.flatnonzero(whole) * BLOCK
    if n < len(free) and free[n:].all():
        starts = np.append(starts, n)
    return starts.astype(np.int32)


def _one_each(free: np.ndarray, seqs: np.ndarray, tail: np.ndarray, seq: np.ndarray) -> np.ndarray:
    """A decode step: one token per sequence, each after its last cell or at a new block's start."""
    cells = _next_in_block(free, seqs, tail, seq)
    need = np.flatnonzero(cells < 0)
    if len(need):
        starts = _free_blocks(free)[:len(need)]
        cells[need[:len(starts)]] = starts
        rest = need[len(starts):]
        if len(rest):  # no whole block left: the lowest free cells nobody took in this step
            left = free.copy()
            left[cells[cells >= 0]] = False
            cells[rest] = np.flatnonzero(left)[:len(rest)]
    return cells


def _by_sequence(free: np.ndarray, seqs: np.ndarray, tail: np.ndarray, seq: np.ndarray) -> np.ndarray:
    """Several tokens of a sequence: each sequence's tokens (in batch order) after its last cell while its
    block has room, then in whole free blocks, then in the lowest free cells."""
    left = free.copy()
    cells = np.empty(len(seq), dtype=np.int32)
    for s in dict.fromkeys(seq.tolist()):
        rows = np.flatnonzero(seq == s)
        got = _run_after(left, seqs, int(tail[s]), s, len(rows))
        if len(got) < len(rows):
            got = np.concatenate([got, _whole_blocks(left, len(rows) - len(got))])
        if len(got) < len(rows):
            spare = np.flatnonzero(left)[:len(rows) - len(got)]
            got = np.concatenate([got, spare])
            left[spare] = False
        cells[rows] = got
    return cells


def _run_after(left: np.ndarray, seqs: np.ndarray, last: int, s: int, n: int) -> np.ndarray:
    """Up to n free cells right after sequence s's last cell, within its block (taken from `left`)."""
    if last < 0 or not seqs[last, s]:
        return np.zeros(0, dtype=np.int32)
    end = min(len(left), (last // BLOCK + 1) * BLOCK, last + 1 + n)
    span = left[last + 1:end]
    k = len(span) if span.all() else int(np.argmin(span))
    got = np.arange(last + 1, last + 1 + k, dtype=np.int32)
    left[got] = False
    return got


def _whole_blocks(left: np.ndarray, n: int) -> np.ndarray:
    """Up to n cells from the lowest wholly free blocks, in order (taken from `left`)."""
    starts = _free_blocks(left)[:-(-n // BLOCK)]
    got = (starts[:, None] + np.arange(BLOCK, dtype=np.int32)).ravel()
    got = got[got < len(left)][:n]
    left[got] = False
    return got.astype(np.int32)
