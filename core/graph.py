"""A compute graph: the nodes reachable from the result tensors, in execution order, and the leafs.

Order comes only from data edges (a depth-first walk from the results), never from the
order in which tensors were created.
"""
from __future__ import annotations

from dataclasses import dataclass

from ggrun.core.ops import OPS
from ggrun.core.tensor import Tensor


@dataclass
class Graph:
    """nodes: tensors with an op, each after all its sources; leafs: tensors without one."""

    nodes: list[Tensor]
    leafs: list[Tensor]
    outputs: list[Tensor]

    def compute_nodes(self) -> list[Tensor]:
        """Nodes that need a kernel (view ops only reinterpret memory)."""
        return [n for n in self.nodes if not OPS[n.op].view]

    def inputs(self) -> list[Tensor]:
        return [t for t in self.leafs if t.is_input]


def build_graph(outputs: list[Tensor]) -> Graph:
    """Walk back from `outputs` (marked as outputs) and order every reachable tensor.

    Iterative post-order DFS: a 30-layer model is deeper than Python's recursion limit.
    """
    nodes: list[Tensor] = []
    leafs: list[Tensor] = []
    seen: set[int] = set()
    for out in outputs:
        out.is_output = True
        stack: list[tuple[Tensor, int]] = [(out, 0)]
        while stack:
            t, i = stack.pop()
            if i == 0:
                if id(t) in seen:
                    continue
                seen.add(id(t))
            deps = _deps(t)
            if i < len(deps):
                stack.append((t, i + 1))
                if id(deps[i]) not in seen:
                    stack.append((deps[i], 0))
                continue
            (nodes if t.op is not None else leafs).append(t)
    return Graph(nodes=nodes, leafs=leafs, outputs=list(outputs))


def _deps(t: Tensor) -> tuple[Tensor, ...]:
    """Sources, plus the view root (a view is computed after the tensor it views)."""
    if t.view_src is not None and t.view_src not in t.srcs:
        return t.srcs + (t.view_src,)
    return t.srcs
