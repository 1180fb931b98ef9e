"""Perplexity of a token sequence, scored in consecutive windows of n_ctx tokens (the whole
text in one window when it fits), as llama-perplexity does it for every position. An interrupted
session (Ctrl-C) ends scoring with the estimate over the windows already scored."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ggrun.core.errors import Interrupted
from ggrun.core.llm.batch import Batch
from ggrun.core.llm.session import Session


@dataclass
class Score:
    perplexity: float
    n_tokens: int  # positions scored
    nll: np.ndarray  # negative log-likelihood of each scored next token
    argmax: np.ndarray  # the model's top-1 at each scored position
    n_windows: int = 0  # windows scored
    n_windows_total: int = 0  # windows the text needs
    interrupted: bool = False


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits - logits.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def score_tokens(session: Session, tokens: list[int], bos_id: int | None = None) -> Score:
    """Score every next token inside each window; windows after the first start with BOS
    (when the model uses one) so each begins like a fresh text."""
    n_ctx = session.n_ctx
    nll, argmax = [], []
    starts = [s for s in range(0, len(tokens) - 1, n_ctx) if len(tokens) - s >= 2]
    interrupted = False
    for start in starts:
        window = list(tokens[start:start + n_ctx])
        if start and bos_id is not None:
            window[0] = bos_id
        session.clear()
        try:
            logits = session.decode(_all_logits(window))
        except Interrupted:
            interrupted = True
            break
        lp = log_softmax(logits[:-1])
        nxt = np.asarray(window[1:])
        nll.append(-lp[np.arange(len(nxt)), nxt])
        argmax.append(logits[:-1].argmax(axis=-1))
    nll_all = np.concatenate(nll) if nll else np.zeros(0)
    ppl = float(np.exp(nll_all.mean())) if len(nll_all) else float("nan")
    return Score(ppl, len(nll_all), nll_all, np.concatenate(argmax) if argmax else np.zeros(0, dtype=int),
                 len(nll), len(starts), interrupted)


def _all_logits(tokens: list[int]) -> Batch:
    """One sequence at positions 0.. with logits for every token."""
    b = Batch()
    for i, t in enumerate(tokens):
        b.add(t, i, 0, True)
    return b
