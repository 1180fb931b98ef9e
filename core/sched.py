"""The backend scheduler: assigns every node of a graph to a backend, cuts the graph into
splits, inserts copies at split borders, and owns one graph allocator (and compute
buffer) per backend.

Scheduling rewires the sources of nodes to their copies, so a scheduled graph belongs to
the scheduler. No backend ever reads another backend's memory: that is what copies are for.
Copies are counted by kind (host to device, device to device, device to host); GGRUN_SCHED_DEBUG=1
prints each graph's splits and copies, =2 also each compute's pipeline slot and the running counts.

Pipeline parallelism (llama.cpp's n_copies): with n_copies > 1 every split input has one copy per
pipeline slot, in memory of its own that lives through the whole graph. Graph computes take the slots
in turn, and a split's copies into a slot wait (an event) until the split that read that slot before
is done, so that micro-batch k+1's first split may run while micro-batch k runs on the next device.
"""
from __future__ import annotations

import logging
import os
import sys
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ggrun.core.alloc import GraphAllocator, Plan
from ggrun.core.backends.base import Backend
from ggrun.core.errors import GraphError, RuntimeFailure
from ggrun.core.graph import Graph
from ggrun.core.ops import OPS, RUN_ON, copy_to
from ggrun.core.tensor import Tensor

log = logging.getLogger("ggrun.sched")


@dataclass
class Split:
    """Consecutive compute nodes on one backend, with the copies they need made first."""

    backend: Backend
    nodes: list[Tensor]
    copies: list[Tensor] = field(default_factory=list)  # the copies the nodes read (pipeline slot 0's)
    calls: list | None = None  # kernel calls with resolved arrays, valid while the plan holds
    slot_calls: dict = field(default_factory=dict)  # pipeline slot (1..) -> its calls, reading that slot's copies
    copy_runs: dict = field(default_factory=dict)  # pipeline slot -> what makes its copies (Backend.plan_copies)
    tally: dict[str, CopyCount] | None = None  # what one compute's copies add to the counts, per kind

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
    # pipeline slots: slot k maps id(slot 0's copy) to slot k's copy of the same source (one slot: none)
    slots: list[dict[int, Tensor]] = field(default_factory=list)

    @property
    def n_copies(self) -> int:
        """Copies one compute makes."""
        return sum(len(s.copies) for s in self.splits)

    @property
    def n_slots(self) -> int:
        return max(len(self.slots), 1)

    @property
    def persistent(self) -> list[Tensor]:
        """Every slot's copies: planned like inputs, each in bytes of its own for the whole graph."""
        return [c for slot in self.slots for c in slot.values()] if len(self.slots) > 1 else []

    @property
    def copy_bytes(self) -> int:
        return sum(s.copy_bytes for s in self.splits)

    def home(self, t: Tensor) -> Backend:
        """The backend whose memory holds t (placed, or to be planned there)."""
        root = t.root
        return root.buffer.backend if root.buffer is not None else self.backend_of[id(root)]

    def backend_name(self, t: Tensor) -> str:
        return self.home(t).name


def _written_home(n: Tensor) -> Backend | None:
    """The backend whose placed memory node n writes into (cpy, set_rows into the KV cache), if any."""
    r = n.view_src
    if not OPS[n.op].writes_into or r is None or r.buffer is None:
        return None
    return r.buffer.backend


COPY_KINDS = ("host->device", "device->device", "device->host")
SLOTS_KEPT = 256  # computes whose pipeline slot is remembered


@dataclass
class CopyCount:
    """Copies of one kind made so far, and their bytes."""

    n: int = 0
    nbytes: int = 0


class Scheduler:
    """Runs graphs over several backends; `backends` is in priority order, the CPU last. n_copies > 1
    pipelines micro-batches over the devices (a copy of every split input per slot)."""

    def __init__(self, backends: list[Backend], reuse_memory: bool = True, n_copies: int = 1) -> None:
        if not backends:
            raise RuntimeFailure("the scheduler needs at least one backend")
        if n_copies < 1:
            raise RuntimeFailure(f"n_copies {n_copies} must be positive")
        self.backends = list(backends)
        self.allocators = {b.name: GraphAllocator(b, reuse_memory) for b in self.backends}
        self.generation = 0  # bumped by reset(): plans made before it are stale
        # bumped by whatever may write the compute buffers (a plan, a compute, a reset): inputs filled
        # ahead of a compute (a readied decode step) are still there while it has not moved
        self.activity = 0
        self.debug = int(os.environ.get("GGRUN_SCHED_DEBUG", "0") or 0)
        self.n_copies = n_copies
        self.cur_slot = 0  # the pipeline slot the next compute uses
        self.slots_used: deque[int] = deque(maxlen=SLOTS_KEPT)  # the slots of the latest computes (reports)
        self._slot_events: dict[tuple[str, int], object] = {}  # (backend, slot) -> after its last split reading it
        self.copy_counts = {kind: CopyCount() for kind in COPY_KINDS}
        # called with (split, "start") before a split's copies and (split, "end") after its run: a
        # diagnostic's hook (scripts/tools/pipeline_timeline.py records device events there)
        self.probe: Callable[[Split, str], None] | None = None

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
        slots = self._slot_copies(splits, be)
        if len(slots) > 1:  # the copies are planned apart from the walk, as inputs
            order = [t for t in order if id(t) not in slots[0]]
        owned: dict[str, set[int]] = {b.name: set() for b in self.backends}
        for t in graph.leafs:
            if t.buffer is None:
                if not t.is_input:
                    raise GraphError(f"leaf {t.describe()} has no memory and is not an input")
                owned[be[id(t)].name].add(id(t))
        sg = ScheduledGraph(graph, splits, be, order, owned, slots=slots)
        for t in order + sg.persistent:
            if t.view_src is None and t.buffer is None:
                owned[be[id(t)].name].add(id(t))
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
            if RUN_ON in n.params:  # a node that names its backend (a row-split product's gather)
                be[id(n)] = self.backend(n.params[RUN_ON])
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

    def _slot_copies(self, splits: list[Split], be: dict[int, Backend]) -> list[dict[int, Tensor]]:
        """With n_copies > 1, a copy of every split input per pipeline slot (slot 0's are the copies the
        nodes read), each flagged input and output as ggml flags them: placed before the walk and never
        released, so no slot shares bytes with anything a later micro-batch might still be using."""
        firsts = [c for s in splits for c in s.copies]
        if self.n_copies == 1 or not firsts:
            return []
        slots = [{id(c): c for c in firsts}]
        for k in range(1, self.n_copies):
            slots.append({id(c): copy_to(c.srcs[0], name=f"{c.name}#{k}") for c in firsts})
        for slot in slots:
            for first_id, c in zip(slots[0], slot.values()):
                c.is_input = c.is_output = True
                be[id(c)] = be[first_id]
        return slots

    # ---- memory -----------------------------------------------------------------------

    def _plan_each(self, sg: ScheduledGraph, how: str) -> dict[str, Plan]:
        self.activity += how != "measure"
        inputs = sg.graph.inputs() + sg.persistent
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
            split.slot_calls = {}
            split.copy_runs = {}
        return sg.plans

    def buffer_sizes(self) -> dict[str, int]:
        return {name: a.reserved for name, a in self.allocators.items()}

    def reset(self) -> None:
        """Drop the compute buffers; every graph planned before is stale."""
        for a in self.allocators.values():
            a.release()
        self.generation += 1
        self.activity += 1

    # ---- running ----------------------------------------------------------------------

    def compute(self, sg: ScheduledGraph) -> None:
        """Run the splits in order, each after its copies into this compute's pipeline slot."""
        self.activity += 1
        n_slots = sg.n_slots
        slot = self.cur_slot % n_slots
        self.cur_slot = (self.cur_slot + 1) % self.n_copies
        self.slots_used.append(slot)
        for split in sg.splits:
            b = split.backend
            if self.probe is not None:
                self.probe(split, "start")
            if split.copies:
                self._copy_inputs(sg, split, slot)
            b.run_prepared(self._calls(sg, split, slot))
            if self.probe is not None:
                self.probe(split, "end")
            if n_slots > 1 and split.copies:
                self._slot_events[(b.name, slot)] = b.record_event()
        if self.debug >= 2:
            counts = ", ".join(f"{kind} {c.n} ({c.nbytes} bytes)" for kind, c in self.copy_counts.items() if c.n)
            print(f"sched: computed in slot {slot} of {n_slots}; copies so far: {counts or 'none'}",
                  file=sys.stderr)

    def _copy_inputs(self, sg: ScheduledGraph, split: Split, slot: int) -> None:
        """The split's copies into `slot`, after the split that read that slot last is done with it."""
        b = split.backend
        n_slots = sg.n_slots
        if n_slots > 1:
            b.wait_event(self._slot_events.get((b.name, slot)))
        copy = split.copy_runs.get(slot)
        if copy is None:
            into = sg.slots[slot] if n_slots > 1 else {}
            copy = split.copy_runs[slot] = b.plan_copies([(c.srcs[0], into.get(id(c), c)) for c in split.copies])
        copy()
        for kind, add in self._tally(sg, split).items():
            count = self.copy_counts[kind]
            count.n += add.n
            count.nbytes += add.nbytes

    def _tally(self, sg: ScheduledGraph, split: Split) -> dict[str, CopyCount]:
        """The copies one compute makes for the split, and their bytes, per kind: the same every time
        (every pipeline slot's copy has the shape of slot 0's), so counted once per split."""
        if split.tally is None:
            split.tally = {}
            for c in split.copies:
                add = split.tally.setdefault(self.copy_kind(sg.home(c.srcs[0]), split.backend), CopyCount())
                add.n += 1
                add.nbytes += c.nbytes
        return split.tally

    def _calls(self, sg: ScheduledGraph, split: Split, slot: int):
        """The split's prepared kernel calls for `slot`: made once per plan, those of slot k > 0 with
        the nodes reading slot k's copies."""
        if slot == 0:
            if split.calls is None:
                split.calls = split.backend.prepare(split.nodes)
            return split.calls
        calls = split.slot_calls.get(slot)
        if calls is None:
            calls = split.slot_calls[slot] = _prepare_reading(split, sg.slots[slot])
        return calls

    def copy_kind(self, src: Backend, dst: Backend) -> str:
        """host->device, device->device or device->host (the CPU is the host; every other backend a device)."""
        if src is self.cpu:
            return "host->device"
        return "device->host" if dst is self.cpu else "device->device"

    def get_tensor(self, t: Tensor) -> np.ndarray:
        return t.root.buffer.backend.get_tensor(t)

    def get_checked(self, t: Tensor) -> tuple[np.ndarray, bool]:
        """t's elements on the host and whether all are finite (Backend.get_checked)."""
        return t.root.buffer.backend.get_checked(t)

    def set_tensor(self, t: Tensor, data: np.ndarray) -> None:
        t.root.buffer.backend.set_tensor(t, data)

    def _print_splits(self, sg: ScheduledGraph) -> None:
        kinds = {kind: CopyCount() for kind in COPY_KINDS}
        for i, s in enumerate(sg.splits):
            copied = ", ".join(f"{c.srcs[0].name}({c.nbytes})" for c in s.copies) or "-"
            print(f"sched: split {i}: {s.backend.name} nodes {s.nodes[0].name} .. {s.nodes[-1].name} "
                  f"({len(s.nodes)}) copies {len(s.copies)} [{s.copy_bytes} bytes]: {copied}", file=sys.stderr)
            for c in s.copies:
                k = kinds[self.copy_kind(sg.home(c.srcs[0]), s.backend)]
                k.n += 1
                k.nbytes += c.nbytes
        per = ", ".join(f"{kind} {c.n} ({c.nbytes} bytes)" for kind, c in kinds.items() if c.n) or "none"
        slots = f"; {sg.n_slots} pipeline slots" if sg.n_slots > 1 else ""
        print(f"sched: copies per compute: {per}{slots}", file=sys.stderr)


def _prepare_reading(split: Split, copies: dict[int, Tensor]):
    """The split's kernel calls with its nodes reading `copies` (a pipeline slot's) in place of slot 0's:
    sources are swapped while the backend resolves its arrays, then put back."""
    saved = [n.srcs for n in split.nodes]
    try:
        for n in split.nodes:
            n.srcs = tuple(copies.get(id(s), s) for s in n.srcs)
        return split.backend.prepare(split.nodes)
    finally:
        for n, srcs in zip(split.nodes, saved):
            n.srcs = srcs
