"""Batches of tokens and their split into micro-batches of at most n_ubatch tokens."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Batch:
    """Tokens to evaluate: each with a position, a sequence id, and whether it needs logits. The four
    may be lists or numpy arrays (a step of many sequences is made as arrays, without a loop)."""

    tokens: list[int] = field(default_factory=list)
    pos: list[int] = field(default_factory=list)
    seq: list[int] = field(default_factory=list)
    logits: list[bool] = field(default_factory=list)

    def add(self, token: int, pos: int, seq: int = 0, logits: bool = False) -> None:
        self.tokens.append(int(token))
        self.pos.append(int(pos))
        self.seq.append(int(seq))
        self.logits.append(bool(logits))

    def __len__(self) -> int:
        return len(self.tokens)

    @staticmethod
    def of_sequence(tokens: list[int], start_pos: int = 0, seq: int = 0, last_logits: bool = True) -> "Batch":
        """One sequence's tokens at consecutive positions; logits for the last only (or none). A single
        token (a decode step's batch, made on every step) gets its lists at once, as `add` would fill them."""
        if len(tokens) == 1:
            return Batch([int(tokens[0])], [int(start_pos)], [int(seq)], [bool(last_logits)])
        b = Batch()
        for i, t in enumerate(tokens):
            b.add(t, start_pos + i, seq, last_logits and i == len(tokens) - 1)
        return b


@dataclass
class UBatch:
    """A micro-batch as arrays, ready to fill graph inputs."""

    tokens: np.ndarray  # i32 [n]
    pos: np.ndarray  # i32 [n]
    seq: np.ndarray  # i32 [n]
    out_rows: np.ndarray  # i32 [n_outputs]: rows of this micro-batch that need logits
    first: int  # index of its first token in the batch
    n_pad: int = 0  # rows at the end that only pad it to its bucket's size (buckets.py)
    n_out_pad: int = 0  # entries at the end of out_rows that only pad the outputs to their bucket (buckets.py)

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def n_real(self) -> int:
        """Rows that are the batch's tokens (all but the padding)."""
        return len(self.tokens) - self.n_pad

    @property
    def n_outputs(self) -> int:
        return len(self.out_rows)

    @property
    def n_real_outputs(self) -> int:
        """Outputs that are the batch's (all but the padding)."""
        return len(self.out_rows) - self.n_out_pad


def split_batch(batch: Batch, n_ubatch: int) -> list[UBatch]:
    """Consecutive slices of at most n_ubatch tokens; a batch that fits is one micro-batch, unsliced."""
    toks = np.asarray(batch.tokens, dtype=np.int32)
    pos = np.asarray(batch.pos, dtype=np.int32)
    seq = np.asarray(batch.seq, dtype=np.int32)
    if 0 < len(batch) <= n_ubatch:
        return [UBatch(toks, pos, seq, _rows_needing_logits(batch.logits), 0)]
    need = np.asarray(batch.logits, dtype=bool)
    out = []
    for i in range(0, len(batch), n_ubatch):
        sl = slice(i, i + n_ubatch)
        out.append(UBatch(toks[sl], pos[sl], seq[sl], _rows_needing_logits(need[sl]), i))
    return out


def _rows_needing_logits(need) -> np.ndarray:
    """The rows whose flag in `need` (a list or array of them) is set, as i32; one token (a decode step)
    without converting its flag to an array first."""
    if len(need) == 1:
        return np.zeros(1 if need[0] else 0, dtype=np.int32)
    return np.asarray(need, dtype=bool).nonzero()[0].astype(np.int32)
