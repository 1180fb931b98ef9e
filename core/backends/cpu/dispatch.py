"""Which compiled CPU kernel runs a node: each op module registers binders that, given a node
and the arrays over its planned memory, return a ready call (or None where they do not handle
that case), and how much scratch the call needs. An op may have several binders (the weight
products and the attention products are both `mul_mat`); the first that returns a call wins,
and where none does the reference array kernel runs.

A bound call holds every resolved array and parameter, so replaying a reused graph costs one
Python call per node and nothing else.
"""
from __future__ import annotations

from typing import Any, Callable

from ggrun.core.tensor import Tensor

Call = Callable[[], None]
Binder = Callable[[Tensor, Any, list, Any], "Call | None"]
ScratchSize = Callable[[Tensor], int]

BINDERS: dict[str, list[Binder]] = {}
SCRATCH: dict[str, list[ScratchSize]] = {}


def binds(op: str, scratch: ScratchSize | None = None):
    """Register `fn(node, out, srcs, scratch_array) -> call | None` as a CPU kernel of op.

    `scratch(node)` is the work space the call needs (0 for a node it does not handle); a node
    gets the largest any binder of its op asks, since the one that runs is chosen at bind time.
    """
    def register(fn: Binder) -> Binder:
        BINDERS.setdefault(op, []).append(fn)
        if scratch is not None:
            SCRATCH.setdefault(op, []).append(scratch)
        return fn
    return register


def scratch_bytes(node: Tensor) -> int:
    return max((size(node) for size in SCRATCH.get(node.op, ())), default=0)


def bind(node: Tensor, out: Any, srcs: list, scratch: Any) -> Call | None:
    """The first compiled call a binder of node's op returns, or None."""
    for fn in BINDERS.get(node.op, ()):
        call = fn(node, out, srcs, scratch)
        if call is not None:
            return call
    return None
