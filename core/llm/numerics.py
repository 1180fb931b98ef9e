"""Numeric faults: logits with NaN or infinity stop decoding with a RuntimeFailure naming where they
appeared, and on request (`--check-numerics`, GGRUN_GRAPH_DEBUG=1) the graph node that produced the
first non-finite value, found by recomputing the graph node by node.

The recomputation runs only after a fault was seen; the normal decode path only asks the backend
holding the logits whether they are finite (Backend.get_checked).
"""
from __future__ import annotations

import importlib
from typing import Callable

import numpy as np

from ggrun.core.dtypes import DType
from ggrun.core.errors import RuntimeFailure
from ggrun.core.ops import OPS
from ggrun.core.sched import ScheduledGraph
from ggrun.core.tensor import Tensor

HINT = "GGRUN_GRAPH_DEBUG=1 (or `run --check-numerics`) names the graph node that produced them"


class NonFiniteLogits(RuntimeFailure):
    """The model computed NaN or infinite logits: corrupt weights or a numeric fault in a kernel.

    The line names the model file (`source`), as every error about a model does. A caller that catches
    one to say where it happened in its own terms (generate: 'at generation step 3') raises a new one
    while handling it, and that keeps the source of the one it replaces (its __context__)."""

    def __init__(self, kind: str, where: str, culprit: str | None = None, source: str | None = None) -> None:
        self.kind = kind
        self.where = where
        self.culprit = culprit
        self._source = source
        super().__init__(kind, where, culprit, source)

    @property
    def source(self) -> str | None:
        """The model file, given or inherited from the fault this one re-words."""
        if self._source is None and isinstance(self.__context__, NonFiniteLogits):
            return self.__context__.source
        return self._source

    def __str__(self) -> str:
        """One line: the file, the kind, where (e.g. 'at generation step 3 (position 9)'), the culprit or a hint."""
        head = f"{self.source}: " if self.source else ""
        return f"{head}non-finite logits ({self.kind}) {self.where}; {self.culprit or HINT}"


def non_finite_kind(values) -> str | None:
    """'NaN', 'inf' or 'NaN and inf' when a float array (numpy or cupy) holds such values, else None."""
    if values.dtype.kind != "f":
        return None
    if isinstance(values, np.ndarray):
        return _kind(np, values)
    with values.device:  # a GPU's array is read by kernels on its own device, whichever is current
        return _kind(importlib.import_module("cupy"), values)


def _kind(xp, values) -> str | None:
    if bool(xp.isfinite(values).all()):
        return None
    nan, inf = bool(xp.isnan(values).any()), bool(xp.isinf(values).any())
    return "NaN and inf" if nan and inf else "NaN" if nan else "inf"


def first_non_finite(sg: ScheduledGraph, refill: Callable[[], None]) -> str | None:
    """Recompute `sg` node by node (after `refill` set its inputs again) and describe the first node whose
    result holds a non-finite value, naming a weight it read that already held one. Recomputing the
    micro-batch that just ran is safe: its KV cache writes put the same rows in the same cells."""
    refill()
    for split in sg.splits:
        b = split.backend
        for c in split.copies:
            b.copy_tensor(c.srcs[0], c)
        for node in split.nodes:
            b.compute([node])
            if OPS[node.op].view:
                continue
            kind = _kind_of(b, node)
            if kind:
                return _describe(node, kind)
    return None


FLOAT_TYPES = (DType.F32, DType.F16)


def _kind_of(backend, t: Tensor) -> str | None:
    if t.dtype not in FLOAT_TYPES:
        return None
    return non_finite_kind(backend.array(t))


def _describe(node: Tensor, kind: str) -> str:
    text = f"the first non-finite value ({kind}) comes from node {node.describe()} ({node.op})"
    for src in node.srcs:
        if src.is_weight:
            bad = _kind_of(src.root.buffer.backend, src)
            if bad:
                return f"{text}, whose weight {src.name} holds {bad}"
    return text
