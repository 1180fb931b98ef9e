"""Perplexity as llama-perplexity computes it (tools/perplexity/perplexity.cpp).

The text's tokens are cut into chunks of n_ctx tokens (the tail that does not fill a chunk is left
out). Each chunk is evaluated from an empty cache, with BOS in place of its first token when the model
adds one, and only its second half is scored: the logits at positions n_ctx/2 .. n_ctx-2 predict the
tokens that follow them, so every scored token has at least n_ctx/2 tokens of context. A chunk that
does not fit one decode call (-b smaller than -c) is decoded in batches of n_batch tokens, as llama.cpp
does. The estimate and its uncertainty are llama.cpp's arithmetic (`Estimate`).

`score_window` scores every position of one window instead; tests compare it position by position with
llama.cpp's logits. Nothing here prints: the CLI renders the chunks as they come.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from ggrun.core.errors import BadInput
from ggrun.core.llm.batch import Batch
from ggrun.core.llm.session import Session


@dataclass(frozen=True)
class ChunkPlan:
    """Which tokens a perplexity run evaluates: n_chunks chunks of n_ctx tokens, scored from `first`."""

    n_ctx: int
    n_chunks: int

    @property
    def first(self) -> int:
        """The first position whose logits are scored (llama.cpp: n_ctx / 2)."""
        return self.n_ctx // 2

    @property
    def n_scored(self) -> int:
        """Tokens scored per chunk: positions first .. n_ctx-2 predict the tokens after them."""
        return self.n_ctx - self.first - 1


def plan_chunks(n_tokens: int, n_ctx: int, max_chunks: int = -1) -> ChunkPlan:
    """llama-perplexity's chunking: n_tokens // n_ctx chunks, at most max_chunks (-1: all); a text of
    fewer than 2 * n_ctx tokens is refused, as llama.cpp refuses it."""
    if n_ctx < 4:
        raise BadInput(f"-c {n_ctx}: a perplexity chunk needs at least 4 tokens (half of it is context)")
    if max_chunks == 0 or max_chunks < -1:
        raise BadInput(f"--chunks {max_chunks}: give a positive number of chunks, or -1 for all")
    if n_tokens < 2 * n_ctx:
        raise BadInput(f"the text tokenizes to only {n_tokens} tokens; perplexity with a context of {n_ctx} "
                       f"needs at least {2 * n_ctx} (lower -c or give a longer text)")
    n = n_tokens // n_ctx
    return ChunkPlan(n_ctx, n if max_chunks < 0 else min(n, max_chunks))


@dataclass
class Chunk:
    """One evaluated chunk: the logits of its scored positions and the tokens they predict."""

    index: int
    tokens: np.ndarray  # the chunk's n_ctx tokens as in the text (no BOS substitution)
    logits: np.ndarray  # f32 [n_scored, n_vocab]
    targets: np.ndarray  # i32 [n_scored]: the token that follows each scored position


def evaluate_chunks(session: Session, tokens: list[int] | np.ndarray, plan: ChunkPlan, n_batch: int,
                    bos_id: int | None) -> Iterator[Chunk]:
    """Evaluate plan's chunks one after the other, yielding each as soon as its logits exist. An interrupt
    (Ctrl-C) raises core.errors.Interrupted from the session between micro-batches."""
    toks = np.asarray(tokens, dtype=np.int32)
    n_ctx, first = plan.n_ctx, plan.first
    n_batch = max(1, min(n_batch, n_ctx))
    for i in range(plan.n_chunks):
        chunk = toks[i * n_ctx:(i + 1) * n_ctx]
        fed = chunk.copy()
        if bos_id is not None:
            fed[0] = bos_id
        session.clear()
        rows = []
        for start in range(0, n_ctx, n_batch):
            b = Batch()
            for pos in range(start, min(start + n_batch, n_ctx)):
                b.add(int(fed[pos]), pos, 0, pos >= first)
            out = session.decode(b)
            if len(out):
                rows.append(out)
        logits = np.concatenate(rows) if len(rows) > 1 else rows[0]
        yield Chunk(i, chunk, logits[:plan.n_scored], chunk[first + 1:].astype(np.int32))


def token_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Negative log-likelihood of each target under its row of logits, as llama.cpp's log_softmax: the
    exponentials in f32, their sum in f64."""
    logits = np.asarray(logits, dtype=np.float32)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    log_sum = np.log(np.exp(shifted).sum(axis=-1, dtype=np.float64))
    picked = shifted[np.arange(len(targets)), targets].astype(np.float64)
    return log_sum - picked


@dataclass
class Estimate:
    """llama-perplexity's running sums: PPL = exp(mean nll), and its uncertainty from the spread of
    the nll values, sqrt(var / (count - 1)) * PPL."""

    nll_sum: float = 0.0
    nll2_sum: float = 0.0
    count: int = 0
    running: list[float] = field(default_factory=list)  # PPL after each chunk: llama's [1]x,[2]y,...

    def add(self, nll: np.ndarray) -> None:
        nll = np.asarray(nll, dtype=np.float64)
        self.nll_sum += float(nll.sum())
        self.nll2_sum += float((nll * nll).sum())
        self.count += len(nll)
        self.running.append(self.perplexity)

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll_sum / self.count) if self.count else math.nan

    @property
    def uncertainty(self) -> float:
        """NaN where llama.cpp reports 'Unexpected negative standard deviation of log(prob)'."""
        if self.count < 2:
            return math.nan
        mean = self.nll_sum / self.count
        var = self.nll2_sum / self.count - mean * mean
        return math.sqrt(var / (self.count - 1)) * self.perplexity if var > 0 else math.nan


@dataclass
class Score:
    """Every position of one window scored: the nll of each next token and the model's top-1 there."""

    perplexity: float
    n_tokens: int
    nll: np.ndarray
    argmax: np.ndarray


def score_window(session: Session, tokens: list[int]) -> Score:
    """Score every next token of `tokens` evaluated as one sequence from an empty cache."""
    session.clear()
    b = Batch()
    for i, t in enumerate(tokens):
        b.add(t, i, 0, True)
    logits = session.decode(b)[:-1]
    nll = token_nll(logits, np.asarray(tokens[1:]))
    return Score(float(np.exp(nll.mean())), len(nll), nll, logits.argmax(axis=-1))
