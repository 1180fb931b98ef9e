"""A decode step readied while the device computes the one before it.

Before a decode step's graph can run, the host finds the tokens' cells, decides to reuse the graph and
fills positions, cache rows and masks: some 30 us of Python on a GPU machine for one sequence, 0.3-0.6 ms
for 64-128 sequences (H200's Xeon), while the GPU waits. None of it depends on the tokens. So once a decode
step is launched (one token, or one token of each of several sequences: a bucket, buckets.py), the session
fills the inputs of the likeliest next step (the same sequences, one position on, with logits) while the
device runs: against the cells as if those tokens were placed (KVCache.trial), which stay as they were.
The next decode takes the step when its batch is that step and nothing changed since (the cells, the
compute buffers): it records the cells, writes the token ids (and, for a step that samples, the rows'
sampling inputs, which the caller gives only then), and the graph runs. Any other batch decodes as usual,
filling every input again. Whether the graph that ran serves the next step is graph_reuse.decide's answer.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from ggrun.core.backends.base import Backend
from ggrun.core.llm.batch import Batch, UBatch
from ggrun.core.llm.buckets import pad_state
from ggrun.core.llm.graph_result import GraphResult
from ggrun.core.llm.graph_reuse import decide
from ggrun.core.llm.inputs import GraphParams, UBatchState
from ggrun.core.llm.kv_cache import KVCache
from ggrun.core.sched import Scheduler


@dataclass
class ReadyStep:
    """The next decode step, readied: every input of its graph filled but the token ids (and the sampling rows)."""

    res: GraphResult  # the kept graph, which serves the step
    params: GraphParams
    st: UBatchState  # the step (padded to its bucket), its token ids stand-ins, and the cells its tokens get
    tokens: np.ndarray  # the token ids' input: what is left to fill, with the sampling rows where the graph samples
    stamp: tuple[int, int]  # the cells' change count and the scheduler's activity it was filled against
    cpu: Backend  # whose memory the inputs live in
    n: int = field(init=False)  # the step's real tokens (past them: padding)
    pos: int = field(init=False)  # with one token: its position and sequence as numbers
    seq: int = field(init=False)

    def __post_init__(self) -> None:
        self.n = self.st.ub.n_real
        self.pos, self.seq = int(self.st.ub.pos[0]), int(self.st.ub.seq[0])

    def serves(self, batch: Batch, stamp: tuple[int, int], sampler: tuple = ()) -> bool:
        """Whether `batch` is this step (one token of each of its sequences, in order, at its positions, each
        asking logits), sampled with rows of the shape it was readied for, and the inputs filled for it still
        stand."""
        if len(batch.tokens) != self.n or sampler != self.params.sampler or stamp != self.stamp:
            return False
        if self.n == 1:
            return batch.pos[0] == self.pos and batch.seq[0] == self.seq and bool(batch.logits[0])
        ub = self.st.ub
        return (np.array_equal(batch.pos, ub.pos[:self.n]) and np.array_equal(batch.seq, ub.seq[:self.n])
                and bool(np.all(batch.logits)))

    def take(self, sampling=None) -> UBatchState:
        """The step, its rows' sampling inputs filled where the graph samples; its token ids come with write. The
        token ids' input is the step's token array too (filled from itself if filled again, saving an array a
        step)."""
        ub = self.st.ub
        st = UBatchState(UBatch(self.tokens, ub.pos, ub.seq, ub.out_rows, 0, ub.n_pad, ub.n_out_pad), self.st.cells,
                         self.st.kv, sampling=sampling)
        if sampling is not None:
            self.res.set_sampling_inputs(st, self.cpu)
        return st

    def write(self, tokens: np.ndarray) -> None:
        """The step's token ids into their input."""
        self.tokens[:self.n] = tokens


def stamp(kv: KVCache, sched: Scheduler) -> tuple[int, int]:
    """What a readied step's inputs are filled against: the cells' changes, the compute buffers' use."""
    return kv.changes, sched.activity


def readies(ub: UBatch, params: GraphParams) -> bool:
    """Whether a micro-batch run by a graph for params is a decode step whose next step can be readied: one token
    asking logits, or a bucket (buckets.wants_bucket said so when the graph was chosen: params.one_per_seq)."""
    return params.one_per_seq or (ub.n_tokens == 1 and ub.n_outputs == 1)


def ready_next(st: UBatchState, res: GraphResult, caches: tuple[KVCache, ...], sched: Scheduler,
               reuse: bool, n_ubatch: int) -> ReadyStep | None:
    """The next step of st's sequences (a token each, one position on), its inputs filled but the token ids and
    sampling rows, with the graph res that ran st when graph_reuse.decide lets it serve that step; None where
    the host does not wait for a device (logits made on the CPU, whose buffer the inputs share: they are read
    after this) or the step cannot be foretold: a window's cache, no free cells, another graph (or graph reuse
    off: `reuse` False)."""
    if res.logits.root.buffer.backend is sched.cpu:
        return None
    kv = caches[0]
    if len(caches) > 1 or kv.window is not None:
        return None
    n = st.ub.n_real
    seq, pos = st.ub.seq[:n], st.ub.pos[:n] + 1
    cells = kv.find_slot(n, seq)
    if cells is None:
        return None
    nxt = UBatchState(UBatch(st.ub.tokens[:n], pos, seq, np.arange(n, dtype=np.int32), 0), cells, kv)
    with kv.trial(cells, pos, seq):
        if n > 1:
            nxt = pad_state(nxt, n_ubatch)
        p = replace(res.params, n_kv=kv.n_kv(bucket=n > 1))
        if p.n_tokens != nxt.ub.n_tokens or not decide(p, res, res, (kv.version,), sched.generation, reuse).reuse:
            return None
        res.set_inputs(replace(nxt, sampling=st.sampling), sched.cpu)
    return ReadyStep(res, p, nxt, res.input_array("inp_tokens", sched.cpu), stamp(kv, sched), sched.cpu)
