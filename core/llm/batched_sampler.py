"""Sampling for many sequences at once: each sequence's settings, seeded random stream and penalty window
kept as rows of arrays, handed to the graph's ops.sample (Session.decode_sampled), which draws every
row's token where the logits are computed; only token ids come back.

Each slot draws as a core.llm.sampling.Sampler with the same settings and seed would (that sampler is
the reference): one uniform double from its own generator per draw at a positive temperature, none at
temperature 0; its penalties count the last repeat_last_n tokens it accepted (a ring of them).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ggrun.core.backends.kernels import _sample_row
from ggrun.core.llm.sampling import SamplingParams, random_seed


@dataclass
class SamplingRows:
    """ops.sample's inputs for some rows of logits (see ops.sample for their meaning)."""

    params: np.ndarray  # f32 [rows, 7]
    draws: np.ndarray  # i32 [rows, 2]: each row's uniform draw, the bits of a float64
    recent: np.ndarray  # i32 [rows, W]
    bias_ids: np.ndarray  # i32 [rows, NB]
    bias_vals: np.ndarray  # f32 [rows, NB]

    def __len__(self) -> int:
        return len(self.params)

    @property
    def shape_key(self) -> tuple[int, int]:
        """What fixes the sampling inputs' shapes beside the rows: (W, NB)."""
        return self.recent.shape[1], self.bias_ids.shape[1]

    def slice(self, a: int, b: int) -> "SamplingRows":
        return SamplingRows(self.params[a:b], self.draws[a:b], self.recent[a:b], self.bias_ids[a:b],
                            self.bias_vals[a:b])


def sample_on_host(logits: np.ndarray, rows: SamplingRows, i: int) -> int:
    """Row i's token drawn on the host from its logits by the reference kernel (a row ops.sample marks
    SAMPLE_ON_HOST)."""
    u = float(rows.draws[i:i + 1].view(np.float64)[0, 0])
    return _sample_row(np, logits, rows.params[i], u, rows.recent[i], rows.bias_ids[i], rows.bias_vals[i])


def param_row(p: SamplingParams) -> np.ndarray:
    """A slot's ops.sample parameters in f32. top-p is rounded up to an f32, so that the kernel's f32
    comparison of a cumulative probability with it says what the reference's comparison with the double
    says (numpy compares an f32 array with a Python float in float64)."""
    top_p = np.float32(p.top_p)
    if float(top_p) < p.top_p:
        top_p = np.nextafter(top_p, np.float32(np.inf))
    return np.array([p.temp, p.top_k, top_p, p.min_p, p.repeat_penalty, p.frequency_penalty, p.presence_penalty],
                    dtype=np.float32)


class BatchedSampler:
    """The sampling state of n slots (one sequence at a time each), as rows of arrays."""

    def __init__(self, params: Sequence[SamplingParams], n_ctx: int = 4096) -> None:
        for p in params:
            p.check()
        self.settings = list(params)
        self.n_ctx = n_ctx
        self.seeds = [p.seed if p.seed >= 0 else random_seed() for p in params]
        self.rngs = [np.random.default_rng(s) for s in self.seeds]
        self.params = np.stack([param_row(p) for p in params])
        self.window = np.array([n_ctx if p.repeat_last_n == -1 else max(p.repeat_last_n, 0) for p in params],
                               dtype=np.int64)
        penalized = [w for p, w in zip(params, self.window) if p.penalties_on]
        self.recent = np.full((len(params), max(penalized, default=1) or 1), -1, dtype=np.int32)
        self.head = np.zeros(len(params), dtype=np.int64)
        n_bias = max((len(p.logit_bias) for p in params), default=0) or 1
        self.bias_ids = np.full((len(params), n_bias), -1, dtype=np.int32)
        self.bias_vals = np.zeros((len(params), n_bias), dtype=np.float32)
        for i, p in enumerate(params):
            for j, (tid, bias) in enumerate(p.logit_bias):
                self.bias_ids[i, j], self.bias_vals[i, j] = tid, bias
        self.positive = self.params[:, 0] > 0  # slots that draw (a positive temperature)
        self.unread_draws: list[list[float]] = [[] for _ in params]  # draws given back (unread), drawn again first
        self.keeps = np.array([p.penalties_on and w > 0 for p, w in zip(params, self.window)], dtype=bool)

    def __len__(self) -> int:
        return len(self.settings)

    def configure(self, slot: int, p: SamplingParams) -> None:
        """Give the slot new settings and a fresh stream (a server's next request in that slot). The penalty
        ring and the bias columns grow to fit them and never shrink, so the sampling inputs keep their shapes
        (and the decode graphs their reuse) from request to request."""
        p.check()
        self.settings[slot] = p
        self.seeds[slot] = p.seed if p.seed >= 0 else random_seed()
        self.rngs[slot] = np.random.default_rng(self.seeds[slot])
        self.unread_draws[slot] = []
        self.params[slot] = param_row(p)
        self.window[slot] = self.n_ctx if p.repeat_last_n == -1 else max(p.repeat_last_n, 0)
        if p.penalties_on and self.window[slot] > self.recent.shape[1]:
            grow = int(self.window[slot]) - self.recent.shape[1]
            self.recent = np.pad(self.recent, ((0, 0), (0, grow)), constant_values=-1)
        if len(p.logit_bias) > self.bias_ids.shape[1]:
            grow = len(p.logit_bias) - self.bias_ids.shape[1]
            self.bias_ids = np.pad(self.bias_ids, ((0, 0), (0, grow)), constant_values=-1)
            self.bias_vals = np.pad(self.bias_vals, ((0, 0), (0, grow)))
        self.bias_ids[slot], self.bias_vals[slot] = -1, 0.0
        for j, (tid, bias) in enumerate(p.logit_bias):
            self.bias_ids[slot, j], self.bias_vals[slot, j] = tid, bias
        self.positive[slot] = p.temp > 0
        self.keeps[slot] = p.penalties_on and self.window[slot] > 0
        self.reset(slot)

    def reset(self, slot: int) -> None:
        """A new sequence in the slot: its penalty window empties (its random stream goes on)."""
        self.recent[slot] = -1
        self.head[slot] = 0

    def accept(self, slot: int, tokens: Sequence[int]) -> None:
        """Tokens of the slot's sequence (a prompt): the last of them enter its penalty window."""
        if not self.keeps[slot]:
            return
        w = int(self.window[slot])
        for t in list(tokens)[-w:]:
            self.recent[slot, self.head[slot]] = t
            self.head[slot] = (self.head[slot] + 1) % w

    def accept_rows(self, slots: np.ndarray, tokens: np.ndarray) -> None:
        """One token for each of `slots` (a decode step's draws), without a loop over them."""
        keep = self.keeps[slots]
        slots, tokens = slots[keep], tokens[keep]
        if len(slots):
            self.recent[slots, self.head[slots]] = tokens
            self.head[slots] = (self.head[slots] + 1) % self.window[slots]

    def unread(self, slot: int, rows: SamplingRows, i: int) -> None:
        """Give back the draw row i of `rows` (the slot's) made, whose token was never taken (parallel launches a
        step before it knows which sequences ended the step before): the slot draws it again next, so that its
        stream goes on as if the draw had not been made."""
        if self.positive[slot]:
            self.unread_draws[slot].append(float(rows.draws[i:i + 1].view(np.float64)[0, 0]))

    def rows(self, slots: np.ndarray) -> SamplingRows:
        """The sampling inputs of `slots` for one draw each: a uniform double from each drawing slot's stream."""
        u = np.zeros(len(slots), dtype=np.float64)
        for i in np.flatnonzero(self.positive[slots]).tolist():
            slot = int(slots[i])
            u[i] = self.unread_draws[slot].pop(0) if self.unread_draws[slot] else self.rngs[slot].random()
        return SamplingRows(self.params[slots], u.view(np.int32).reshape(-1, 2), self.recent[slots],
                            self.bias_ids[slots], self.bias_vals[slots])
