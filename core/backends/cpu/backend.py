"""The CPU backend: numpy arenas like every host backend, with compiled (numba) kernels for
the ops and types that have one and the reference array kernels for the rest.

Weights stay in their GGUF blocks (memory-mapped); the kernels read them as they are.
"""
from __future__ import annotations

import math
from functools import partial

import numba
import numpy as np

from ggrun.core.backends.cpu import ops as _ops  # noqa: F401  (registers the compiled kernels)
from ggrun.core.backends.cpu import dispatch, jit, matmul
from ggrun.core.backends.cpu.crowding import Crowding
from ggrun.core.backends.cpu.repack_cache import RepackCache
from ggrun.core.backends.host import HostArrayBackend
from ggrun.core.backends.kernels import KERNELS
from ggrun.core.tensor import Tensor


# A weight without data (`ggrun measure`) that a load would repack: products plan their path and
# work space as for the repacked rows, so that the measured plan is the one a run makes.
PLANNED = "repack planned"

# Activation rows (tokens) of a step's products up to which it is a decode step: one or a few sequences'
# decode (crowding.py holds such steps on one thread while other work crowds the cores)
SMALL_ROWS = matmul.Q8_MAX_N
_PRODUCTS = {"mul_mat": 1, "mul_mat_id": 1, "mul_mat_multi": -1, "mul_mat_glu": -1}  # op: its activations' source


def _nothing() -> None:
    """The call of a node of no elements."""


class StepCalls(list):
    """A graph split's ready calls, one per node, and whether it is a decode step (see decode_step)."""

    def __init__(self, calls: list, decode: bool) -> None:
        super().__init__(calls)
        self.decode = decode


def decode_step(nodes: list[Tensor]) -> bool:
    """Whether nodes hold products, each of at most SMALL_ROWS activation rows (a split without products,
    such as the embeddings' get_rows before a device's layers, is not watched: it would only pay the reads)."""
    rows = [math.prod(n.srcs[_PRODUCTS[n.op]].shape[:-1]) for n in nodes if n.op in _PRODUCTS]
    return bool(rows) and max(rows) <= SMALL_ROWS


class CPUBackend(HostArrayBackend):
    """The host's cores: compiled kernels where they exist, numpy otherwise; runs every op."""

    name = "CPU"

    def __init__(self) -> None:
        self.device = "host memory, numba kernels"
        self.crowding = Crowding()

    def scratch_bytes(self, node: Tensor) -> int:
        return dispatch.scratch_bytes(node)

    def prepare_weight(self, t: Tensor, store: RepackCache | None = None) -> int:
        """Quantized matrices get the interleaved layout the decode kernels read fastest: from `store`
        when an earlier load of the file left it there, else made now (and given to `store`). An experts'
        weight [n_expert, M, K] is repacked as one matrix of n_expert * M rows where matmul.experts_repacked
        says its experts' drivers read it so."""
        if not t.dtype.is_quantized or not (len(t.shape) == 2 or matmul.experts_repacked(t.dtype, t.shape)):
            return 0
        rows = (math.prod(t.shape[:-1]), t.shape[-1])
        if t.buffer is None or t.buffer.storage is None:  # measured, not loaded: planned as if repacked
            added = matmul.repacked_bytes(t.dtype, rows)
            if added:
                t.params[matmul.REPACKED] = PLANNED
            return added
        packed = store.get(t.name) if store is not None else None
        if packed is None:
            packed = matmul.repack(t.dtype, self.array(t).reshape(rows[0], -1))
            if packed is not None and store is not None:
                store.put(t.name, packed)
        if packed is None:
            return 0
        t.params[matmul.REPACKED] = packed
        return sum(a.nbytes for a in packed) if isinstance(packed, tuple) else packed.nbytes

    def prepared_store(self, source: str) -> RepackCache | None:
        """The repacked weights of model file `source` kept on disk (repack_cache.py)."""
        return RepackCache.for_model(source)

    def prepare(self, nodes: list[Tensor]) -> list:
        """One ready call per node, compiled where a binder accepts the node. A node of no elements (a prompt
        micro-batch's last-layer rows and output head where it asks no logits) has nothing to compute: its call
        does nothing. The compiled kernels decline empty shapes, and numpy's fallback decoded the whole weight
        first (gemma-3-270m's 262144 x 640 Q8_0 output head: 3.4 s and 670 MB in a long prompt's first
        micro-batch)."""
        arr = self.array
        calls = []
        for n in nodes:
            if n.n_elements == 0:
                calls.append(_nothing)
                continue
            out, srcs = arr(n), [arr(s) for s in n.srcs]
            scratch = arr(n.scratch).view(np.uint8) if n.scratch is not None else None
            call = dispatch.bind(n, out, srcs, scratch)
            calls.append(call if call is not None else partial(KERNELS[n.op], np, n, out, srcs))
        return StepCalls(calls, decode_step(nodes))

    def run_prepared(self, calls: list) -> None:
        """The calls in order; a decode step on one thread while other work crowds the cores (crowding.py)
        where idle threads poll (with --poll 0 they sleep, and only large products split)."""
        watched = isinstance(calls, StepCalls) and calls.decode and jit.threads() > 1 and jit.poll() > 0
        if watched and self.crowding.one_thread(jit.threads()):
            n = numba.get_num_threads()
            numba.set_num_threads(1)
            try:
                for call in calls:
                    call()
            finally:
                numba.set_num_threads(n)
            return
        for call in calls:
            call()
        if watched:
            self.crowding.after_step()
