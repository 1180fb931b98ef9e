"""llama-bench's tests on a session: `pp N` (one prompt of N tokens, logits for the last),
`tg N` (N decode steps of one token), `pg` (a prompt, then generation; one figure), each optionally
at a depth (`@ dD`: D tokens already in the KV cache, untimed, as llama-bench's -d).

As llama-bench: an untimed warm-up (the prompt, and one generation step), then `repetitions` timed
runs; the depth is evaluated once and kept, each run removing only its own tokens (llama-bench restores
a saved state instead). Timing goes through an injectable clock so tests can check the arithmetic.
"""
from __future__ import annotations

import gc
import platform
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
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
    n_depth: int = 0

    @property
    def label(self) -> str:
        """llama-bench's test column: pp512, tg128, pp512+tg128, with ' @ d<depth>' at a depth."""
        if self.n_prompt and self.n_gen:
            name = f"pp{self.n_prompt}+tg{self.n_gen}"
        else:
            name = f"pp{self.n_prompt}" if self.n_prompt else f"tg{self.n_gen}"
        return f"{name} @ d{self.n_depth}" if self.n_depth else name

    @property
    def n_tokens(self) -> int:
        """Tokens a run times (the depth is not counted, as in llama-bench's t/s)."""
        return self.n_prompt + self.n_gen

    @property
    def n_ctx(self) -> int:
        """Cells a run needs: the depth, the prompt and the generated tokens."""
        return self.n_depth + self.n_tokens


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


def _random_tokens(session: Session, n: int, rng: np.random.Generator) -> list[int]:
    return rng.integers(0, session.model.hp.n_vocab, n).tolist()


def fill_depth(session: Session, n_depth: int, rng: np.random.Generator) -> None:
    """Empty the cache, then evaluate n_depth random tokens into it (sequence 0, positions 0..)."""
    session.clear()
    if n_depth:
        eval_prompt(session, _random_tokens(session, n_depth, rng), session.params.n_batch)


def run_once(session: Session, test: BenchTest, rng: np.random.Generator) -> None:
    """One repetition after the cache holds exactly test.n_depth tokens: random valid tokens, the prompt
    in batches of n_batch, then one decode step per generated token (the tokens drawn together first, the
    same ones as drawn one by one, so that a step times decoding, not the random generator)."""
    if test.n_depth:
        session.seq_rm(0, test.n_depth, -1)
    else:
        session.clear()
    if test.n_prompt:
        eval_prompt(session, _random_tokens(session, test.n_prompt, rng), session.params.n_batch,
                    start_pos=test.n_depth)
    pos = test.n_depth + test.n_prompt
    for token in _random_tokens(session, test.n_gen, rng):
        session.decode(Batch.of_sequence([token], pos))
        pos += 1


def run_bench(session: Session, test: BenchTest, repetitions: int, warmup: bool = True,
              clock: Clock = time.perf_counter, seed: int = 0,
              on_rep: Callable[[int], None] | None = None,
              on_event: Callable[[str], None] | None = None) -> BenchResult:
    """The depth (untimed, once), a warm-up (the prompt and one generation step, untimed), then
    `repetitions` timed runs. on_event gets llama-bench's --progress phrases ('prompt run 1/5', ...)."""
    say = on_event or (lambda what: None)
    rng = np.random.default_rng(seed)
    if test.n_depth:
        say(f"depth run 1/{repetitions}")
    fill_depth(session, test.n_depth, rng)
    if warmup:
        if test.n_prompt:
            say("warmup prompt run")
        if test.n_gen:
            say("warmup generation run")
        run_once(session, BenchTest(test.n_prompt, min(test.n_gen, 1), test.n_depth), rng)
    res = BenchResult(test)
    with no_collections():
        for i in range(repetitions):
            if test.n_depth and i:
                say(f"depth run {i + 1}/{repetitions} (cached)")
            if test.n_prompt:
                say(f"prompt run {i + 1}/{repetitions}")
            if test.n_gen:
                say(f"generation run {i + 1}/{repetitions}")
            t0 = clock()
            run_once(session, test, rng)
            res.samples_ns.append(int(round((clock() - t0) * 1e9)))
            if on_rep:
                on_rep(i)
    return res


@contextmanager
def no_collections():
    """Python's cycle collector off while repetitions are timed (as timeit does): a full collection walks
    every object the model and its graphs made, tens of milliseconds that would land in one repetition."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def cpu_description() -> str:
    """The CPU as llama-bench's cpu_info names it (the brand string, e.g. 'AMD EPYC')."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_line() -> str:
    """The CPU's model name, its SIMD flags (as /proc/cpuinfo lists them) and ggrun's level."""
    model, flags = cpu_description(), []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "flags":
                flags = [f for f in value.split() if f.startswith(("avx", "fma", "f16c", "amx"))]
                break
    except OSError:
        pass
    level = subprocess.run([sys.executable, "-c", "from ggrun.core.backends.cpu import isa; print(isa.LEVEL)"],
                           capture_output=True, text=True).stdout.strip() or "?"
    return f"CPU: {model}; flags: {' '.join(flags) or '-'}; ggrun's level: {level}"
