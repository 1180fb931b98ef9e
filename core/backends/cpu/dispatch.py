"""Which compiled CPU kernel runs a node: each op module registers a binder that, given a node
and the arrays over its planned memory, returns a ready call (or None where it does not
handle that case, so the reference array kernel runs), and how much scratch the call needs.

A bound call holds every resolved array and parameter, so replaying a reused graph costs one
Python call per node and nothing else.
"""
from __future__ import annotations

from typing import Any, Callable

from core.tensor import Tensor

Call = Callable[[], None]
Binder = Callable[[Tensor, Any, list, Any], "Call | None"]
ScratchSize = Callable[[Tensor], int]

BINDERS: dict[str, Binder] = {}
SCRATCH: dict[str, ScratchSize] = {}


def binds(op: str, scratch: ScratchSize | None = None):
    """Register `fn(node, out, srcs, scratch_array) -> call | None` as the CPU kernel of op."""
    def register(fn: Binder) -> Binder:
        BINDERS[op] = fn
        if scratch is not None:
            SCRATCH[op] = scratch
        return fn
    return register
