"""Which compiled kernel runs a node on a backend: each kernel module registers binders that,
given a node and the arrays over its planned memory, return a ready call (or None where they
do not handle that case), and how much scratch the call needs. An op may have several binders
(the weight products and the attention products are both `mul_mat`); the first that returns a
call wins, and where none does the backend falls back (the reference array kernel, or another
backend).

A bound call holds every resolved array and parameter, so replaying a reused graph costs one
call per node and nothing else. Each backend with compiled kernels owns one table.
"""
from __future__ import annotations

from typing import Any, Callable

from ggrun.core.tensor import Tensor

Call = Callable[[], None]
Binder = Callable[..., "Call | None"]
ScratchSize = Callable[[Tensor], int]


class BinderTable:
    """The binders of one backend, by op."""

    def __init__(self) -> None:
        self.binders: dict[str, list[Binder]] = {}
        self.scratch: dict[str, list[ScratchSize]] = {}

    def binds(self, op: str, scratch: ScratchSize | None = None):
        """Register `fn(node, out, srcs, scratch_array, *extra) -> call | None` as a kernel of op.

        `scratch(node)` is the work space the call needs (0 for a node it does not handle); a node
        gets the largest any binder of its op asks, since the one that runs is chosen at bind time.
        """
        def register(fn: Binder) -> Binder:
            self.binders.setdefault(op, []).append(fn)
            if scratch is not None:
                self.scratch.setdefault(op, []).append(scratch)
            return fn
        return register

    def scratch_bytes(self, node: Tensor) -> int:
        return max((size(node) for size in self.scratch.get(node.op, ())), default=0)

    def handles(self, op: str) -> bool:
        return op in self.binders

    def bind(self, node: Tensor, out: Any, srcs: list, scratch: Any, *extra) -> Call | None:
        """The first call a binder of node's op returns, or None."""
        for fn in self.binders.get(node.op, ()):
            call = fn(node, out, srcs, scratch, *extra)
            if call is not None:
                return call
        return None
