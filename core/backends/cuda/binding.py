"""How CUDA kernels are bound to nodes: the backend's binder table, the Step a binder returns
(a launch with every argument resolved, or a host-driven call such as a cuBLAS product), and the
small helpers binders share to read shapes, strides and addresses off cupy arrays."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

import numpy as np

from ggrun.core.backends.binders import BinderTable
from ggrun.core.backends.cuda import launch

TABLE = BinderTable()
binds = TABLE.binds
FUSIONS: list[tuple[tuple[str, ...], Callable]] = []


def fuses(*ops: str):
    """Register `fn(nodes, outs, srcs, backend) -> Step | None` for a run of consecutive nodes of these
    ops: one kernel for all of them, which the backend tries before binding the nodes one by one."""
    def register(fn: Callable) -> Callable:
        FUSIONS.append((ops, fn))
        return fn
    return register


@dataclass
class Step:
    """One node's work: `run()` issues it on the current stream. Steps that call ggrun's own kernels and
    cuBLAS through blas.py can be captured into a CUDA graph; cupy array code cannot."""

    run: Callable[[], None]
    capturable: bool = True
    name: str = ""

    def __call__(self) -> None:
        self.run()


@dataclass
class Launch:
    """A kernel launch with its grid, block, arguments and dynamic shared memory."""

    kernel: Any
    grid: tuple
    block: tuple
    args: tuple
    smem: int = 0
    prologue: bool = False  # work before pdl_begin, done only when started early (the last argument says so)
    light: bool = False  # its prologue reads little (a few cached rows, not a weight): it always starts early
    early: bool = False  # started while the kernel before still runs (PDL; launch.plan decides)
    _issue: Callable[[], None] | None = field(default=None, init=False, repr=False, compare=False)

    def __call__(self) -> None:
        if self._issue is None:  # arguments packed once, at the first call
            if self.early:
                self._issue = launch.PDLLaunch(self.kernel, self.grid, self.block, self.args, self.smem)
            else:
                self._issue = partial(self.kernel, self.grid, self.block, self.args, shared_mem=self.smem)
        self._issue()


@dataclass
class Launches:
    """Several launches run in order, as one step."""

    items: list = field(default_factory=list)

    def __call__(self) -> None:
        for launch in self.items:
            launch()


def nothing() -> None:
    """The step of a node without elements, or of a node a fused kernel before it serves."""


def launch_step(name: str, *launches: Launch) -> Step:
    return Step(launches[0] if len(launches) == 1 else Launches(list(launches)), True, name)


def launches_of(steps: list[Step]) -> list[Launch | None]:
    """The launches of steps in order; None for a step's work that is not a Launch (host-driven calls)."""
    out: list[Launch | None] = []
    for step in steps:
        run = step.run
        if isinstance(run, Launch):
            out.append(run)
        elif isinstance(run, Launches):
            out.extend(run.items)
        elif run is not nothing:
            out.append(None)
    return out


def ptr(arr) -> np.uint64:
    """Device address of an array's first element, as a kernel argument."""
    return np.uint64(arr.data.ptr)


NULL = np.uint64(0)


def i64(x: int) -> np.int64:
    return np.int64(x)


def i32(x: int) -> np.int32:
    return np.int32(x)


def f32(x: float) -> np.float32:
    return np.float32(x)


def estrides(arr) -> tuple[int, ...]:
    """Strides in elements."""
    return tuple(s // arr.itemsize for s in arr.strides)


def extent(arr) -> tuple[int, int]:
    """[first, last) device bytes an array's elements may touch."""
    lo = hi = arr.data.ptr
    for size, stride in zip(arr.shape, arr.strides):
        if size == 0:
            return lo, lo
        span = (size - 1) * stride
        lo, hi = (lo + span, hi) if span < 0 else (lo, hi + span)
    return lo, hi + arr.itemsize


def disjoint(a, b) -> bool:
    (a0, a1), (b0, b1) = extent(a), extent(b)
    return a1 <= b0 or b1 <= a0


def writes_apart(writes: list, reads: list, in_place: tuple = ()) -> bool:
    """Whether one kernel may write the results of several nodes (`writes`, contiguous arrays in the nodes'
    order, each element's values stored by one thread in that order) while it reads `reads`: the planner
    lets a node's result take memory of results dead before it, which a fused kernel writes at the same
    time. Two results may share memory only exactly (a node in place on the one before: the later store
    wins, as it would unfused), and none may touch what the kernel reads, but an array of `in_place` exactly
    (contiguous, its elements read by the threads that store the same elements, before they do)."""
    def same(a, b) -> bool:
        return a.data.ptr == b.data.ptr and a.nbytes == b.nbytes and a.flags.c_contiguous and b.flags.c_contiguous

    for i, w in enumerate(writes):
        if any(not disjoint(w, r) for r in reads) or any(not (same(w, r) or disjoint(w, r)) for r in in_place):
            return False
        if any(not (same(v, w) or disjoint(v, w)) for v in writes[:i]):
            return False
    return True


def rows_of(arr) -> tuple[int, int, int] | None:
    """(rows, n, row stride in elements) when arr is rows of n contiguous elements at a fixed
    stride (its leading axes collapse into one), else None."""
    if arr.ndim == 0 or (arr.strides[-1] != arr.itemsize and arr.shape[-1] > 1):
        return None
    n = arr.shape[-1]
    if arr.ndim == 1:
        return 1, n, n
    strides = estrides(arr)
    rows, ld = 1, strides[-2]
    expect = ld
    for size, stride in zip(reversed(arr.shape[:-1]), reversed(strides[:-1])):
        if size > 1 and stride != expect:
            return None
        expect = expect * size
        rows *= size
    return rows, n, ld


def pad4(shape: tuple[int, ...], strides: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Shape and element strides padded in front to 4 axes, or None beyond 4."""
    if len(shape) > 4:
        return None
    k = 4 - len(shape)
    return (1,) * k + tuple(shape), (0,) * k + tuple(strides)


def grid1d(n: int, block: int = 256) -> tuple[tuple, tuple]:
    return (max(1, -(-n // block)),), (block,)


def threads_for(n: int, most: int = 1024) -> int:
    """A block size for a row of n elements: a multiple of 32 up to `most`."""
    return max(32, min(most, -(-n // 32) * 32))
