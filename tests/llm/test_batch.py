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


@pytest.mark.parametrize("tokens, start, seq, last", [
    ([42], 7, 0, True), ([42], 7, 1, False), (np.array([5], np.int32), np.int64(3), np.int32(1), 1),
    ([1, 2, 3], 4, 1, True), ([1, 2], 0, 0, False), ([], 0, 0, True)])
def test_of_sequence_is_what_add_builds(tokens, start, seq, last):
    """One token's lists made at once hold the values and types `add` gives them, as longer batches do."""
    want = Batch()
    for i, t in enumerate(tokens):
        want.add(t, start + i, seq, bool(last) and i == len(tokens) - 1)
    got = Batch.of_sequence(tokens, start, seq, last)
    assert got == want
    for field in ("tokens", "pos", "seq", "logits"):
        assert [type(x) for x in getattr(got, field)] == [type(x) for x in getattr(want, field)]


@pytest.mark.parametrize("last", [True, False])
def test_one_token_asks_for_its_logits_or_not(last):
    (ub,) = split_batch(Batch.of_sequence([9], 30, last_logits=last), 4)
    assert ub.out_rows.tolist() == ([0] if last else []) and ub.out_rows.dtype == np.int32
    assert ub.n_outputs == int(last)
