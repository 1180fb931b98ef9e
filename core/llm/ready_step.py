"""A decode step readied while the device computes the one before it.

Before a decode step's graph can run, the host finds the token's cell, decides to reuse the graph and
fills positions, cache rows and mask: some 30 us of Python on a GPU machine, while the GPU waits. None
of it depends on the token. So once a one-token step is launched, the session fills the inputs of the
likeliest next step (the same sequence, one position on, with logits) while the device runs: against
the cells as if that token were placed (KVCache.trial), which stay as they were. The next decode takes
the step when its batch is that step and nothing changed since (the cells, the compute buffers): it
records the cell, writes the token id, and the graph runs. Any other batch decodes as usual, filling
every input again. Whether the graph that ran serves the next step is graph_reuse.decide's answer.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ggrun.core.llm.batch import Batch, UBatch
from ggrun.core.llm.graph_result import GraphResult
from ggrun.core.llm.graph_reuse import decide
from ggrun.core.llm.inputs import GraphParams, UBatchState
from ggrun.core.llm.kv_cache import KVCache
from ggrun.core.sched import Scheduler


@dataclass
class ReadyStep:
    """The next decode step, readied: every input of its graph filled but the token id."""

    res: GraphResult  # the kept graph, which serves the step
    params: GraphParams
    ub: UBatch  # the step, its token id a stand-in
    cells: np.ndarray  # the cell its token gets
    tokens: np.ndarray  # the token ids' input: the one thing left to fill
    stamp: tuple[int, int]  # the cells' change count and the scheduler's activity it was filled against
    pos: int = field(init=False)  # the step's position, sequence and cell as numbers
    seq: int = field(init=False)
    cell: int = field(init=False)

    def __post_init__(self) -> None:
        self.pos, self.seq, self.cell = int(self.ub.pos[0]), int(self.ub.seq[0]), int(self.cells[0])

    def serves(self, batch: Batch, stamp: tuple[int, int]) -> bool:
        """Whether `batch` is this step (one token of the sequence, at the position, asking logits) and the
        inputs filled for it still stand."""
        return (len(batch.tokens) == 1 and batch.pos[0] == self.pos and batch.seq[0] == self.seq
                and bool(batch.logits[0]) and stamp == self.stamp)

    def take(self, batch: Batch) -> UBatch:
        """The step with batch's token, which goes into the token ids' input; that input is the step's token
        array too (filled from itself if filled again), saving an array a step."""
        self.tokens[0] = batch.tokens[0]
        return UBatch(self.tokens, self.ub.pos, self.ub.seq, self.ub.out_rows, 0)


def stamp(kv: KVCache, sched: Scheduler) -> tuple[int, int]:
    """What a readied step's inputs are filled against: the cells' changes, the compute buffers' use."""
    return kv.changes, sched.activity


def ready_next(st: UBatchState, res: GraphResult, caches: tuple[KVCache, ...], sched: Scheduler,
               reuse: bool) -> ReadyStep | None:
    """The next step of st's one token's sequence, its inputs filled, with the graph res that ran st when
    graph_reuse.decide lets it serve that step; None where the host does not wait for a device (logits made
    on the CPU, whose buffer the inputs share: they are read after this) or the step cannot be foretold: a
    window's cache, no free cell, another graph (or graph reuse off: `reuse` False)."""
    if res.logits.root.buffer.backend is sched.cpu:
        return None
    kv = caches[0]
    if len(caches) > 1 or kv.window is not None:
        return None
    cells = kv.find_slot(1, st.ub.seq)
    if cells is None:
        return None
    ub = UBatch(st.ub.tokens, st.ub.pos + 1, st.ub.seq, st.ub.out_rows, 0)
    with kv.trial(cells, ub.pos, ub.seq):
        p = GraphParams(1, 1, kv.n_kv(), greedy=res.params.greedy)
        if not decide(p, res, res, (kv.version,), sched.generation, reuse).reuse:
            return None
        res.set_inputs(UBatchState(ub, cells, kv), sched.cpu)
    return ReadyStep(res, p, ub, cells, res.input_array("inp_tokens", sched.cpu), stamp(kv, sched))
