"""Token sampling in llama.cpp's default order: repetition penalty, top-k, top-p, min-p,
temperature, then a seeded draw (or argmax when the temperature is 0)."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from ggrun.core.errors import BadInput, RuntimeFailure
from ggrun.core.llm.numerics import non_finite_kind


@dataclass(frozen=True)
class SamplingParams:
    temp: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int = -1

    def check(self) -> None:
        if self.temp < 0:
            raise BadInput(f"--temp {self.temp} must not be negative")
        if self.top_k < 0:
            raise BadInput(f"--top-k {self.top_k} must not be negative")
        if not 0.0 <= self.top_p <= 1.0:
            raise BadInput(f"--top-p {self.top_p} must lie in [0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            raise BadInput(f"--min-p {self.min_p} must lie in [0, 1]")
        if self.repeat_penalty <= 0:
            raise BadInput(f"--repeat-penalty {self.repeat_penalty} must be positive")
        if self.repeat_last_n < -1:
            raise BadInput(f"--repeat-last-n {self.repeat_last_n} must be -1 or more")


class Sampler:
    """Chooses the next token from a row of logits; remembers recent tokens for the penalty."""

    def __init__(self, params: SamplingParams, n_ctx: int = 4096) -> None:
        params.check()
        self.p = params
        seed = params.seed if params.seed >= 0 else None
        self.rng = np.random.default_rng(seed)
        last_n = n_ctx if params.repeat_last_n == -1 else params.repeat_last_n
        self.recent: deque[int] = deque(maxlen=max(last_n, 0))

    def reset(self) -> None:
        """Forget the recent tokens: a new sequence starts (the random stream goes on)."""
        self.recent.clear()

    def accept(self, token: int) -> None:
        if self.recent.maxlen:
            self.recent.append(int(token))

    def sample(self, logits: np.ndarray) -> int:
        logits = np.asarray(logits, dtype=np.float32)
        kind = non_finite_kind(logits)
        if kind:  # argmax would pick an arbitrary token and the draw would fail: never hide a fault
            raise RuntimeFailure(f"cannot sample from logits that hold {kind}")
        if self.p.repeat_penalty != 1.0 and self.recent:
            logits = self._penalize(logits)
        if self.p.temp <= 0:
            return int(np.argmax(logits))
        ids, vals = self._candidates(logits)
        probs = np.exp((vals - vals.max()) / self.p.temp)
        probs /= probs.sum()
        return int(ids[self.rng.choice(len(ids), p=probs)])

    def _penalize(self, logits: np.ndarray) -> np.ndarray:
        """llama.cpp's repetition penalty: divide positive logits of recent tokens, multiply negative ones."""
        logits = logits.copy()
        ids = np.fromiter(set(self.recent), dtype=np.int64)
        v = logits[ids]
        logits[ids] = np.where(v > 0, v / self.p.repeat_penalty, v * self.p.repeat_penalty)
        return logits

    def _candidates(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Token ids and logits left after top-k, top-p and min-p, best first."""
        k = self.p.top_k if 0 < self.p.top_k < len(logits) else len(logits)
        ids = np.argpartition(-logits, k - 1)[:k] if k < len(logits) else np.arange(len(logits))
        ids = ids[np.argsort(-logits[ids], kind="stable")]
        vals = logits[ids]
        probs = np.exp(vals - vals[0])
        probs /= probs.sum()
        keep = len(ids)
        if self.p.top_p < 1.0:
            keep = min(keep, int(np.searchsorted(np.cumsum(probs), self.p.top_p) + 1))
        if self.p.min_p > 0.0:
            keep = min(keep, max(1, int(np.count_nonzero(probs >= self.p.min_p * probs[0]))))
        return ids[:keep], vals[:keep]
