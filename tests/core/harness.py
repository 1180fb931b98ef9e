"""Shared helpers for the engine tests: run a graph through the real path (build graph ->
Scheduler([CPUBackend()]) -> schedule -> alloc -> set inputs -> compute -> get_tensor),
and bf16 conversions written independently of the kernels.
"""
from __future__ import annotations

import numpy as np

from ggrun.core.backends.cpu import CPUBackend
from ggrun.core.context import ImmediateContext
from ggrun.core.dtypes import DType
from ggrun.core.graph import build_graph
from ggrun.core.sched import ScheduledGraph, Scheduler
from ggrun.core.tensor import Tensor, new_tensor


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """Values of bf16 numbers stored as uint16."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round finite f32 values to the nearest bf16 (ties to even), by comparing the two candidates
    in float64; infinities keep their bits."""
    x = np.asarray(x, dtype=np.float32)
    lo_bits = x.view(np.uint32) & np.uint32(0xFFFF0000)
    hi_bits = lo_bits + np.uint32(0x10000)
    with np.errstate(invalid="ignore", over="ignore"):
        lo = lo_bits.view(np.float32).astype(np.float64)
        hi = hi_bits.view(np.float32).astype(np.float64)
        d_lo = np.abs(x.astype(np.float64) - lo)
        d_hi = np.abs(hi - x.astype(np.float64))
    lo_even = ((lo_bits >> 16) & 1) == 0
    pick_hi = np.isfinite(x) & ((d_hi < d_lo) | ((d_hi == d_lo) & ~lo_even))
    return (np.where(pick_hi, hi_bits, lo_bits) >> 16).astype(np.uint16)


def stored(values: np.ndarray, dtype: DType) -> np.ndarray:
    """values in the storage form of dtype (bf16 as uint16 bits)."""
    if dtype is DType.BF16:
        return f32_to_bf16(values)
    return np.asarray(values, dtype=dtype.np_dtype)


def as_f64(data: np.ndarray, dtype: DType) -> np.ndarray:
    """The float64 values of stored data (for references)."""
    if dtype is DType.BF16:
        return bf16_to_f32(data).astype(np.float64)
    return np.asarray(data, dtype=np.float64)


class Runner:
    """Builds tensors for one test and runs graphs over one backend (the CPU unless given).

    `weight` creates memory-backed leafs in an immediate context; `input` creates
    deferred input leafs whose data is set after allocation, as a model runtime does.
    """

    def __init__(self, seed: int = 0, backend=None) -> None:
        self.backend = backend if backend is not None else CPUBackend()
        self.ctx = ImmediateContext(self.backend)
        self.rng = np.random.default_rng(seed)
        self.feeds: dict[Tensor, np.ndarray] = {}
        self.sched: Scheduler | None = None
        self.sg: ScheduledGraph | None = None

    def random(self, *shape: int, dtype: DType = DType.F32, scale: float = 1.0) -> np.ndarray:
        """Random values in the storage form of dtype."""
        return stored(self.rng.standard_normal(shape).astype(np.float32) * scale, dtype)

    def weight(self, name: str, data: np.ndarray, dtype: DType | None = None) -> Tensor:
        dtype = dtype or _dtype_of(data)
        t = self.ctx.new_tensor(name, dtype, data.shape, weight=True)
        self.backend.set_tensor(t, data)
        return t

    def input(self, name: str, data: np.ndarray, dtype: DType | None = None) -> Tensor:
        dtype = dtype or _dtype_of(data)
        t = new_tensor(name, dtype, data.shape, is_input=True)
        self.feeds[t] = data
        return t

    def run(self, *outputs: Tensor) -> list[np.ndarray]:
        """Compute `outputs` through the scheduler and return host copies of them."""
        self.sched = Scheduler([self.backend])
        self.sg = self.sched.schedule(build_graph(list(outputs)))
        self.sched.alloc(self.sg)
        for t, data in self.feeds.items():
            if t.buffer is not None:
                self.sched.set_tensor(t, data)
        self.sched.compute(self.sg)
        return [self.sched.get_tensor(o) for o in outputs]

    def run1(self, output: Tensor) -> np.ndarray:
        return self.run(output)[0]


def _dtype_of(data: np.ndarray) -> DType:
    return {np.dtype(np.float32): DType.F32, np.dtype(np.float16): DType.F16,
            np.dtype(np.uint16): DType.BF16, np.dtype(np.int32): DType.I32}[data.dtype]
