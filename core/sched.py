"""The backend scheduler: assigns every node of a graph to a backend, cuts the graph into
splits, inserts copies at split borders, and owns one graph allocator (and compute
buffer) per backend.

Scheduling rewires the sources of nodes to their copies, so a scheduled graph belongs to
the scheduler. No backend ever reads another backend's memory: that is what copies are for.
"""
from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field

import numpy as np

from ggrun.core.alloc import GraphAllocator, Plan
from ggrun.core.backends.base import Backend
from ggrun.core.errors import GraphError, RuntimeFailure
from ggrun.core.graph import Graph
from ggrun.core.ops import OPS, copy_to
from ggrun.core.tensor import Tensor

log = logging.getLogger("ggrun.sched")


@dataclass
class Split:
    """Consecutive compute nodes on one backend, with the copies they need made first."""

    backend: Backend
    nodes: list[Tensor]
    copies: list[Tensor] = field(default_factory=list)
    calls: list | None = None  # kernel calls with resolved arrays, valid while the plan holds

    @property
    def copy_bytes(self) -> int:
        return sum(c.nbytes for c in self.copies)


@dataclass
class ScheduledGraph:
    """A graph with its assignment, splits, execution order and per-backend plans."""

    graph: Graph
    splits: list[Split]
    backend_of: dict[int, Backend]
    order: list[Tensor]
    owned: dict[str, set[int]]
    plans: dict[str, Plan] = field(default_factory=dict)

    @property
    def n_copies(self) -> int:
        return sum(len(s.copies) for s in self.splits)

    @property
    def copy_bytes(self) -> int:
        return sum(s.copy_bytes for s in self.splits)

    def backend_name(self, t: Tensor) -> str:
        root = t.root
        if root.buffer is not None:
            return root.buffer.backend.name
        return self.backend_of[id(root)].name


def _written_home(n: Tensor) -> Backend | None:
    """The backend whose placed memory node n writes into (cpy, set_rows into the KV cache), if any."""
    r = n.view_src
    if not OPS[n.op].writes_into or r is None or r.buffer is None:
        return None
    return r.buffer.backend


class Scheduler:
    """Runs graphs over several backends; `backends` is in priority order, the CPU last."""

    def __init__(self, backends: list[Backend], reuse_memory: bool = True) -> None:
        if not backends:
            raise RuntimeFailure("the scheduler needs at least one backend")
        self.backends = list(backends)
        self.allocators = {b.name: GraphAllocator(b, reuse_memory) for b in self.backends}
        self.generation = 0  # bumped by reset(): plans made before it are stale
        self.debug = int(os.environ.get("GGRUN_SCHED_DEBUG", "0") or 0)

    @property
    def cpu(self) -> Backend:
        return self.backends[-1]

    def backend(self, name: str) -> Backend:
        for b in self.backends:
            if b.name == name:
                return b
        raise GraphError(f"no backend named {name}")

    # ---- scheduling -------------------------------------------------------------------

    def schedule(self, graph: Graph, pins: dict[str, Backend] | None = None) -> ScheduledGraph:
        """Assign backends, cut splits and insert copies (rewiring node sources)."""
        be = self._assign(graph, pins or {})
        splits = self._split(graph, be)
        order = self._insert_copies(graph, splits, be)
        owned: dict[str, set[int]] = {b.name: set() for b in self.backends}
        for t in graph.leafs:
            if t.buffer is None:
                if not t.is_input:
                    raise GraphError(f"leaf {t.describe()} has no memory and is not an input")
                owned[be[id(t)].name].add(id(t))
        for t in order:
            if t.view_src is None and t.buffer is None:
                owned[be[id(t)].name].add(id(t))
        sg = ScheduledGraph(graph, splits, be, order, owned)
        if self.debug:
            self._print_splits(sg)
        return sg

    def _assign(self, graph: Graph, pins: dict[str, Backend]) -> dict[int, Backend]:
        be: dict[int, Backend] = {}
        for leaf in graph.leafs:
            be[id(leaf)] = leaf.buffer.backend if leaf.buffer is not None else self.cpu
        compute = [n for n in graph.nodes if not OPS[n.op].view]
        # pass 1: a node writing into placed memory (a KV cache write) runs where that memory is, as
        # its result is that memory; pinned nodes run where pinned; a node that reads a placed
        # tensor (weight, cache) runs where it lives
        for n in compute:
            home = _written_home(n)
            if home is not None:
                if n.name in pins and pins[n.name] is not home:
                    raise GraphError(f"{n.describe()} writes into memory of {home.name}; "
                                     f"it cannot be pinned to {pins[n.name].name}")
                be[id(n)] = home
                continue
            if n.name in pins:
                be[id(n)] = pins[n.name]
                continue
            for s in n.srcs:
                r = s.root
                if r.buffer is not None and not r.is_input:
                    b = r.buffer.backend
                    # one that cannot run the op goes to the fallback now, so that pass 2
                    # spreads where the node really runs
                    be[id(n)] = b if b.supports_op(n) else self._fallback(b, n)
                    break
        # pass 2: spread assignments forward to unassigned nodes, then back to leading ones
        cur = None
        for n in compute:
            b = be.get(id(n))
            if b is not None:
                cur = b
            elif cur is not None:
                be[id(n)] = cur
        first = next((be[id(n)] for n in compute if be.get(id(n)) is not None), self.cpu)
        for n in compute:
            if be.get(id(n)) is None:
                be[id(n)] = first
        # pass 3: fall back to the next backend that runs the op (the CPU last); a node writing
        # into placed memory cannot move (another backend could only write into a copy)
        for n in compute:
            b = be[id(n)]
            if not b.supports_op(n):
                if _written_home(n) is not None:
                    raise GraphError(f"{b.name} cannot run {n.op} of {n.describe()}, which writes into "
                                     f"{n.view_src.describe()} in {b.name}'s memory")
                be[id(n)] = self._fallback(b, n)
        # pass 4: pure views live where their root lives
        for n in graph.nodes:
            if OPS[n.op].view:
                r = n.view_src
                be[id(n)] = r.buffer.backend if r.buffer is not None else be[id(r)]
        return be

    def _fallback(self, b: Backend, n: Tensor) -> Backend:
        start = self.backends.index(b) + 1 if b in self.backends else 0
        for cand in self.backends[start:]:
            if cand.supports_op(n):
                return cand
        raise GraphError(f"no backend supports op {n.op} of {n.describe()}")

    def _split(self, graph: Graph, be: dict[int, Backend]) -> list[Split]:
        splits: list[Split] = []
        for n in graph.nodes:
            if OPS[n.op].view:
                continue
            b = be[id(n)]
            if not splits or splits[-1].backend is not b:
                splits.append(Split(b, []))
            splits[-1].nodes.append(n)
        return splits

    def _insert_copies(self, graph: Graph, splits: list[Split], be: dict[int, Backend]) -> list[Tensor]:
        """Give each split a copy of every source held by another backend; return the execution order."""
        copies: dict[tuple[int, str], Tensor] = {}

        def home(t: Tensor) -> Backend:
            r = t.root
            return r.buffer.backend if r.buffer is not None else be[id(r)]

        starts: dict[int, Split] = {}
        for split in splits:
            starts[id(split.nodes[0])] = split
            for n in split.nodes:
                srcs = list(n.srcs)
                for i, s in enumerate(srcs):
                    if home(s) is split.backend:
                        continue
                    key = (id(s), split.backend.name)
                    c = copies.get(key)
                    if c is None:
                        c = copies[key] = copy_to(s)
                        be[id(c)] = split.backend
                        split.copies.append(c)
                    srcs[i] = c
                n.srcs = tuple(srcs)
        order: list[Tensor] = []
        for n in graph.nodes:
            split = starts.get(id(n))
            if split is not None:
                order.extend(split.copies)
            order.append(n)
        return order

    # ---- memory -----------------------------------------------------------------------

    def _plan_each(self, sg: ScheduledGraph, how: str) -> dict[str, Plan]:
        inputs = sg.graph.inputs()
        plans = {}
        for b in self.backends:
            owned = sg.owned[b.name]
            if not owned and how == "measure":
                continue
            alloc = self.allocators[b.name]
            plans[b.name] = getattr(alloc, how)(sg.order, inputs, lambda t, o=owned: id(t) in o)
        return plans

    def measure(self, sg: ScheduledGraph) -> dict[str, Plan]:
        """The plan of each backend's compute buffer, without allocating anything."""
        return self._plan_each(sg, "measure")

    def reserve(self, sg: ScheduledGraph) -> dict[str, Plan]:
        """Allocate each backend's compute buffer for this (worst-case) graph."""
        return self._plan_each(sg, "reserve")

    def alloc(self, sg: ScheduledGraph) -> dict[str, Plan]:
        """Place every intermediate of the graph in the backends' compute buffers."""
        sg.plans = self._plan_each(sg, "alloc")
        for split in sg.splits:
            split.calls = None
        return sg.plans

    def buffer_sizes(self) -> dict[str, int]:
        return {name: a.reserved for name, a in self.allocators.items()}

    def reset(self) -> None:
        """Drop the compute buffers; every graph planned before is stale."""
        for a in self.allocators.values():
            a.release()
        self.generation += 1

    # ---- running ----------------------------------------------------------------------

    def compute(self, sg: ScheduledGraph) -> None:
        """Run the splits in order, each after its copies."""
        for split in sg.splits:
            b = split.backend
            for c in split.copies:
                b.copy_tensor(c.srcs[0], c)
            if split.calls is None:
                split.calls = b.prepare(split.nodes)
            b.run_prepared(split.calls)

    def get_tensor(self, t: Tensor) -> np.ndarray:
        return t.root.buffer.backend.get_tensor(t)

    def set_tensor(self, t: Tensor, data: np.ndarray) -> None:
        t.root.buffer.backend.set_tensor(t, data)

    def _print_splits(self, sg: ScheduledGraph) -> None:
        for i, s in enumerate(sg.splits):
            copied = ", ".join(f"{c.srcs[0].name}({c.nbytes})" for c in s.copies) or "-"
            print(f"sched: split {i}: {s.backend.name} nodes {s.nodes[0].name} .. {s.nodes[-1].name} "
                  f"({len(s.nodes)}) copies {len(s.copies)} [{s.copy_bytes} bytes]: {copied}", file=sys.stderr)
