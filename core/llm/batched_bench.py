"""llama-batched-bench's measurement on a session: for B sequences, a prompt of PP tokens each (or one
prompt shared by all with `shared`, llama.cpp's -pps), then TG decode steps of B tokens, one per
sequence; the prompt and the generation are timed apart.

As in llama-batched-bench every token is id 0, the prompt's batch asks logits for its last token only
and every decode step asks them for all B. Where the logits are computed off the host (a GPU), a decode
step ends in their argmax and only the B token ids come back, as generation's steps do (Session.decode_greedy;
llama-batched-bench copies every row's logits to the host instead, 64 MB a step at B = 128 with a 128k
vocabulary, which no sampler of ggrun's reads there); on the CPU they are in host memory already and decode
returns them. The cache is cleared at the start of each prompt's timing
and, when shared, the prompt's cells are then shared with sequences 1..B-1 (seq_cp). Timing goes
through an injectable clock so tests can check the arithmetic.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ggrun.core.llm.batch import Batch
from ggrun.core.llm.bench import no_collections
from ggrun.core.llm.session import Session

Clock = Callable[[], float]
WARMUP_TOKENS = 16  # llama-batched-bench's warm-up: 16 tokens of sequence 0


@dataclass(frozen=True)
class BatchedTest:
    """One row of the table: prompt tokens per sequence, generated tokens per sequence, sequences."""

    pp: int
    tg: int
    pl: int
    shared: bool = False

    @property
    def n_kv(self) -> int:
        """Cells the test fills (llama-batched-bench's N_KV and the context it requires)."""
        return self.pp + self.pl * self.tg if self.shared else self.pl * (self.pp + self.tg)


@dataclass(frozen=True)
class BatchedResult:
    """A measured row: prompt and generation seconds, and llama-batched-bench's speeds over them."""

    test: BatchedTest
    t_pp: float
    t_tg: float

    @property
    def t(self) -> float:
        return self.t_pp + self.t_tg

    @property
    def speed_pp(self) -> float:
        """Prompt tokens per second: one prompt's when shared, all B prompts' otherwise."""
        n = self.test.pp if self.test.shared else self.test.pl * self.test.pp
        return n / self.t_pp if self.t_pp else 0.0

    @property
    def speed_tg(self) -> float:
        return self.test.pl * self.test.tg / self.t_tg if self.t_tg else 0.0

    @property
    def speed(self) -> float:
        return self.test.n_kv / self.t if self.t else 0.0


def tests_of(npp: tuple[int, ...], ntg: tuple[int, ...], npl: tuple[int, ...], shared: bool) -> list[BatchedTest]:
    """llama-batched-bench's nesting: prompt lengths outermost, then generation lengths, then sequences."""
    return [BatchedTest(pp, tg, pl, shared) for pp in npp for tg in ntg for pl in npl]


def _decode_in_batches(session: Session, batch: Batch, n_batch: int, ids_only: bool = False) -> None:
    """llama-batched-bench's decode_helper: the batch in slices of n_batch tokens, one decode each; with
    ids_only, each slice's next tokens come back rather than its logits (Session.decode_greedy)."""
    decode = session.decode_greedy if ids_only else session.decode
    for i in range(0, len(batch), n_batch):
        decode(Batch(batch.tokens[i:i + n_batch], batch.pos[i:i + n_batch], batch.seq[i:i + n_batch],
                     batch.logits[i:i + n_batch]))


def warm_up(session: Session, n_batch: int) -> None:
    """Untimed: 16 tokens of sequence 0, fewer in a smaller context, then one decode step of one token after
    them where the context has room (readies what a first run would). llama.cpp's kernels are the same
    for a prompt and a decode step, so its 16 tokens ready both; ggrun's decode steps have kernels of their
    own (integer products on repacked weights, per-token attention), loaded on their first call: without
    the step, the first row's generation paid for loading them (tens of ms, a few % of B = 1's T_TG)."""
    session.clear()
    n = min(WARMUP_TOKENS, session.n_ctx)
    _decode_in_batches(session, Batch.of_sequence([0] * n, 0, 0, last_logits=False), n_batch)
    if n < session.n_ctx:
        session.decode(Batch.of_sequence([0], n, 0))


def warm_up_test(session: Session, test: BatchedTest, n_batch: int) -> None:
    """Untimed, before a row is measured: its prompts and one decode step, twice, then the cache cleared, as
    llama-bench warms up each test (its prompt, and one token of generation). ggrun builds, plans and
    (on a GPU) captures a graph for each new shape, ~100 ms of host work for a 1B model, where llama.cpp's
    graph costs it about a millisecond: a row measured cold would time that once-per-shape work beside B
    prompts or decode steps. A graph runs eagerly the first time and is captured the second (cuda/graphs.py),
    so once was not enough: B = 1's timed prompt of 128 tokens paid its capture (H200, llama-1b: S_PP 1.00x
    llama.cpp's). The step decodes with the prompt's cells in place, so the timed steps find their graph
    (until the cache outgrows the next power of two of cells)."""
    for _ in range(2):
        _prompts(session, test, n_batch)
        if test.tg:
            _decode_in_batches(session, decode_batch(test, 0), n_batch, session.logits_on_device)
    session.clear()


def _prompts(session: Session, test: BatchedTest, n_batch: int) -> None:
    """A row's prompt phase: clear the cache, decode every prompt (sequence 0's only when shared, its cells
    then shared with sequences 1..B-1)."""
    session.clear()
    if test.pp:
        _decode_in_batches(session, prompt_batch(test), n_batch)
    if test.shared:
        for s in range(1, test.pl):
            session.seq_cp(0, s)


def prompt_batch(test: BatchedTest) -> Batch:
    """Every sequence's prompt (sequence 0's only when shared) in one batch, logits for its last token."""
    n_seq = 1 if test.shared else test.pl
    pos = np.tile(np.arange(test.pp, dtype=np.int32), n_seq)
    seq = np.repeat(np.arange(n_seq, dtype=np.int32), test.pp)
    logits = np.zeros(len(pos), dtype=bool)
    logits[-1] = True
    return Batch(np.zeros(len(pos), dtype=np.int32), pos, seq, logits)


def decode_batch(test: BatchedTest, step: int) -> Batch:
    """Decode step `step`: one token of each of the B sequences at position pp + step, all with logits."""
    n = test.pl
    return Batch(np.zeros(n, dtype=np.int32), np.full(n, test.pp + step, dtype=np.int32),
                 np.arange(n, dtype=np.int32), np.ones(n, dtype=bool))


def run_batched(session: Session, test: BatchedTest, n_batch: int, clock: Clock = time.perf_counter) -> BatchedResult:
    """One row: clear, the prompts (shared to every sequence when asked), then tg steps of B tokens (on a GPU
    ending in the ids only); timed with Python's cycle collector off, as llama-bench's repetitions are
    (bench.no_collections)."""
    ids_only = session.logits_on_device
    with no_collections():
        t0 = clock()
        _prompts(session, test, n_batch)
        t1 = clock()
        for i in range(test.tg):
            _decode_in_batches(session, decode_batch(test, i), n_batch, ids_only)
        t2 = clock()
    return BatchedResult(test, t1 - t0, t2 - t1)
