"""A decode step readied while the device computes the one before it.

Before a decode step's graph can run, the host finds the token's cell, decides to reuse the graph and
fills positions, cache rows and mask: some 30 us of Python on a GPU machine, while the GPU waits. None
of it depends on the token. So once a one-token step is launched, the session fills the inputs of the
likeliest next step (the same sequence, one position on, with logits) while the device runs: against
the cells as if that token were placed (KVCache.trial), which stay as they were. The next decode takes
the step when its batch is that step and nothing changed since (the cells, the compute buffers): it
records the cell, writes the token id, and the graph runs. Any other batch decodes as usual, filling
every input again.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ggrun.core.llm.batch import Batch, UBatch
from ggrun.core.llm.graph_result import GraphResult
from ggrun.core.llm.inputs import GraphParams


@dataclass
class ReadyStep:
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
