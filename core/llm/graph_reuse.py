"""Graph reuse, in one place: whether the next micro-batch runs a graph the session keeps or a new one,
and why (`decide`), and the graphs kept for it (`GraphCache`).

Building and planning a decode graph costs time; running a kept one costs only its inputs' refresh (on a
GPU, the replay of its captured CUDA graphs). A kept graph serves a micro-batch when all of these hold:
- graph reuse is on (SessionParams.graph_reuse, `--no-graph-reuse`, GGRUN_GRAPH_REUSE=0) and a graph was
  built before;
- it has the micro-batch's shapes (GraphParams: tokens, logit rows, cells attended, how the graph ends);
- the KV cache layout is the one it was planned against (seq_add moved keys: its version changed);
- the scheduler was not reset since (its memory plan would point into released buffers);
- each of its inputs can serve (GraphInput.can_reuse, in inputs.py).
Otherwise the graph is rebuilt, and the decision says why; GGRUN_GRAPH_DEBUG=1 prints it per micro-batch,
SessionStats.reuse_log records it. Its callers: Session._graph_for through GraphCache.take, and
ready_step.ready_next, which readies the next decode step while the device runs this one.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

from ggrun.core.llm.graph_result import GraphResult
from ggrun.core.llm.inputs import GraphParams


@dataclass(frozen=True)
class Decision:
    """Reuse a kept graph or rebuild, and why: "reused", or what stops reuse ("first graph", "n_tokens 6 ->
    1", "KV cache layout changed", ...)."""

    reuse: bool
    why: str

    @property
    def said(self) -> str:
        """The decision as GGRUN_GRAPH_DEBUG prints it and SessionStats.reuse_log records it."""
        return self.why if self.reuse else f"rebuilt: {self.why}"


REUSED = Decision(True, "reused")


def reuse_enabled_by_env() -> bool:
    """GGRUN_GRAPH_REUSE=0 (or false, no) turns graph reuse off, as `--no-graph-reuse` does."""
    return os.environ.get("GGRUN_GRAPH_REUSE", "1") not in ("0", "false", "no")


def decide(p: GraphParams, kept: GraphResult | None, last: GraphResult | None, kv_version: tuple[int, ...],
           sched_generation: int, enabled: bool = True) -> Decision:
    """Whether `kept`, the graph offered for a micro-batch with params p (None when none of p's shape is
    kept), serves it, given the caches' versions and the scheduler's generation now; `last` is the graph the
    last micro-batch ran (None before the first), which says why when none is offered."""
    if last is None:
        return Decision(False, "first graph")
    if not enabled:
        return Decision(False, "graph reuse disabled")
    if kept is None:
        return Decision(False, _blocker(last, p, kv_version, sched_generation) or "not kept")
    why = _blocker(kept, p, kv_version, sched_generation)
    return REUSED if why is None else Decision(False, why)


def _blocker(res: GraphResult, p: GraphParams, kv_version: tuple[int, ...], sched_generation: int) -> str | None:
    """Why graph res cannot serve a micro-batch with params p, or None when it can."""
    if p != res.params:
        return ", ".join(p.differences(res.params))
    if kv_version != res.kv_version:
        return "KV cache layout changed"
    if sched_generation != res.sched_generation:
        return "scheduler was reset"
    if not res.inputs_serve_params:
        return "an input cannot be reused"
    return None


# shapes a session keeps: a prompt's few n_kv steps, decode buckets, prompt and decode interleaved. 64 clients
# joining `parallel` make ~8 shapes of prompt steps once; with 8 kept, those pushed out the decode step's graph
# that the warm-up had built, and a new graph costs the H200's host ~66 ms. A kept graph holds no device memory of
# its own (its plan is in the shared compute buffers), only its bound steps and captured CUDA graph.
KEPT_GRAPHS = 16


# A micro-batch of a shape no kept graph has runs a kept graph of up to twice its tokens and outputs, padded further,
# this many times before it gets a graph of its own (GraphCache.borrow): 64 clients joining `parallel` made steps of
# 128 and 256 tokens (64 outputs), and its last steps a bucket of 32 sequences beside the 64's, each shape a graph
# built for a few uses (~40 ms of the H200's host apiece), where the padding rows cost such a step an estimated
# 0.5-3 ms (a 1B model's products over 32-128 more rows).
BORROW_USES = 8
BORROW_FACTOR = 2


def _fits(p: GraphParams, q: GraphParams) -> bool:
    """Whether a graph for q can run a micro-batch of params p padded further: the same in all but its tokens and
    outputs, more tokens and at least as many outputs, each up to BORROW_FACTOR times p's."""
    return (replace(q, n_tokens=p.n_tokens, n_outputs=p.n_outputs) == p
            and p.n_tokens < q.n_tokens <= BORROW_FACTOR * p.n_tokens
            and p.n_outputs <= q.n_outputs <= BORROW_FACTOR * p.n_outputs)


class GraphCache:
    """The graphs a session keeps for reuse, one per shape (GraphParams), the least recently used dropped
    beyond `size`. Keeping only the last graph rebuilt every micro-batch whose shape alternates: a long
    prompt's micro-batches (n_kv grows with each), a prompt chunk between decode steps, decode buckets,
    and every repetition of a benchmark. Each kept graph has its own memory plan in the scheduler's
    compute buffers (one backend runs one graph at a time, in order) and its own prepared kernel calls
    and captured device graphs, so taking one back costs only its inputs' refresh."""

    def __init__(self, size: int = KEPT_GRAPHS) -> None:
        self.size = size
        self._graphs: dict[GraphParams, GraphResult] = {}  # insertion order: least recently used first
        self._borrows: dict[GraphParams, int] = {}  # shapes that ran a larger graph (borrow): how many times
        self.last: GraphResult | None = None

    def take(self, p: GraphParams, kv_version: tuple[int, ...], sched_generation: int,
             enabled: bool = True) -> tuple[GraphResult | None, Decision]:
        """The kept graph that serves p (None when none does) and the decision (decide): a graph of p's
        shape planned against states that have since changed is dropped."""
        kept = self._graphs.pop(p, None)
        decision = decide(p, kept, self.last, kv_version, sched_generation, enabled)
        if not decision.reuse:
            return None, decision
        self._keep(kept)
        return kept, decision

    def borrow(self, p: GraphParams, kv_version: tuple[int, ...], sched_generation: int) -> GraphResult | None:
        """A kept graph that can run a micro-batch of params p padded further (_fits), the most recently used first,
        where none of p's own shape is kept and p has borrowed fewer than BORROW_USES times; None otherwise. A
        padded row costs the step a row of its products, a new graph tens of milliseconds of host work: a shape
        met a few times runs a larger one, a shape that recurs gets its own."""
        if p in self._graphs or self._borrows.get(p, 0) >= BORROW_USES:
            return None
        for q, res in reversed(self._graphs.items()):
            if _fits(p, q) and _blocker(res, q, kv_version, sched_generation) is None:
                self._borrows[p] = self._borrows.get(p, 0) + 1
                return res
        return None

    def keep(self, res: GraphResult, enabled: bool = True) -> None:
        """Keep a newly built graph, dropping the least recently used beyond the size; with reuse off, only
        note it as the last one run."""
        if not enabled:
            self.last = res
            return
        self._graphs.pop(res.params, None)
        self._borrows.pop(res.params, None)
        self._keep(res)
        while len(self._graphs) > self.size:
            del self._graphs[next(iter(self._graphs))]

    def _keep(self, res: GraphResult) -> None:
        self._graphs[res.params] = res
        self.last = res
