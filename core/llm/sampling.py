"""Token sampling in llama.cpp's default order: logit bias, penalties (repetition, frequency,
presence), top-k, top-p, min-p, temperature, then a seeded draw (or argmax when the temperature is 0).

`--ignore-eos` is a logit bias of minus infinity on every end-of-generation token, as in llama.cpp,
so such a token is never drawn. The sampler never hides a fault: non-finite logits raise.
"""
from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass

import numpy as np

from ggrun.core.backends.kernels import top_k_ids
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit); -inf bans it

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

    @property
    def penalties_on(self) -> bool:
        """llama.cpp skips the penalties sampler when every penalty is neutral."""
        return self.repeat_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


def random_seed() -> int:
    """A seed for `-s -1`: 32 random bits, printed so that a run can be repeated."""
    return int(np.random.default_rng().integers(0, 2**32))


class Sampler:
    """Chooses the next token from a row of logits; remembers the last tokens for the penalties."""

    def __init__(self, params: SamplingParams, n_ctx: int = 4096) -> None:
        params.check()
        self.p = params
        self.seed = params.seed if params.seed >= 0 else random_seed()
        self.rng = np.random.default_rng(self.seed)
        last_n = n_ctx if params.repeat_last_n == -1 else params.repeat_last_n
        self.recent: deque[int] = deque(maxlen=max(last_n, 0))
        if params.logit_bias:
            ids, bias = zip(*params.logit_bias)
            self._bias_ids = np.asarray(ids, dtype=np.int64)
            self._bias = np.asarray(bias, dtype=np.float32)

    @property
    def greedy_only(self) -> bool:
        """Whether every choice is the argmax of the model's own logits: temperature 0, no logit bias, no
        penalties. Then the argmax may run where the logits are computed (Session.decode_greedy)."""
        return self.p.temp <= 0 and not self.p.logit_bias and not self.p.penalties_on

    def reset(self) -> None:
        """Forget the recent tokens: a new sequence or a new turn starts (the random stream goes on)."""
        self.recent.clear()

    def accept(self, token: int) -> None:
        if self.recent.maxlen:
            self.recent.append(int(token))

    def sample(self, logits: np.ndarray) -> int:
        logits = np.array(logits, dtype=np.float32)  # a copy: the steps below change it in place
        kind = non_finite_kind(logits)
        if kind:  # argmax would pick an arbitrary token and the draw would fail: never hide a fault
            raise RuntimeFailure(f"cannot sample from logits that hold {kind}")
        if self.p.logit_bias:
            np.add.at(logits, self._bias_ids, self._bias)
        if self.p.penalties_on and self.recent:
            self._penalize(logits)
        if self.p.temp <= 0:
            return int(np.argmax(logits))
        ids, vals = self._candidates(logits)
        probs = np.exp((vals - vals.max()) / self.p.temp)
        probs /= probs.sum()
        return int(ids[self.rng.choice(len(ids), p=probs)])

    def _penalize(self, logits: np.ndarray) -> None:
        """llama.cpp's penalties over the recent tokens: a repeated token's logit is divided by the
        repetition penalty when positive (multiplied when not), then lowered by its count times the
        frequency penalty and, once, by the presence penalty."""
        counts = Counter(self.recent)
        ids = np.fromiter(counts.keys(), dtype=np.int64, count=len(counts))
        n = np.fromiter(counts.values(), dtype=np.float32, count=len(counts))
        v = logits[ids]
        v = np.where(v <= 0, v * self.p.repeat_penalty, v / self.p.repeat_penalty)
        logits[ids] = v - n * self.p.frequency_penalty - self.p.presence_penalty

    def _candidates(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Token ids and logits left after top-k, top-p and min-p, best first."""
        k = self.p.top_k if 0 < self.p.top_k < len(logits) else len(logits)
        ids = top_k_ids(np, logits, k)
        vals = logits[ids]
        probs = np.exp(vals - vals[0])
        probs /= probs.sum()
        keep = len(ids)
        if self.p.top_p < 1.0:
            keep = min(keep, int(np.searchsorted(np.cumsum(probs), self.p.top_p) + 1))
        if self.p.min_p > 0.0:
            keep = min(keep, max(1, int(np.count_nonzero(probs >= self.p.min_p * probs[0]))))
        return ids[:keep], vals[:keep]
