"""A built and planned decode graph, kept so the next micro-batch can reuse it.

It records the parameters that fixed its shapes and the states it was planned against
(the KV cache layout version, the scheduler generation); any change means rebuild.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable

import numpy as np

from ggrun.core.backends.base import Backend
from ggrun.core.llm.inputs import GraphInput, GraphParams, UBatchState
from ggrun.core.sched import ScheduledGraph
from ggrun.core.tensor import Tensor


@dataclass
class GraphResult:
    params: GraphParams
    inputs: list[GraphInput]
    logits: Tensor
    sg: ScheduledGraph
    kv_version: tuple[int, ...]  # the version of each cache (two with a sliding-window cache)
    sched_generation: int
    tokens: Tensor | None = None  # with params.greedy: the argmax of each row of logits (i32, -1 if not finite)
    logprobs: Tensor | None = None  # with params.n_probs >= 0: ops.sample_logprobs of the sampled tokens
    # (plans, cpu, [(set_input, array)]): each input's refresh and its array, for the plans they were resolved in
    _resolved: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def reuse_blocker(self, p: GraphParams, kv_version: tuple[int, ...], sched_generation: int) -> str | None:
        """Why this graph cannot serve a micro-batch with params p, or None when it can."""
        if p != self.params:
            return ", ".join(p.differences(self.params))
        if kv_version != self.kv_version:
            return "KV cache layout changed"
        if sched_generation != self.sched_generation:
            return "scheduler was reset"
        if not self._inputs_fit_params:
            return "an input cannot be reused"
        return None

    @cached_property
    def _inputs_fit_params(self) -> bool:
        """Whether every input can serve this graph's own params: asked once, since reuse_blocker asks
        only for params equal to them, and an input's answer depends on nothing else."""
        return all(i.can_reuse(self.params) for i in self.inputs)

    def set_inputs(self, st: UBatchState, cpu: Backend) -> None:
        """Fill every input of the graph for micro-batch state st (inputs live in the CPU's memory)."""
        for set_input, arr in self._input_arrays(cpu):
            set_input(st, arr)

    def input_array(self, name: str, cpu: Backend) -> np.ndarray:
        """The array over the input tensor called `name` (as set_inputs fills it)."""
        arrays = self._input_arrays(cpu)
        return next(arr for i, (_, arr) in zip(self.inputs, arrays) if i.tensor.name == name)

    def _input_arrays(self, cpu: Backend) -> list[tuple[Callable, np.ndarray]]:
        """Each input's set_input with the array over its tensor, resolved once per memory plan (alloc
        makes a new `sg.plans`), as the scheduler resolves kernel calls once: while a graph is reused its
        inputs stay where they were placed, so finding their arrays again on every step is wasted."""
        r = self._resolved
        if r is None or r[0] is not self.sg.plans or r[1] is not cpu:
            r = self._resolved = (self.sg.plans, cpu, [(i.set_input, cpu.array(i.tensor)) for i in self.inputs])
        return r[2]


KEPT_GRAPHS = 8  # shapes a session keeps: a prompt's few n_kv steps, decode buckets, prompt and decode interleaved


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
        self.last: GraphResult | None = None

    def take(self, p: GraphParams, kv_version: tuple[int, ...], sched_generation: int) -> tuple[GraphResult | None, str]:
        """The kept graph that can serve p (None, and why not, when none can): a graph of p's shape
        planned against states that have since changed is dropped."""
        res = self._graphs.pop(p, None)
        if res is None:
            if self.last is None:
                return None, "first graph"
            return None, self.last.reuse_blocker(p, kv_version, sched_generation) or "not kept"
        why = res.reuse_blocker(p, kv_version, sched_generation)
        if why is not None:
            return None, why
        self._keep(res)
        return res, ""

    def keep(self, res: GraphResult) -> None:
        """Keep a newly built graph, dropping the least recently used beyond the size."""
        self._graphs.pop(res.params, None)
        self._keep(res)
        while len(self._graphs) > self.size:
            del self._graphs[next(iter(self._graphs))]

    def _keep(self, res: GraphResult) -> None:
        self._graphs[res.params] = res
        self.last = res
