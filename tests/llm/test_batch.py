"""Micro-batches (core.llm.batch): a batch that fits one micro-batch is split as the slicing of a longer
one would split it."""
from __future__ import annotations

import numpy as np
import pytest

from ggrun.core.llm.batch import Batch, split_batch


def sliced(batch: Batch, n_ubatch: int) -> list[tuple]:
    """The micro-batches as consecutive slices, each as plain lists."""
    out = []
    for i in range(0, len(batch), n_ubatch):
        need = batch.logits[i:i + n_ubatch]
        out.append((batch.tokens[i:i + n_ubatch], batch.pos[i:i + n_ubatch], batch.seq[i:i + n_ubatch],
                    [r for r, n in enumerate(need) if n], i))
    return out


@pytest.mark.parametrize("n_tokens, n_ubatch", [(0, 4), (1, 4), (4, 4), (5, 4), (9, 4), (1, 1), (3, 1)])
def test_split_batch_gives_consecutive_slices(n_tokens, n_ubatch):
    b = Batch()
    for i in range(n_tokens):
        b.add(100 + i, 7 + i, i % 2, i % 3 == 0)
    got = split_batch(b, n_ubatch)
    assert [(ub.tokens.tolist(), ub.pos.tolist(), ub.seq.tolist(), ub.out_rows.tolist(), ub.first)
            for ub in got] == sliced(b, n_ubatch)
    for ub in got:
        assert all(a.dtype == np.int32 for a in (ub.tokens, ub.pos, ub.seq, ub.out_rows))
