"""The graph allocator: places every intermediate tensor of a graph into one compute buffer
per backend, reusing memory as soon as a tensor is dead, and computing results in place
where the op allows it.

It never allocates memory itself except through `Backend.alloc_buffer`, and a graph whose
plan needs more than the reserved buffer causes a logged re-reserve, never a silent
allocation elsewhere.
"""
from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np

from ggrun.core.dtypes import DType
from ggrun.core.ops import OPS
from ggrun.core.tensor import Tensor, new_tensor

log = logging.getLogger("ggrun.alloc")


def align_up(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


class FreeList:
    """Free blocks of one buffer kept sorted by offset; best-fit allocation, coalescing on free.

    The buffer's high-water mark (`size`) grows only when no free block fits; a free block
    that ends at the high-water mark is extended instead of leaving a gap.
    """

    def __init__(self) -> None:
        self.offsets: list[int] = []
        self.sizes: list[int] = []
        self.size = 0

    def alloc(self, n: int) -> int:
        best = -1
        for i, s in enumerate(self.sizes):
            if s >= n and (best < 0 or s < self.sizes[best]):
                best = i
                if s == n:
                    break
        if best >= 0:
            off = self.offsets[best]
            if self.sizes[best] == n:
                del self.offsets[best], self.sizes[best]
            else:
                self.offsets[best] += n
                self.sizes[best] -= n
            return off
        if self.offsets and self.offsets[-1] + self.sizes[-1] == self.size:
            off = self.offsets.pop()
            self.sizes.pop()
        else:
            off = self.size
        self.size = off + n
        return off

    def free(self, off: int, n: int) -> None:
        i = bisect.bisect_left(self.offsets, off)
        if i > 0 and self.offsets[i - 1] + self.sizes[i - 1] == off:
            i -= 1
            self.sizes[i] += n
        else:
            self.offsets.insert(i, off)
            self.sizes.insert(i, n)
        if i + 1 < len(self.offsets) and self.offsets[i] + self.sizes[i] == self.offsets[i + 1]:
            self.sizes[i] += self.sizes[i + 1]
            del self.offsets[i + 1], self.sizes[i + 1]


@dataclass
class _Record:
    """Bookkeeping for one tensor during planning (ggml's hash_node): kept beside the graph."""

    consumers: int = 0
    views: int = 0
    offset: int = -1
    size: int = 0
    owned: bool = False
    slot: int = -1  # the block of memory this tensor lives in (shared along an in-place chain)


@dataclass
class Plan:
    """Where each owned tensor goes, and the figures that describe the plan."""

    offsets: dict[Tensor, int]
    size: int  # bytes of buffer the plan needs
    lower_bound: int  # largest total of live bytes at any step
    no_reuse: int  # bytes if every tensor had its own memory
    inplace: list[tuple[Tensor, Tensor]] = field(default_factory=list)  # (node, source whose memory it took)
    sizes: dict[Tensor, int] = field(default_factory=dict)
    scratch: dict[Tensor, tuple[int, int]] = field(default_factory=dict)  # node -> (offset, bytes) of its work space


Owns = Callable[[Tensor], bool]
ScratchOf = Callable[[Tensor], int]


def plan_graph(nodes: list[Tensor], leafs: Iterable[Tensor], owns: Owns, alignment: int,
               reuse: bool = True, scratch_of: ScratchOf | None = None) -> Plan:
    """Plan the memory of every tensor `owns` accepts, walking `nodes` in execution order.

    Inputs (leafs flagged `is_input`) are placed first; each node is placed before its
    sources are released, in place on a dying same-sized source when its op allows.
    A node for which `scratch_of` asks work space (a kernel's dequantized weight tiles, its
    8-bit activations) gets it beside its result, live for that node's step only.
    With reuse=False every tensor keeps its own bytes (the reference plan `--verify` uses).
    """
    rec: dict[int, _Record] = {}

    def r(t: Tensor) -> _Record:
        x = rec.get(id(t))
        if x is None:
            x = rec[id(t)] = _Record()
        return x

    for n in nodes:
        if n.view_src is not None:
            r(n.view_src).views += 1
            if n.is_output:
                r(n.view_src).views += 1  # never released: an output view keeps its root alive to the end
        for s in n.srcs:
            r(s).consumers += 1

    free = FreeList()
    offsets: dict[Tensor, int] = {}
    sizes: dict[Tensor, int] = {}
    slot_of: dict[Tensor, int] = {}
    slots = _Slots()
    inplace: list[tuple[Tensor, Tensor]] = []
    live = peak = no_reuse = 0
    step = -1  # inputs exist before the first node

    def place(t: Tensor, donor: Tensor | None) -> None:
        nonlocal live, peak, no_reuse
        x = r(t)
        x.owned = True
        x.size = align_up(t.nbytes, alignment)
        no_reuse += x.size
        if donor is not None:
            d = r(donor)
            x.offset, d.offset = d.offset, -1  # the donor's bytes now belong to t
            x.slot = d.slot
            inplace.append((t, donor))
        else:
            x.offset = free.alloc(x.size)
            x.slot = slots.open(x.size, step)
            live += x.size
            peak = max(peak, live)
        offsets[t] = x.offset
        sizes[t] = x.size
        slot_of[t] = x.slot

    def release(t: Tensor) -> None:
        nonlocal live
        x = r(t)
        if x.owned and x.offset >= 0 and not t.is_output:
            free.free(x.offset, x.size)
            slots.close(x.slot, step)
            live -= x.size
            x.offset = -1

    for leaf in leafs:
        if leaf.is_input and owns(leaf):
            place(leaf, None)

    scratch: dict[Tensor, tuple[int, int]] = {}
    for step, n in enumerate(nodes):
        if n.view_src is None and owns(n):
            place(n, _inplace_donor(n, rec, owns) if reuse else None)
            need = scratch_of(n) if scratch_of is not None else 0
            if need:
                size = align_up(need, alignment)
                scratch[n] = (free.alloc(size), size)
                key = _ScratchKey(n)  # compared by identity: keep the one key
                slot_of[key] = slots.open(size, step)
                no_reuse += size
                peak = max(peak, live + size)
                if reuse:
                    free.free(scratch[n][0], size)
                    slots.close(slot_of[key], step)
        if not reuse:
            continue
        for s in n.srcs:
            x = r(s)
            x.consumers -= 1
            if x.consumers or x.views:
                continue
            if s.view_src is not None:
                v = r(s.view_src)
                v.views -= 1
                if v.views == 0 and v.consumers == 0:
                    release(s.view_src)
            else:
                release(s)
    size = free.size
    if reuse and size > OFFLINE_TRIGGER * peak:
        slot_offsets, offline_size = slots.place_offline()
        if offline_size < size:
            offsets = {t: slot_offsets[i] for t, i in slot_of.items() if not isinstance(t, _ScratchKey)}
            scratch = {k.node: (slot_offsets[i], scratch[k.node][1]) for k, i in slot_of.items()
                       if isinstance(k, _ScratchKey)}
            size = offline_size
    return Plan(offsets=offsets, size=size, lower_bound=peak, no_reuse=no_reuse, inplace=inplace, sizes=sizes,
                scratch=scratch)


@dataclass(frozen=True, eq=False)
class _ScratchKey:
    """Stands for a node's work space among the tensors of the offline placement."""

    node: Tensor


# The walk's best-fit plan is kept unless it exceeds the lower bound by more than this; then an
# offline placement over the same lifetimes is tried too, and the smaller plan wins.
OFFLINE_TRIGGER = 1.02


class _Slots:
    """Blocks of memory the walk handed out (an in-place chain shares one): size and the steps
    from which to which they are live, for an offline placement of the same lifetimes."""

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.born: list[int] = []
        self.died: list[int] = []

    def open(self, size: int, step: int) -> int:
        self.sizes.append(size)
        self.born.append(step)
        self.died.append(1 << 62)  # live to the end unless closed
        return len(self.sizes) - 1

    def close(self, slot: int, step: int) -> None:
        self.died[slot] = step

    def place_offline(self) -> tuple[list[int], int]:
        """Greedy by size: largest blocks first, each at the lowest offset that overlaps no placed
        block live at the same time. Blocks live at the same step conflict (a node is placed
        before its sources are released)."""
        sizes = np.asarray(self.sizes, dtype=np.int64)
        born = np.asarray(self.born, dtype=np.int64)
        died = np.asarray(self.died, dtype=np.int64)
        order = np.lexsort((born, -sizes))
        offsets = np.zeros(len(sizes), dtype=np.int64)
        placed = np.zeros(len(sizes), dtype=bool)
        top = 0
        for i in order:
            clash = placed & (born <= died[i]) & (born[i] <= died)
            starts = offsets[clash]
            by_start = np.argsort(starts, kind="stable")
            at = 0
            for lo, hi in zip(starts[by_start].tolist(), (starts + sizes[clash])[by_start].tolist()):
                if lo - at >= sizes[i]:
                    break
                at = max(at, hi)
            offsets[i] = at
            placed[i] = True
            top = max(top, at + int(sizes[i]))
        return offsets.tolist(), top


def _inplace_donor(n: Tensor, rec: dict[int, _Record], owns: Owns) -> Tensor | None:
    """n's first source, if n may take its memory: n is its last consumer, it has no live view,
    it is not a weight, input or output, it is ours, and it has n's exact size.

    Only the first source: kernels are written to be correct when `out` aliases their first
    source (swiglu writes silu(gate) into `out` before it reads `up`)."""
    if not OPS[n.op].inplace or not n.srcs:
        return None
    s = n.srcs[0]
    x = rec.get(id(s))
    if (x is not None and x.owned and x.offset >= 0 and x.consumers == 1 and x.views == 0
            and s.view_src is None and not (s.is_input or s.is_output or s.is_weight)
            and s.nbytes == n.nbytes and s.dtype == n.dtype and owns(s)):
        return s
    return None


class GraphAllocator:
    """One backend's compute buffer and the plans placed in it.

    `measure` plans without memory; `reserve` allocates a buffer for a worst-case graph;
    `alloc` places a graph into the reserved buffer, re-reserving (logged) when it needs more.
    """

    def __init__(self, backend, reuse: bool = True) -> None:
        self.backend = backend
        self.reuse = reuse
        self.buffer = None
        self.reserves = 0

    @property
    def alignment(self) -> int:
        return self.backend.buffer_type.alignment

    @property
    def reserved(self) -> int:
        return self.buffer.size if self.buffer is not None else 0

    def measure(self, nodes: list[Tensor], leafs: Iterable[Tensor], owns: Owns) -> Plan:
        return plan_graph(nodes, leafs, owns, self.alignment, self.reuse, self.backend.scratch_bytes)

    def reserve(self, nodes: list[Tensor], leafs: Iterable[Tensor], owns: Owns) -> Plan:
        plan = self.measure(nodes, leafs, owns)
        if plan.size > self.reserved:
            self._grow(plan.size)
        return plan

    def alloc(self, nodes: list[Tensor], leafs: Iterable[Tensor], owns: Owns) -> Plan:
        plan = self.measure(nodes, leafs, owns)
        if plan.size > self.reserved:
            if self.buffer is not None:
                log.warning("%s: graph needs %d bytes, %d reserved: re-reserving",
                            self.backend.name, plan.size, self.reserved)
            self._grow(plan.size)
        buf = self.buffer
        for t, off in plan.offsets.items():
            t.place(buf, off)
        for n, (off, size) in plan.scratch.items():
            n.scratch = new_tensor(f"{n.name}#scratch", DType.F32, (size // 4,))
            n.scratch.place(buf, off)
        return plan

    def _grow(self, size: int) -> None:
        self.buffer = self.backend.alloc_buffer(max(size, 1), usage="compute")
        self.reserves += 1

    def release(self) -> None:
        self.buffer = None
