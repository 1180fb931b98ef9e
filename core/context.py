"""Immediate contexts: tensors that get memory the moment they are created (weights, the KV
cache), each placed in a buffer of one backend.

Intermediate tensors never come from here; ops create them deferred and the graph
allocator places them.
"""
from __future__ import annotations

import numpy as np

from ggrun.core.backends.array_backend import storage_dtype
from ggrun.core.backends.base import Buffer
from ggrun.core.dtypes import DType, dtype_of_numpy
from ggrun.core.tensor import Tensor, new_tensor


class ImmediateContext:
    """Owns the buffers of the tensors it creates on one backend."""

    def __init__(self, backend, usage: str = "weights", virtual: bool = False, source: str | None = None) -> None:
        self.backend = backend
        self.usage = usage
        self.virtual = virtual  # tensors get a virtual buffer: a size and a backend, no memory
        self.tensors: dict[str, Tensor] = {}
        self.buffers: list = []
        self.repacked = 0  # bytes of weights re-laid for the backend's kernels (Backend.prepare_weight)
        # where the backend keeps what it re-lays from `source` (the weights' file) between runs
        self.prepared = backend.prepared_store(source) if source is not None and not virtual else None

    @property
    def nbytes(self) -> int:
        return sum(b.size for b in self.buffers) + self.repacked

    def prepare_weight(self, t: Tensor) -> int:
        """Let the backend re-lay weight t for its kernels, counting the bytes that adds (returned)."""
        added = self.backend.prepare_weight(t, self.prepared)
        self.repacked += added
        return added

    def save_prepared(self) -> None:
        """Keep what prepare_weight made for the next load of the same file (where the backend keeps it)."""
        if self.prepared is not None:
            self.prepared.save()

    def new_tensor(self, name: str, dtype: DType, shape: tuple[int, ...], weight: bool = False,
                   zeroed: bool = False) -> Tensor:
        """A tensor with fresh memory on this context's backend: uninitialised, or all zero bytes."""
        t = new_tensor(name, dtype, shape, is_weight=weight)
        if self.virtual:
            buf = Buffer(self.backend, None, self.usage, size=t.nbytes)
        elif zeroed:
            buf = self.backend.alloc_zeroed(max(t.nbytes, 1), usage=self.usage)
        else:
            buf = self.backend.alloc_buffer(max(t.nbytes, 1), usage=self.usage)
        self._adopt(t, buf)
        return t

    def from_array(self, name: str, data: np.ndarray, weight: bool = True) -> Tensor:
        """A tensor holding `data`; on the CPU a contiguous array is used in place, without a copy."""
        dtype = dtype_of_numpy(data.dtype)
        wrap = getattr(self.backend, "wrap", None)
        if wrap is not None and data.flags.c_contiguous:
            t = new_tensor(name, dtype, data.shape, is_weight=weight)
            self._adopt(t, wrap(data, self.usage))
            return t
        t = self.new_tensor(name, dtype, data.shape, weight=weight)
        self.backend.set_tensor(t, data)
        return t

    def from_bytes(self, name: str, dtype: DType, shape: tuple[int, ...], raw: np.ndarray,
                   weight: bool = True) -> Tensor:
        """A tensor of `dtype` stored as `raw` (its bytes as a file holds them: GGUF blocks for a
        quantized type). On the CPU the bytes are used in place (a memory-mapped file stays mapped)."""
        t = new_tensor(name, dtype, shape, is_weight=weight)
        if raw.nbytes != t.nbytes:
            raise ValueError(f"{name}: {raw.nbytes} bytes given for {t.describe()} ({t.nbytes} bytes)")
        wrap = getattr(self.backend, "wrap", None)
        if wrap is not None:
            self._adopt(t, wrap(raw, self.usage))
            return t
        t = self.new_tensor(name, dtype, shape, weight=weight)
        self.backend.set_tensor(t, raw if dtype.is_quantized else raw.view(storage_dtype(t)))
        return t

    def _adopt(self, t: Tensor, buf) -> None:
        t.place(buf, 0)
        self.buffers.append(buf)
        self.tensors[t.name] = t
