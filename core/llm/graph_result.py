"""A built and planned decode graph, kept so the next micro-batch can reuse it (graph_reuse.py decides).

It records the parameters that fixed its shapes and the states it was planned against
(the KV cache layout version, the scheduler generation), and fills its inputs for a micro-batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable

import numpy as np

from ggrun.core.backends.base import Backend
from ggrun.core.llm.inputs import GraphInput, GraphParams, InpSamplingRows, UBatchState
from ggrun.core.sched import ScheduledGraph
from ggrun.core.tensor import Tensor


@dataclass
class GraphResult:
    """A decode graph built for `params`, scheduled and planned, with its inputs and the outputs it ends in."""

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

    @cached_property
    def inputs_serve_params(self) -> bool:
        """Whether every input can serve this graph's own params (GraphInput.can_reuse): asked once, since
        graph_reuse.decide asks only for params equal to them, and an input's answer depends on nothing else."""
        return all(i.can_reuse(self.params) for i in self.inputs)

    def set_inputs(self, st: UBatchState, cpu: Backend) -> None:
        """Fill every input of the graph for micro-batch state st (inputs live in the CPU's memory)."""
        for set_input, arr in self._input_arrays(cpu):
            set_input(st, arr)

    def set_sampling_inputs(self, st: UBatchState, cpu: Backend) -> None:
        """Fill only the inputs of ops.sample's rows for st (a readied step's last ones, ready_step.py)."""
        for i, (set_input, arr) in zip(self.inputs, self._input_arrays(cpu)):
            if isinstance(i, InpSamplingRows):
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

