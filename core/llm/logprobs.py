"""Log-probabilities of drawn tokens and of the most likely alternatives, for a server's `logprobs` and
`n_probs`.

They are the model's own distribution (a log-softmax of the raw logits, as llama-server reports them by
default), taken from the logits rows the decode brought back for the rows that asked. `row_logprobs` is the
one place that computes them: when ops.sample returns the chosen token's log-prob and its top-n itself,
the engine loop switches this function's caller to that and no row needs its logits on the host.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class TokenLogprob:
    """A drawn token's log-probability and the n most likely tokens with theirs, best first."""

    logprob: float
    top: list[tuple[int, float]]


def row_logprobs(logits: np.ndarray, token: int, n_top: int) -> TokenLogprob:
    """log p(token) under softmax(logits), and the n_top most likely tokens (ties: lower id first)."""
    x = logits.astype(np.float64)
    m = float(x.max())
    lse = m + float(np.log(np.exp(x - m).sum()))
    top: list[tuple[int, float]] = []
    if n_top > 0:
        k = min(n_top, len(x))
        ids = np.argpartition(-x, k - 1)[:k]
        ids = ids[np.lexsort((ids, -x[ids]))]
        top = [(int(i), float(x[i] - lse)) for i in ids]
    return TokenLogprob(float(x[token] - lse), top)
