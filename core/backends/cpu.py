"""The CPU backend: numpy arenas and the shared array kernels run with numpy.

Kernels write into views of the arena at each tensor's planned offset; a placed tensor's
array is a numpy view, cached on the tensor until it is placed again.
"""
from __future__ import annotations

import numpy as np

from core.backends.base import Backend, Buffer, BufferType
from core.backends.kernels import KERNELS
from core.dtypes import DType
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


class CPUBackend(Backend):
    """numpy on the host; runs every op."""

    name = "CPU"
    buffer_type = BufferType(alignment=64, max_size=1 << 44)

    def __init__(self) -> None:
        self.device = "host memory, numpy"

    def alloc_buffer(self, size: int, usage: str) -> Buffer:
        return Buffer(self, np.empty(size, dtype=np.uint8), usage)

    def wrap(self, data: np.ndarray, usage: str) -> Buffer:
        """A buffer over existing host bytes (weights memory-mapped from a file), without a copy."""
        return Buffer(self, data.reshape(-1).view(np.uint8), usage)

    def supports_op(self, node: Tensor) -> bool:
        return node.op in KERNELS

    def array(self, t: Tensor) -> np.ndarray:
        self.check_owned(t)
        arr = t._array
        if arr is not None:
            return arr
        arr = _view_array(t, t.root.buffer.storage)
        t._array = arr
        return arr

    def compute(self, nodes: list[Tensor]) -> None:
        for fn, node, out, srcs in self.prepare(nodes):
            fn(np, node, out, srcs)

    def prepare(self, nodes: list[Tensor]) -> list[tuple]:
        """Kernel calls with their arrays resolved once, to be run many times (graph reuse)."""
        arr = self.array
        return [(KERNELS[n.op], n, arr(n), [arr(s) for s in n.srcs]) for n in nodes]

    def run_prepared(self, calls: list[tuple]) -> None:
        for fn, node, out, srcs in calls:
            fn(np, node, out, srcs)

    def set_tensor(self, t: Tensor, data: np.ndarray) -> None:
        dst = self.array(t)
        dst[...] = np.asarray(data).reshape(dst.shape)

    def get_tensor(self, t: Tensor) -> np.ndarray:
        return np.array(self.array(t), copy=True)


def _view_array(t: Tensor, storage) -> np.ndarray:
    """A numpy view over t's elements inside `storage` (a flat uint8 arena)."""
    if t.dtype.is_quantized:
        return storage[t.data_offset:t.data_offset + t.nbytes]
    np_dtype = t.dtype.np_dtype if t.dtype is not DType.BF16 else np.dtype(np.uint16)
    return np.ndarray(t.shape, dtype=np_dtype, buffer=storage, offset=t.data_offset, strides=t.strides)
