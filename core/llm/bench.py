"""llama-bench's tests on a session: `pp N` (one prompt of N tokens, logits for the last),
`tg N` (N decode steps of one token), `pg` (a prompt, then generation; one figure).

Timing goes through an injectable clock so tests can check the arithmetic exactly.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ggrun.core.llm.batch import Batch
from ggrun.core.llm.generate import eval_prompt
from ggrun.core.llm.session import Session

Clock = Callable[[], float]


@dataclass(frozen=True)
class BenchTest:
    n_prompt: int
    n_gen: int

    @property
    def label(self) -> str:
        if self.n_prompt and self.n_gen:
            return f"pp{self.n_prompt}+tg{self.n_gen}"
        return f"pp{self.n_prompt}" if self.n_prompt else f"tg{self.n_gen}"

    @property
    def n_tokens(self) -> int:
        return self.n_prompt + self.n_gen


@dataclass
class BenchResult:
    test: BenchTest
    samples_ns: list[int] = field(default_factory=list)

    @property
    def samples_ts(self) -> list[float]:
        return [self.test.n_tokens * 1e9 / ns for ns in self.samples_ns]

    @property
    def avg_ts(self) -> float:
        return statistics.fmean(self.samples_ts) if self.samples_ns else 0.0

    @property
    def stddev_ts(self) -> float:
        return statistics.stdev(self.samples_ts) if len(self.samples_ns) > 1 else 0.0

    @property
    def stddev_ns(self) -> float:
        return statistics.stdev(self.samples_ns) if len(self.samples_ns) > 1 else 0.0

    @property
    def avg_ns(self) -> float:
        return statistics.fmean(self.samples_ns) if self.samples_ns else 0.0


def run_once(session: Session, test: BenchTest, rng: np.random.Generator) -> None:
    """One repetition on an empty cache: random valid tokens, prompt then generation."""
    session.clear()
    n_vocab = session.model.hp.n_vocab
    if test.n_prompt:
        eval_prompt(session, rng.integers(0, n_vocab, test.n_prompt).tolist(), session.params.n_batch)
    pos = test.n_prompt
    for _ in range(test.n_gen):
        session.decode(Batch.of_sequence([int(rng.integers(0, n_vocab))], pos))
        pos += 1


def run_bench(session: Session, test: BenchTest, repetitions: int, warmup: bool = True,
              clock: Clock = time.perf_counter, seed: int = 0,
              on_rep: Callable[[int], None] | None = None) -> BenchResult:
    """A warm-up run that is not counted, then `repetitions` timed runs."""
    rng = np.random.default_rng(seed)
    if warmup:
        run_once(session, test, rng)
    res = BenchResult(test)
    for i in range(repetitions):
        t0 = clock()
        run_once(session, test, rng)
        res.samples_ns.append(int(round((clock() - t0) * 1e9)))
        if on_rep:
            on_rep(i)
    return res
