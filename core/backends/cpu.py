"""The CPU backend: numpy arenas and the shared array kernels run with numpy.

Kernels write into views of the arena at each tensor's planned offset; a placed tensor's
array is a numpy view, cached on the tensor until it is placed again.
"""
from __future__ import annotations

import numpy as np

from core.backends.array_backend import ArrayBackend, storage_dtype
from core.backends.base import Buffer, BufferType
from core.tensor import Tensor

_thread_limit = None


def set_threads(n: int | None) -> None:
    """Threads numpy's BLAS may use (llama.cpp's -t); None keeps the library's default.

    An oversubscribed machine makes multi-threaded BLAS many times slower, so users need this.
    """
    global _thread_limit
    if n is None:
        return
    from threadpoolctl import threadpool_limits

    _thread_limit = threadpool_limits(limits=n, user_api="blas")


class CPUBackend(ArrayBackend):
    """numpy on the host; runs every op."""

    name = "CPU"
    buffer_type = BufferType(alignment=64, max_size=1 << 44)
    xp = np

    def __init__(self) -> None:
        self.device = "host memory, numpy"

    def alloc_buffer(self, size: int, usage: str) -> Buffer:
        return Buffer(self, np.empty(size, dtype=np.uint8), usage)

    def wrap(self, data: np.ndarray, usage: str) -> Buffer:
        """A buffer over existing host bytes (weights memory-mapped from a file), without a copy."""
        return Buffer(self, data.reshape(-1).view(np.uint8), usage)

    def view_array(self, t: Tensor, storage: np.ndarray) -> np.ndarray:
        if t.dtype.is_quantized:
            return storage[t.data_offset:t.data_offset + t.nbytes]
        return np.ndarray(t.shape, dtype=storage_dtype(t), buffer=storage, offset=t.data_offset, strides=t.strides)

    def set_tensor(self, t: Tensor, data: np.ndarray) -> None:
        dst = self.array(t)
        dst[...] = np.asarray(data).reshape(dst.shape)

    def get_tensor(self, t: Tensor) -> np.ndarray:
        return np.array(self.array(t), copy=True)
