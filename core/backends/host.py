"""Host-memory array backends: numpy arenas, placed tensors as numpy views at their offsets,
and the shared reference array kernels run with numpy.

Kernels write into views of the arena at each tensor's planned offset; a placed tensor's
array is a numpy view, cached on the tensor until it is placed again.
"""
from __future__ import annotations

import os

import numpy as np

from ggrun.core.backends.array_backend import ArrayBackend, storage_dtype
from ggrun.core.backends.base import Buffer, BufferType
from ggrun.core.tensor import Tensor


class HostArrayBackend(ArrayBackend):
    """numpy on the host, every op through the reference array kernels."""

    buffer_type = BufferType(alignment=64, max_size=1 << 44)
    xp = np
    stores_blocks = True
    memory_pool = "CPU"

    def free_memory(self) -> int | None:
        return host_available_bytes()

    def alloc_buffer(self, size: int, usage: str) -> Buffer:
        return Buffer(self, np.empty(size, dtype=np.uint8), usage)

    def alloc_zeroed(self, size: int, usage: str) -> Buffer:
        """np.zeros takes a large buffer as pages the OS zeroes when each is first written: nothing is
        written now, and a page no cell reaches takes no memory (a KV cache of the training context,
        -c 0, is mostly such pages)."""
        return Buffer(self, np.zeros(size, dtype=np.uint8), usage)

    def wrap(self, data: np.ndarray, usage: str) -> Buffer:
        """A buffer over existing host bytes (weights memory-mapped from a file), without a copy."""
        return Buffer(self, data.reshape(-1).view(np.uint8), usage)

    def view_array(self, t: Tensor, storage: np.ndarray) -> np.ndarray:
        if t.dtype.is_quantized:
            rows = t.shape[:-1]
            flat = storage[t.data_offset:t.data_offset + t.nbytes]
            return flat.reshape(rows + (t.dtype.row_bytes(t.shape[-1]),)) if t.is_contiguous else flat
        return np.ndarray(t.shape, dtype=storage_dtype(t), buffer=storage, offset=t.data_offset, strides=t.strides)

    def set_tensor(self, t: Tensor, data: np.ndarray) -> None:
        dst = self.array(t)
        dst[...] = np.asarray(data).reshape(dst.shape)

    def get_tensor(self, t: Tensor) -> np.ndarray:
        return np.array(self.array(t), copy=True)


def host_available_bytes() -> int | None:
    """Memory the host can give without swapping: /proc/meminfo's MemAvailable (free memory plus
    page cache it can drop), else free pages where the OS reports them, else None."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None
